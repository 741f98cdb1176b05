"""Whether a worker serves: the serving loop's health, and the error of a worker that does
not (torch-free, so the front door and `workers.api` read them without the model)."""

from __future__ import annotations

from dataclasses import dataclass

from workers.errors import ServingStopped

__all__ = ["ServingHealth", "ServingStopped"]


@dataclass(frozen=True)
class ServingHealth:
    """Whether a worker's serving loop runs, as the front door's watchdog asks it.

    A loop that fails is restarted in the worker's process after RESTART_DELAY_S, at most
    MAX_RESTARTS times a RESTART_WINDOW_S (`workers.serving.loop`); meanwhile, and for good
    past that, the worker refuses requests at once and reports `serving` False.
    """

    serving: bool
    restarts: int  # how often the loop failed and was started again
    last_failure: str  # the last exception that ended the loop ("" when none did)
    stalled_s: float  # how long work has waited without a pass finishing (0: none waits)

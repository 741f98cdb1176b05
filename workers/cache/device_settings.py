"""A worker's device tier as its config names it: where its pages live above host memory.

Light on purpose, like `disk_settings`: the config and the worker's settings import it,
which must not load torch (`workers.tier_setup` opens the tier).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# "cuda" (or "cuda:N"): the worker's GPU, required; "auto": the GPU where the worker has
# one, else no device tier (host shared memory is the page store, as on every CPU node);
# "cpu": a tier of private host memory above shared memory, which stands in for a device
# where there is none (tests: the same code as on a GPU, with plain memory for staging).
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceSettings:
    """A worker's device tier: its pages live on `device`, `pages` of them, and the host
    shared-memory store (the worker's `num_pages`) is the tier below, where the pages the
    device evicts go and are found again.

    Attributes:
        device: one of DEVICES, or "cuda:N".
        pages: pages the device tier holds.
    """

    device: str = "auto"
    pages: int = 1024

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not re.fullmatch(r"cuda:\d{1,2}", self.device):
            raise ValueError(f"store.device {self.device!r}: one of {', '.join(DEVICES)} or cuda:N")
        if isinstance(self.pages, bool) or not isinstance(self.pages, int) or self.pages < 1:
            raise ValueError(f"store.device_pages must be a positive int, got {self.pages!r}")

"""Copy or recompute: what a request's cached pages cost to copy in against what their
tokens cost to prefill, both from measurements of this machine.

Three parts, each small:

- `PrefillProfile`: the model's prefill time as a function of prompt length, measured once
  per model and machine at a few lengths (cached on disk next to the model) and refined by
  every real prefill. Prefill grows faster than linearly with length (each token attends
  over everything before it), so the cost of tokens [context, context + computed) is read
  off the curve as a difference, not as tokens / rate.
- `LinkRates`: how fast pages arrive from each holder: a per-fetch latency and a byte rate;
  same node from a memcpy probe, other nodes from a loopback ZMQ probe, then per holder an
  EWMA of the real fetches.
- `decide`: per request, the time of a concurrent copy of the planned pages plus the
  prefill of what is left, against the prefill of everything after the local prefix. The
  copied pages' tokens are what is saved, so the answer depends on how many pages and
  where in the prompt they lie; it may also copy only the first tasks of a plan.

Decision policies are pluggable (`POLICIES`): "measured" (the default), "always" and
"never" (for tests and benchmarks that measure one path on purpose).

Everything here is plain Python except the measurement helpers at the end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

PROFILE_FILE = "prefill-profile.json"
PROFILE_FORMAT = 1
# Prompt lengths measured (capped by what the model and the store can hold). Length 1 is a
# forward's fixed cost: every prefill pays it, copied prefix or not. Measured at a worker's
# first start on a machine (about 4 s for SmolLM2 on a CPU core: longer prompts would cost
# far more), extended linearly past 512 and refined by every real prefill after that.
PROFILE_LENGTHS = (1, 64, 512)
# A real prefill's time over the curve's estimate is clamped to this range before it moves
# the correction: one prefill stalled behind another process must not wreck the curve.
MAX_CORRECTION = 10.0
EWMA_ALPHA = 0.3  # weight of the newest observation (profile corrections and link rates)
FASTEST_LINK_BYTES_PER_S = 1e12  # a floor on seconds per byte, so no rate is infinite


# ---------------------------------------------------------------------------- prefill


class PrefillPoint(NamedTuple):
    tokens: int  # prompt length of a full prefill (no cached prefix)
    seconds: float  # its forward time


class PrefillProfile:
    """Prefill time against prompt length, interpolated between measured points.

    M(n), the time of a full prefill of n tokens, is piecewise linear through the measured
    points, flat below the first (a forward's fixed cost) and extended past the last with
    the last segment's slope. Computing tokens [context, context + computed) costs

        M(0) + M(context + computed) - M(context)

    (the fixed cost once, plus the work those tokens add), times a correction factor of
    the bucket (measured segment) its computed token count falls in: an EWMA of real
    prefill time over this estimate. Buckets go by tokens computed, not by where the
    prefill ends: a one-token suffix after a long copied prefix is mostly fixed cost, and
    must not move the estimate of computing that whole prompt.

    Args:
        points: measured full prefills, at least one, distinct lengths >= 1.
        key: what the measurement is valid for (model and machine), kept with it on disk.
    Raises:
        ValueError: no points, a length < 1 or repeated, or a time that is not > 0.
    """

    def __init__(self, points: Sequence[PrefillPoint], key: str = ""):
        points = sorted(PrefillPoint(int(n), float(s)) for n, s in points)
        if not points:
            raise ValueError("a prefill profile needs at least one measured point")
        for a, b in zip(points, points[1:], strict=False):
            if a.tokens == b.tokens:
                raise ValueError(f"prompt length {a.tokens} measured twice")
        for n, s in points:
            if n < 1 or not (s > 0 and math.isfinite(s)):
                raise ValueError(f"bad profile point ({n} tokens, {s} s)")
        # M must not fall with length: a noisy measurement of a longer prompt that came
        # out faster is raised to its predecessor's time.
        for i in range(1, len(points)):
            if points[i].seconds < points[i - 1].seconds:
                points[i] = points[i]._replace(seconds=points[i - 1].seconds)
        self.points = tuple(points)
        self.key = key
        self._lock = threading.Lock()
        self._correction = [1.0] * len(points)  # bucket i: computing <= points[i] tokens
        self.observed = [0] * len(points)

    def full(self, tokens: float) -> float:
        """M(tokens): the measured curve, uncorrected."""
        pts = self.points
        if tokens <= pts[0].tokens:
            return pts[0].seconds
        for a, b in zip(pts, pts[1:], strict=False):
            if tokens <= b.tokens:
                return a.seconds + (b.seconds - a.seconds) * (tokens - a.tokens) / (
                    b.tokens - a.tokens
                )
        if len(pts) == 1:
            # One point: linear through it (its time is all fixed cost and work alike).
            return pts[0].seconds * tokens / pts[0].tokens
        a, b = pts[-2], pts[-1]
        return b.seconds + (b.seconds - a.seconds) / (b.tokens - a.tokens) * (tokens - b.tokens)

    def seconds(self, computed_tokens: int, context_tokens: int) -> float:
        """Estimated forward time of computing `computed_tokens` after `context_tokens`
        whose KV is already in place. Zero tokens cost nothing."""
        if computed_tokens <= 0:
            return 0.0
        end = context_tokens + computed_tokens
        raw = self.full(0) + self.full(end) - self.full(context_tokens)
        with self._lock:
            return raw * self._correction[self._bucket(computed_tokens)]

    def observe(self, computed_tokens: int, context_tokens: int, seconds: float) -> None:
        """Refine the curve's bucket from a real prefill of that shape and its time."""
        if computed_tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        end = context_tokens + computed_tokens
        raw = self.full(0) + self.full(end) - self.full(context_tokens)
        ratio = min(MAX_CORRECTION, max(1.0 / MAX_CORRECTION, seconds / raw))
        with self._lock:
            b = self._bucket(computed_tokens)
            old = self._correction[b]
            blended = (
                ratio if self.observed[b] == 0 else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * ratio
            )
            # Clamped again: a blend of two values at the bound can round just past it.
            self._correction[b] = min(MAX_CORRECTION, max(1.0 / MAX_CORRECTION, blended))
            self.observed[b] += 1

    def corrections(self) -> list[float]:
        with self._lock:
            return list(self._correction)

    def _bucket(self, tokens: int) -> int:
        for i, point in enumerate(self.points):
            if tokens <= point.tokens:
                return i
        return len(self.points) - 1

    # -- the disk cache ------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the measured points (not the corrections: they are this process's)
        atomically, so concurrent workers never read half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "format": PROFILE_FORMAT,
            "key": self.key,
            "points": [list(p) for p in self.points],
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, key: str) -> PrefillProfile | None:
        """The profile saved at `path` for `key`; None when absent, for another key or
        format, or unreadable (then it is measured again)."""
        try:
            body = json.loads(path.read_text())
            if body.get("format") != PROFILE_FORMAT or body.get("key") != key:
                return None
            return cls([PrefillPoint(*p) for p in body["points"]], key)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("prefill profile %s unreadable (%s): measuring again", path, exc)
            return None

    @classmethod
    def measure(
        cls,
        prefill: Callable[[int], float],
        lengths: Sequence[int] = PROFILE_LENGTHS,
        max_tokens: int | None = None,
        repeats: int = 2,
        key: str = "",
    ) -> PrefillProfile:
        """Time `prefill(n)` (which returns the seconds a full prefill of n tokens took) at
        each length up to `max_tokens`, keeping the fastest of `repeats` runs (the others
        waited on something else), after one warm-up run.

        Raises:
            ValueError: no length fits under `max_tokens`.
        """
        wanted = sorted({n for n in lengths if max_tokens is None or n <= max_tokens})
        if max_tokens is not None and wanted and wanted[-1] < max_tokens < max(lengths):
            # a cap below the longest length: the longest prompt that fits is worth a point
            # (a cap above it is not: an 8k-token prefill takes a minute on a CPU, and the
            # curve extends past its last point)
            wanted.append(max_tokens)
        if not wanted:
            raise ValueError(f"no profile length fits in {max_tokens} tokens")
        prefill(wanted[0])  # warm-up: first calls pay for allocations
        points = [PrefillPoint(n, min(prefill(n) for _ in range(repeats))) for n in wanted]
        return cls(points, key)

    @classmethod
    def cached(
        cls,
        path: Path | None,
        key: str,
        prefill: Callable[[int], float],
        lengths: Sequence[int] = PROFILE_LENGTHS,
        max_tokens: int | None = None,
    ) -> PrefillProfile:
        """The profile for `key`: from this process's memo, else from `path`, else
        measured (and saved to `path`; None keeps it in this process only)."""
        with _MEMO_LOCK:
            points = _MEMO.get(key)
        if points is None:
            found = None if path is None else cls.load(path, key)
            if found is None:
                found = cls.measure(prefill, lengths, max_tokens, key=key)
                if path is not None:
                    try:
                        found.save(path)
                    except OSError as exc:
                        log.warning("prefill profile not saved to %s: %s", path, exc)
            points = found.points
            with _MEMO_LOCK:
                _MEMO[key] = points
        return cls(points, key)  # a profile of its own: its corrections are its worker's

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._correction) == len(self.points) == len(self.observed)
            for c in self._correction:
                assert 1.0 / MAX_CORRECTION <= c <= MAX_CORRECTION, self._correction
            assert all(n >= 0 for n in self.observed)
        for a, b in zip(self.points, self.points[1:], strict=False):
            assert a.tokens < b.tokens and a.seconds <= b.seconds, self.points


_MEMO: dict[str, tuple[PrefillPoint, ...]] = {}
_MEMO_LOCK = threading.Lock()


def machine_key(model: str, threads: int) -> str:
    """What a prefill profile is valid for: the model, this host and its CPU share."""
    return f"{model}|{socket.gethostname()}|cpus={os.cpu_count()}|threads={threads}"


# ---------------------------------------------------------------------------- links


class Link(NamedTuple):
    """How pages arrive from one holder: each fetch costs latency_s + bytes / bytes_per_s."""

    remote: bool
    bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes: int, fetches: int = 1) -> float:
        return fetches * self.latency_s + nbytes / self.bytes_per_s


class LinkRates:
    """Link estimates per holder: a probe's figures until a holder's first real fetch,
    then an EWMA of its real fetches' seconds per byte (after the latency).

    Args:
        shm_bytes_per_s: the same-node memcpy probe.
        remote_bytes_per_s, remote_latency_s: the loopback ZMQ probe.
    Raises:
        ValueError: a rate that is not > 0 or a latency < 0.
    """

    def __init__(self, shm_bytes_per_s: float, remote_bytes_per_s: float, remote_latency_s: float):
        if not (shm_bytes_per_s > 0 and remote_bytes_per_s > 0 and remote_latency_s >= 0):
            raise ValueError(
                f"bad link probe: shm {shm_bytes_per_s} B/s, remote {remote_bytes_per_s} "
                f"B/s, latency {remote_latency_s} s"
            )
        self.probe = {
            False: Link(False, shm_bytes_per_s, 0.0),
            True: Link(True, remote_bytes_per_s, remote_latency_s),
        }
        self._lock = threading.Lock()
        self._s_per_byte: dict[str, float] = {}  # holder -> EWMA
        self._remote: dict[str, bool] = {}
        self.fetches: dict[str, int] = {}

    def link(self, holder: str, remote: bool, prior: Link | None = None) -> Link:
        """The current estimate for `holder`'s link; before its first real fetch, `prior`
        if given (a peer's disk), else the probe's."""
        probe = self.probe[remote]
        with self._lock:
            s_per_byte = self._s_per_byte.get(holder)
        if s_per_byte is None:
            return probe if prior is None else prior
        return probe._replace(bytes_per_s=1.0 / s_per_byte)

    def measured(self, remote: bool) -> Link:
        """The link a copy from a holder of this kind (on another node, or on this one)
        is expected to take: the median of the holders' measured links of that kind, or
        the probe's before any real fetch (what the heartbeat reports for routing)."""
        with self._lock:
            rates = sorted(
                1.0 / s for h, s in self._s_per_byte.items() if self._remote[h] == remote
            )
        if not rates:
            return self.probe[remote]
        return self.probe[remote]._replace(bytes_per_s=statistics.median(rates))

    def observe(self, holder: str, remote: bool, nbytes: int, seconds: float) -> None:
        """A real fetch of `nbytes` from `holder` took `seconds`."""
        if nbytes <= 0 or not (seconds >= 0 and math.isfinite(seconds)):
            return
        latency = self.probe[remote].latency_s
        sample = max(seconds - latency, 0.0) / nbytes
        sample = max(sample, 1.0 / FASTEST_LINK_BYTES_PER_S)
        with self._lock:
            old = self._s_per_byte.get(holder)
            # The first real fetch replaces the probe (a guess from loopback or a memcpy).
            self._s_per_byte[holder] = (
                sample if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * sample
            )
            self._remote[holder] = remote
            self.fetches[holder] = self.fetches.get(holder, 0) + 1

    def forget(self, holder: str) -> None:
        """A peer left: its figures go with it."""
        with self._lock:
            self._s_per_byte.pop(holder, None)
            self._remote.pop(holder, None)
            self.fetches.pop(holder, None)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per holder seen, and the probes: bytes/s and latency (for stats)."""
        out = {
            f"probe:{'remote' if remote else 'same_node'}": {
                "bytes_per_s": link.bytes_per_s,
                "latency_s": link.latency_s,
            }
            for remote, link in self.probe.items()
        }
        with self._lock:
            holders = dict(self._remote)
        for holder, remote in sorted(holders.items()):
            link = self.link(holder, remote)
            out[holder] = {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s}
        return out

    def check_integrity(self) -> None:
        with self._lock:
            assert set(self._s_per_byte) == set(self._remote) == set(self.fetches)
            for holder, s in self._s_per_byte.items():
                assert s >= 1.0 / FASTEST_LINK_BYTES_PER_S and math.isfinite(s), (holder, s)
                assert self.fetches[holder] >= 1, holder
        for link in self.probe.values():
            assert link.bytes_per_s > 0 and link.latency_s >= 0, link


# ---------------------------------------------------------------------------- deciding


class Share(NamedTuple):
    """One task of a copy plan as the decision sees it, in prompt order."""

    holder: str
    pages: int


class Decision(NamedTuple):
    """Copy the first `tasks` tasks of a plan (copy=True), or recompute everything."""

    copy: bool
    tasks: int  # leading tasks of the plan to run (0 when not copying)
    copy_s: float  # estimate: the concurrent copy of those tasks + the prefill after them
    recompute_s: float  # estimate: the prefill of everything after the local prefix
    reason: str  # one of REASONS


REASONS = (
    "copy cheaper",
    "copy part cheaper",
    "recompute cheaper",
    "policy always",
    "policy never",
)


class CopyCosts(NamedTuple):
    """What a decision weighs: a plan and the request's shape."""

    shares: Sequence[Share]  # the plan's tasks in prompt order
    links: Mapping[str, Link]  # per holder in the plan
    page_bytes: int
    page_tokens: int
    prompt_tokens: int
    local_tokens: int  # already in place from the local cache

    def copy_seconds(self, tasks: int) -> float:
        """The concurrent copy of the first `tasks` shares: holders run in parallel, each
        one fetch per task, so the slowest holder sets the time."""
        busy: dict[str, float] = {}
        for share in self.shares[:tasks]:
            link = self.links[share.holder]
            busy[share.holder] = busy.get(share.holder, 0.0) + link.seconds(
                share.pages * self.page_bytes
            )
        return max(busy.values(), default=0.0)

    def copied_tokens(self, tasks: int) -> int:
        pages = sum(s.pages for s in self.shares[:tasks])
        return min(self.local_tokens + pages * self.page_tokens, self.prompt_tokens - 1)


def decide_measured(costs: CopyCosts, profile: PrefillProfile) -> Decision:
    """The cheapest of: recompute everything after the local prefix, or copy the first k
    tasks and compute the rest, for every k (a slow holder's share late in the plan may be
    cheaper to recompute than to wait for)."""
    recompute = profile.seconds(costs.prompt_tokens - costs.local_tokens, costs.local_tokens)
    best_k, best = 0, recompute
    for k in range(1, len(costs.shares) + 1):
        copied = costs.copied_tokens(k)
        total = costs.copy_seconds(k) + profile.seconds(costs.prompt_tokens - copied, copied)
        if total < best:
            best_k, best = k, total
    if best_k == 0:
        full = len(costs.shares)
        copy_all = costs.copy_seconds(full) + profile.seconds(
            costs.prompt_tokens - costs.copied_tokens(full), costs.copied_tokens(full)
        )
        return Decision(False, 0, copy_all, recompute, "recompute cheaper")
    reason = "copy cheaper" if best_k == len(costs.shares) else "copy part cheaper"
    return Decision(True, best_k, best, recompute, reason)


def decide_always(costs: CopyCosts, profile: PrefillProfile) -> Decision:
    """Copy every planned page (tests and benchmarks of the copy path)."""
    full = len(costs.shares)
    decision = decide_measured(costs, profile)
    return decision._replace(copy=full > 0, tasks=full, reason="policy always")


def decide_never(costs: CopyCosts, profile: PrefillProfile) -> Decision:
    """Recompute always (what serving costs without remote hits)."""
    decision = decide_measured(costs, profile)
    return decision._replace(copy=False, tasks=0, reason="policy never")


POLICIES: dict[str, Callable[[CopyCosts, PrefillProfile], Decision]] = {
    "measured": decide_measured,
    "always": decide_always,
    "never": decide_never,
}


def policy(name: str) -> Callable[[CopyCosts, PrefillProfile], Decision]:
    """The decision policy called `name`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown copy policy {name!r}; known: {', '.join(POLICIES)}") from None


def decide(costs: CopyCosts, profile: PrefillProfile, policy_name: str = "measured") -> Decision:
    """Copy or recompute this request's planned pages, by the named policy."""
    return policy(policy_name)(costs, profile)


# ---------------------------------------------------------------------------- measuring


def measure_links(page_bytes: int, encrypted: bool) -> LinkRates:
    """Probe this machine: memcpy of page-sized runs (same node), and a loopback ZMQ bulk
    transfer (other nodes; encrypted when page copies are) and a one-frame round trip for
    the per-fetch latency. The page server reaches the bulk rate at best, so real fetches
    correct it per holder."""
    import torch

    from workers.transfer.raw_pipe import RawZmqPipe

    src = torch.ones(8 * page_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    best = math.inf
    for _ in range(4):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    shm_bps = src.numel() / max(best, 1e-9)
    pipe = RawZmqPipe(8 * page_bytes, page_bytes, curve=encrypted)
    ping = RawZmqPipe(64, 64, curve=encrypted)
    try:
        pipe.transfer()  # warm-up: connection and first buffers
        start = time.perf_counter()
        pipe.transfer()
        remote_bps = 8 * page_bytes / max(time.perf_counter() - start, 1e-9)
        ping.transfer()
        latency = math.inf
        for _ in range(3):
            start = time.perf_counter()
            ping.transfer()
            latency = min(latency, time.perf_counter() - start)
    finally:
        pipe.close()
        ping.close()
    return LinkRates(shm_bps, remote_bps, latency)


def timed_prefill(
    forward: Callable[[list[int]], object], vocab_size: int
) -> Callable[[int], float]:
    """A `prefill(n) -> seconds` for `PrefillProfile.measure` over a plain forward of n
    token ids (any ids: the cost does not depend on them)."""

    def prefill(n: int) -> float:
        ids = [(7 * i + 3) % vocab_size for i in range(n)]
        start = time.perf_counter()
        forward(ids)
        return time.perf_counter() - start

    return prefill

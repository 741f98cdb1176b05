"""Members in quarantine: holders found serving pages that do not hold what they claim.

A member spot-checks what it copies (`workers.transfer.spot_check`): it recomputes a
sample page and compares. A page that fails is evidence against the holder it came from,
and the member reports it (ReportHolder) with the digests of every page it copied from
that holder. The service then puts the holder in quarantine:

- its holdings leave the index at once, and it may not register again (nor, an engine,
  enroll) until an operator clears it (`kvmesh quarantine --clear <id>`);
- every member learns the list (its version rides on each heartbeat's reply), stops
  copying from the holder, drops its own copies of the holder's pages and reports their
  digests in turn; and drops any copy, from whomever it came, of a page whose digest the
  list names, so pages that a victim copied and passed on go with the holder's.

A member's own key is all a false report takes. So each reporter may keep at most
MAX_ACCUSATIONS holders in quarantine at once (the operator's clear gives it back), a
quarantined member's own reports count for nothing, every record names its reporter and
evidence for the operator, and the list is bounded (MAX_QUARANTINED holders,
MAX_TAINTED digests: the oldest digests go first, their copies are then only as safe as
the spot checks make them).

The service actor keeps the list in Ray's key-value store (`on_change`, `saved`,
`restored`), as it keeps the enrolled engines: a restarted service refuses the same
members.

Pure Python, no sockets: the request handlers hold one `Quarantine`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

DIGEST_BYTES = 16
MAX_QUARANTINED = 256  # holders in quarantine at once (a full list refuses more)
MAX_ACCUSATIONS = 2  # holders one reporter may have in quarantine at once
MAX_TAINTED = 1 << 14  # digests of copied pages the list names (256 KiB)
MAX_EVIDENCE = 512  # characters of a report's evidence kept


class Record(NamedTuple):
    """One holder in quarantine: who reported it, when (unix seconds), and why."""

    holder: str
    reporter: str
    since: float
    evidence: str


class Quarantine:
    """The holders in quarantine and the digests of their pages' copies. Not thread-safe:
    the server's loop thread owns it (as it owns the index).

    Args:
        clock: wall-clock seconds, for the records the operator reads.
        on_change: called after every change (a holder in or out, digests added), on the
            thread that made it: where the list is kept across restarts.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[Quarantine], None] | None = None,
    ):
        self._clock = clock
        self._on_change = on_change
        self._records: dict[str, Record] = {}
        self._tainted: OrderedDict[bytes, None] = OrderedDict()
        self.version = 0  # rises with every change members must follow
        self.reports = 0  # ReportHolder messages taken
        self.refused = 0  # of them, refused (own, from a quarantined reporter, over bound)
        self.quarantines = 0  # holders put in quarantine since the service started

    def holds(self, worker_id: str) -> bool:
        """Whether `worker_id` is in quarantine (refused registration and enrollment)."""
        return worker_id in self._records

    def report(self, reporter: str, holder: str, digests: bytes, evidence: str) -> bool:
        """Take a report of `reporter` against `holder`, with the digests of the pages it
        copied from it. Returns True when `holder` goes into quarantine now (the caller
        drops its holdings); digests are added either way, unless the report is refused
        (reported by itself or by a member in quarantine, or past the bounds)."""
        assert len(digests) % DIGEST_BYTES == 0, f"{len(digests)} bytes of digests"
        self.reports += 1
        if reporter == holder or reporter in self._records:
            self.refused += 1
            return False
        new = holder not in self._records
        if new:
            accused = sum(r.reporter == reporter for r in self._records.values())
            if accused >= MAX_ACCUSATIONS or len(self._records) >= MAX_QUARANTINED:
                self.refused += 1
                return False
            self._records[holder] = Record(holder, reporter, self._clock(), evidence[:MAX_EVIDENCE])
            self.quarantines += 1
        before = len(self._tainted)
        for i in range(0, len(digests), DIGEST_BYTES):
            self._tainted[digests[i : i + DIGEST_BYTES]] = None
        while len(self._tainted) > MAX_TAINTED:
            self._tainted.popitem(last=False)
        if new or len(self._tainted) != before:
            self._changed()
        return new

    def clear(self, holder: str) -> bool:
        """The operator clears `holder`: it may register again. False when it was not in
        quarantine. The digests stay named: the copies they name were made from it."""
        if self._records.pop(holder, None) is None:
            return False
        self._changed()
        return True

    def _changed(self) -> None:
        self.version += 1
        if self._on_change is not None:
            self._on_change(self)

    def saved(self) -> bytes:
        """The records and digests, to restore in a restarted service."""
        return msgpack.packb([[list(r) for r in self._records.values()], self.digests()])

    def restore(self, raw: bytes) -> None:
        """Take back what `saved` gave (a malformed one raises ValueError, nothing taken)."""
        try:
            records, digests = msgpack.unpackb(raw)
            taken = {r[0]: Record(*r) for r in records}
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not a saved quarantine: {exc}") from None
        if len(digests) % DIGEST_BYTES:
            raise ValueError(f"saved digests of {len(digests)} bytes")
        self._records = taken
        self._tainted = OrderedDict(
            (digests[i : i + DIGEST_BYTES], None) for i in range(0, len(digests), DIGEST_BYTES)
        )
        self.version += 1

    def holders(self) -> tuple[str, ...]:
        return tuple(sorted(self._records))

    def digests(self) -> bytes:
        return b"".join(self._tainted)

    def records(self) -> list[dict[str, Any]]:
        """What the operator sees (`kvmesh quarantine`, the dashboard, stats)."""
        return [r._asdict() for _, r in sorted(self._records.items())]

    def stats(self) -> dict[str, Any]:
        return {
            "members": self.records(),
            "tainted_digests": len(self._tainted),
            "version": self.version,
            "reports": self.reports,
            "refused": self.refused,
            "quarantines": self.quarantines,
        }

    def check(self) -> None:
        """Raise AssertionError unless the bounds hold."""
        assert len(self._records) <= MAX_QUARANTINED, f"{len(self._records)} in quarantine"
        assert len(self._tainted) <= MAX_TAINTED, f"{len(self._tainted)} tainted digests"
        assert all(len(d) == DIGEST_BYTES for d in self._tainted), "a digest of another size"
        by_reporter: dict[str, int] = {}
        for record in self._records.values():
            by_reporter[record.reporter] = by_reporter.get(record.reporter, 0) + 1
            assert record.reporter != record.holder, f"{record.holder} reported itself"
        assert all(n <= MAX_ACCUSATIONS for n in by_reporter.values()), by_reporter

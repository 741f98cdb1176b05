"""Hit statistics: what every match asked for and found, per tenant and per requester.

For every query, queried = hit + miss + alignment_lost, and hit = local + remote:
"local" are pages the requester holds itself, "remote" pages only others hold, and
"alignment_lost" the trailing partial page, which page granularity cannot serve whatever
is cached. A match adds five ints to its tenant's tally and five to its requester's; the
cluster's figures are the sum over tenants.

Bounded whatever the clients send: a salt has a tally of its own only once the front door
named it (`name`, at most `max_tenants` names); every other salt, whoever sends it, is
summed in one "(unnamed)" tally and takes no place, so salts made up by a worker can
neither push out nor hide a tenant the front door names (it names a tenant before its
first request; what a salt was asked before its name counts as unnamed). A requester has
a tally only while it is a registered worker (anything else counts as "(unregistered)",
and a removed worker's figures are folded into "(removed)"). The statistics never show a
salt: a tenant appears under its name, or as "(unnamed)".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

COUNTERS = (
    "queries",
    "queried_tokens",
    "hit_tokens",
    "local_hit_tokens",
    "remote_hit_tokens",
    "miss_tokens",
    "alignment_lost_tokens",
)
UNNAMED = "(unnamed)"  # tenants the front door did not name (or beyond max_tenants names)
UNREGISTERED = "(unregistered)"  # requesters that are not registered workers
REMOVED = "(removed)"  # workers that were removed since
_UNNAMED_SALT = None  # the tally key of UNNAMED (no salt is None)


class Counters:
    """One set of the figures above."""

    __slots__ = COUNTERS

    def __init__(self) -> None:
        for name in COUNTERS:
            setattr(self, name, 0)

    def add(self, queries: int, queried: int, hit: int, local: int, lost: int) -> None:
        self.queries += queries
        self.queried_tokens += queried
        self.hit_tokens += hit
        self.local_hit_tokens += local
        self.remote_hit_tokens += hit - local
        self.miss_tokens += queried - hit - lost
        self.alignment_lost_tokens += lost

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}


class Tallies:
    """[queries, queried, hit, local, lost] tokens by tenant salt and by requester."""

    def __init__(self, page_tokens: int, max_tenants: int = 256):
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be positive, got {max_tenants}")
        self.page_tokens = page_tokens
        self.max_tenants = max_tenants
        self._by_tenant: dict[str | None, list[int]] = {}
        self._by_requester: dict[str | None, list[int]] = {}
        self._names: dict[str, str] = {}  # salt -> the tenant's name

    def record(self, salt: str, requester: str | None, queried: int, hit: int, local: int) -> None:
        """Count one query of `queried` tokens, `hit` of them cached, `local` on the requester
        (a registered worker's id, UNREGISTERED, or None for the front door)."""
        tally = self._by_tenant.get(salt)
        if tally is None:
            key = salt if salt in self._names else _UNNAMED_SALT
            tally = self._by_tenant.setdefault(key, [0, 0, 0, 0, 0])
        lost = queried % self.page_tokens
        tally[0] += 1
        tally[1] += queried
        tally[2] += hit
        tally[3] += local
        tally[4] += lost
        tally = self._by_requester.get(requester)
        if tally is None:
            tally = self._by_requester[requester] = [0, 0, 0, 0, 0]
        tally[0] += 1
        tally[1] += queried
        tally[2] += hit
        tally[3] += local
        tally[4] += lost

    def name(self, salt: str, name: str) -> None:
        """Show `salt`'s figures under `name`; beyond max_tenants names, later ones are
        left unnamed (their figures still count)."""
        if salt in self._names or len(self._names) < self.max_tenants:
            self._names[salt] = name
            self._by_tenant.setdefault(salt, [0, 0, 0, 0, 0])  # shown from now on

    def shown_name(self, salt: str) -> str:
        """How the statistics show `salt`: its name, or UNNAMED."""
        return self._names.get(salt, UNNAMED)

    def fold_requester(self, worker_id: str) -> None:
        """A worker left: its figures join REMOVED's."""
        tally = self._by_requester.pop(worker_id, None)
        if tally is not None:
            into = self._by_requester.setdefault(REMOVED, [0, 0, 0, 0, 0])
            for i, value in enumerate(tally):
                into[i] += value

    def summary(self) -> tuple[Counters, dict[str, Counters], dict[str, Counters]]:
        """(cluster, by tenant name, by requester) counters."""
        cluster = Counters()
        tenants: dict[str, Counters] = {}
        for salt, tally in self._by_tenant.items():
            cluster.add(*tally)
            shown = UNNAMED if salt is _UNNAMED_SALT else self._names[salt]
            tenants.setdefault(shown, Counters()).add(*tally)
        requesters: dict[str, Counters] = {}
        for requester, tally in self._by_requester.items():
            if requester is not None:
                requesters.setdefault(requester, Counters()).add(*tally)
        return cluster, tenants, requesters

    def report(self, live_pages: Mapping[str, int]) -> dict[str, Any]:
        """The "cluster", "tenants" and "workers" sections of the index's statistics.

        Args:
            live_pages: live worker id -> pages it holds.
        """
        cluster, tenants, requesters = self.summary()
        workers: dict[str, dict] = {}
        for worker_id in sorted(set(requesters) | set(live_pages)):
            counters = requesters.get(worker_id) or Counters()
            workers[worker_id] = counters.as_dict() | {
                "pages": live_pages.get(worker_id, 0),
                "live": worker_id in live_pages,
            }
        return {
            "cluster": cluster.as_dict(),
            "tenants": {name: c.as_dict() for name, c in sorted(tenants.items())},
            "workers": workers,
        }

    def check(self, is_live: Callable[[str], bool]) -> None:
        """The bounds hold: tenants (named ones only), names, and requesters that are live
        workers or markers."""
        assert len(self._by_tenant) <= self.max_tenants + 1, f"{len(self._by_tenant)} tenants"
        assert len(self._names) <= self.max_tenants, f"{len(self._names)} tenant names"
        for salt in self._by_tenant:
            assert salt is _UNNAMED_SALT or salt in self._names, "an unnamed salt has a tally"
        for requester in self._by_requester:
            assert requester in (None, UNREGISTERED, REMOVED) or is_live(requester), (
                f"a tally for {requester!r}, which is not a live worker"
            )
        queries = sum(tally[0] for tally in self._by_tenant.values())
        asked = sum(tally[0] for tally in self._by_requester.values())
        assert queries == asked, f"{queries} queries by tenant, {asked} by requester"

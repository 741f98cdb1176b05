"""Hit statistics: what every match asked for and found, per tenant and per requester.

For every query, queried = hit + miss + alignment_lost, and hit = local + remote:
"local" are pages the requester holds itself, "remote" pages only others hold, and
"alignment_lost" the trailing partial page, which page granularity cannot serve whatever
is cached. A match updates one list of five ints keyed by (tenant salt, requester); the
cluster, tenant and worker figures are summed from those when asked for.
"""

from __future__ import annotations

COUNTERS = (
    "queries",
    "queried_tokens",
    "hit_tokens",
    "local_hit_tokens",
    "remote_hit_tokens",
    "miss_tokens",
    "alignment_lost_tokens",
)


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
    """Per (tenant salt, requester): [queries, queried, hit, local, lost] tokens."""

    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self._tallies: dict[tuple[str, str | None], list[int]] = {}

    def record(self, salt: str, requester: str | None, queried: int, hit: int, local: int) -> None:
        """Count one query of `queried` tokens, `hit` of them cached, `local` on the requester."""
        key = (salt, requester)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = [0, 0, 0, 0, 0]
        tally[0] += 1
        tally[1] += queried
        tally[2] += hit
        tally[3] += local
        tally[4] += queried % self.page_tokens

    def summary(self) -> tuple[Counters, dict[str, Counters], dict[str, Counters]]:
        """(cluster, by tenant salt, by requester) counters."""
        cluster = Counters()
        tenants: dict[str, Counters] = {}
        requesters: dict[str, Counters] = {}
        for (salt, requester), tally in self._tallies.items():
            cluster.add(*tally)
            tenants.setdefault(salt, Counters()).add(*tally)
            if requester is not None:
                requesters.setdefault(requester, Counters()).add(*tally)
        return cluster, tenants, requesters

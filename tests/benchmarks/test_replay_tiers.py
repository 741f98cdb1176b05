"""The trace replay through real tiers: shared memory over disk files, as workers hold them."""

from __future__ import annotations

from benchmarks.replay import TRACE_BLOCK_TOKENS, TraceRequest, _routing, _run
from benchmarks.replay_tiers import TieredCluster, hit_rate

B = TRACE_BLOCK_TOKENS


def _conversations(n: int) -> list[TraceRequest]:
    """n conversations of 3 turns each, interleaved: turn t of conversation c repeats its
    earlier turns' blocks and adds one (the shape of the conversation trace)."""
    requests = []
    for turn in range(3):
        for c in range(n):
            blocks = tuple(1000 * c + k for k in range(turn + 2))
            requests.append(TraceRequest(0, len(blocks) * B - 7, 10, blocks))
    return requests


def test_a_disk_below_shared_memory_keeps_what_it_evicts_and_hits_it(tmp_path):
    requests = _conversations(12)  # 12 x 4 pages of first turns through 2 x 8 host pages
    cluster = TieredCluster(2, 8, 64, tmp_path)
    try:
        totals = _run(cluster, requests, _routing("prefix"), "replay", None)
        assert cluster.disk_hits > 0
        assert sum(link.demotions for link in cluster.links.values()) > 0
        cluster.check_integrity()
    finally:
        cluster.close()
    host_only = hit_rate(requests, 2, 8)
    assert totals.rate(totals.hit) > 1.5 * host_only
    roomy = hit_rate(requests, 2, 64)  # nothing evicted: the disk could add nothing
    assert totals.rate(totals.hit) <= roomy + 1e-9

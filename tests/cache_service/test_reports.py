"""The workers' reports as the service folds them: hits by tenant and tier."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.messages import EMPTY_REPORT, LOAD_BUCKETS, TenantTokens, TierFigures
from cache_service.messages import no_observations as nothing
from cache_service.reports import WorkerReports

SALTS = ("a", "b", "c")


def report(local: dict[str, int], tiers: dict[str, int]):
    """A report with these local hits by salt and these hit tokens by tier."""
    return EMPTY_REPORT._replace(
        tenants=tuple(TenantTokens(salt, 1, n, 0, 0) for salt, n in local.items()),
        tiers=tuple(
            TierFigures(tier, 0, 0, 0, 0, 0, {}, hits, nothing(LOAD_BUCKETS), 0, 1, 0, {})
            for tier, hits in tiers.items()
        ),
    )


def by_tier(reports: WorkerReports) -> dict[str, tuple[int, int, int]]:
    """salt -> its local hits from (device, host, disk)."""
    return {
        tenant: (f.device_hit, f.host_hit, f.disk_hit)
        for (_, tenant), f in reports.tenant_figures(str).items()
    }


def test_a_tiers_hits_are_shared_by_new_local_hits_with_the_remainder_to_the_largest():
    reports = WorkerReports()
    reports.update("w0", report({"a": 10, "b": 10, "c": 10}, {"host": 0, "disk": 10}))
    # 10 over three equal weights: 3 each, the one token left to the first by salt.
    assert by_tier(reports) == {"a": (0, 6, 4), "b": (0, 7, 3), "c": (0, 7, 3)}
    # Then only c had local hits: all 6 new disk tokens are c's, whatever came before.
    reports.update("w0", report({"a": 10, "b": 10, "c": 20}, {"disk": 16}))
    assert by_tier(reports) == {"a": (0, 6, 4), "b": (0, 7, 3), "c": (0, 11, 9)}
    # A GPU worker: device memory is its page store, host memory a tier below it.
    reports.update("w1", report({"a": 8}, {"device": 0, "host": 5}))
    assert reports.hits_by_tier() == {"device": 3, "host": 6 + 7 + 11 + 5, "disk": 16}
    reports.check_integrity()


def test_hits_counted_before_their_requests_wait_for_them():
    reports = WorkerReports()
    # The disk counted 8 tokens whose requests the tenants' rows do not hold yet.
    reports.update("w0", report({"a": 4}, {"disk": 12}))
    assert by_tier(reports) == {"a": (0, 0, 4)}
    reports.update("w0", report({"a": 20}, {"disk": 12}))
    assert by_tier(reports) == {"a": (0, 8, 12)}
    reports.check_integrity()


def test_a_worker_that_left_keeps_its_split_until_it_is_forgotten():
    reports = WorkerReports(max_departed=1)
    reports.update("w0", report({"a": 4}, {"disk": 4}))
    reports.update("w1", report({"a": 4}, {"disk": 2}))
    reports.departed("w0")
    assert reports.hits_by_tier()["disk"] == 6
    reports.departed("w1")  # w0, the oldest departed, is forgotten
    assert reports.hits_by_tier()["disk"] == 2
    reports.check_integrity()


steps = st.lists(
    st.tuples(
        st.fixed_dictionaries({salt: st.integers(0, 50) for salt in SALTS}),
        st.integers(0, 100),  # the disk's share of the new local hits, in percent
        st.booleans(),  # the worker restarted before this report
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(steps=steps)
def test_figures_only_grow_and_add_up_between_restarts(steps):
    reports = WorkerReports()
    local, disk = dict.fromkeys(SALTS, 0), 0
    before = None
    exact = True  # every disk token given to a tenant
    for new, percent, restarted in steps:
        if restarted:  # it counts from zero again
            was = (local, disk)
            local, disk = dict.fromkeys(SALTS, 0), 0
        local = {salt: local[salt] + n for salt, n in new.items()}
        disk += sum(new.values()) * percent // 100
        if restarted:
            before = None
            # A restart whose first figures are no lower than the last ones cannot be told
            # from more traffic: what its disk counted with no new local hits waits for them.
            went_down = disk < was[1] or any(local[s] < was[0][s] for s in SALTS)
            exact = exact and went_down
        reports.update("w0", report(local, {"disk": disk}))
        now = by_tier(reports)
        shared = sum(hits[2] for hits in now.values())
        assert shared == disk if exact else shared <= disk
        for salt, (device, host, on_disk) in now.items():
            assert device == 0 and host + on_disk == local[salt]
            if before is not None:  # a counter: never down while the worker runs
                assert host >= before[salt][1] and on_disk >= before[salt][2]
        before = now
        reports.check_integrity()

"""`kvmesh status` from hand-built figures: the tiers line, and a service without tiers."""

from __future__ import annotations

from cluster.status import render_status, summarize, tiers_line

# The service's "served" figures as `WorkerReports.stats()` gives them: host memory on
# every worker (one reports figures of its own for it), a disk tier on one.
TIERS = {
    "host": {
        "hit_tokens": 64,
        "hit_rate": 64 / 136,
        "pages": 48,
        "capacity": 128,
        "evictions": {"demoted": 40},
        "workers": 1,
        "accepting": 1,
        "bytes_written": 0,
        "bytes_read": 8192,
        "demotions": 0,
        "errors": 0,
        "dropped": {},
    },
    "disk": {
        "hit_tokens": 24,
        "hit_rate": 24 / 136,
        "pages": 40,
        "capacity": 1000,
        "evictions": {"evicted": 5},
        "workers": 2,
        "accepting": 1,
        "bytes_written": 40 * 4096,
        "bytes_read": 3 << 20,
        "demotions": 40,
        "errors": 2,
        "dropped": {"truncated": 1},
    },
}


def service(tiers=None) -> dict:
    served = {"prompt_tokens": {"local_hit": 72, "remote_hit": 16, "computed": 48}}
    if tiers is not None:
        served["tiers"] = tiers
    return {"service": {"epoch": 7, "address": "tcp://127.0.0.1:5555"}, "served": served}


def status(tiers=None) -> dict:
    return summarize(service(tiers), {}, {}, "127.0.0.1:6379", auth=True)


def test_the_tiers_line_names_each_tier_top_down():
    assert status(TIERS)["tiers"] == TIERS
    line = (
        "tiers: host 48/128 pages, 47.1% of prompt tokens, 0 B written, 8.0 KiB read, "
        "0 demotions, 1 of 1 accepting; disk 40/1000 pages, 17.6% of prompt tokens, "
        "160.0 KiB written, 3.0 MiB read, 40 demotions, 1 of 2 accepting, 2 errors"
    )
    assert tiers_line(TIERS) == line
    assert line in render_status(status(TIERS), width=400)


def test_a_tier_no_worker_reports_figures_of_shows_its_pages_and_hits_only():
    host = {**TIERS["host"], "workers": 0, "accepting": 0, "bytes_read": None}
    assert tiers_line({"host": host}) == "tiers: host 48/128 pages, 47.1% of prompt tokens"


def test_a_service_before_tiers_shows_no_tiers_line():
    summary = status()
    assert summary["tiers"] == {}
    text = render_status(summary)
    assert "tiers:" not in text and "pages 0 in use" in text

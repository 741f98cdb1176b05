"""A copy source killed in the middle of a cross-node copy: the copier uses nothing of the
cut reply, recomputes, answers exactly what a mesh without a cache answers, and does not
wait for its page client's timeout.

Two workers on the two nodes of a simulated Ray cluster (tiny model), so the copy goes
through the holder's page server (CurveZMQ, encrypted pages). The copier's route to the
holder passes a relay (tests/reliability/killing_relay.py) that SIGKILLs the holder once
part of the reply has gone through.
"""

from __future__ import annotations

import io
import time

import pytest
import ray

import cluster
from cluster.config import config_from_dict
from tests.reliability.killing_relay import KillingRelay
from tests.waiting import wait_until
from workers.transfer.page_client import PageClient

pytestmark = pytest.mark.slow

CONFIG = {
    "model": {"name": "tiny"},
    "store": {"num_pages": 128},
    "workers": {"count": 2, "threads": 1, "num_cpus": 1, "copy_policy": "always"},
}
PROMPT = [(13 * j) % 250 + 1 for j in range(30 * 16 + 5)]  # 30 full pages
KILL_AFTER = 100_000  # reply bytes that reach the copier: about 12 of the 30 pages


@pytest.fixture(scope="module")
def mesh(ray_cluster):
    mesh = cluster.connect(config_from_dict(CONFIG), log=io.StringIO())
    yield mesh
    mesh.shutdown()


def test_a_holder_killed_mid_reply_costs_a_recompute_and_nothing_else(mesh):
    holder, copier = (mesh.workers[w] for w in ("w0", "w1"))
    infos = {w: ray.get(mesh.workers[w].info.remote()) for w in ("w0", "w1")}
    assert infos["w0"].node_id != infos["w1"].node_id  # a copy across nodes
    reference = mesh.generate(PROMPT, 4, tenant="mid", worker="w1", reuse=False).token_ids
    mesh.generate(PROMPT, 4, tenant="mid", worker="w0")
    mesh.flush()
    held = ray.get(holder.stats.remote())
    assert held.page_server["encrypt"]
    page_bytes = mesh.config.store_layout().page_bytes
    assert 30 * page_bytes > 2 * KILL_AFTER  # the cut falls well inside the reply

    _, pid = ray.get(holder.process.remote())
    relay = KillingRelay(infos["w0"].page_address, pid, KILL_AFTER)
    try:
        ray.get(copier.set_peers.remote([infos["w0"]._replace(page_address=relay.address)]))
        started = time.monotonic()
        out = mesh.generate(PROMPT, 4, tenant="mid", worker="w1")
        took = time.monotonic() - started
    finally:
        relay.close()

    # The holder died mid-reply: part of it reached the copier, the rest never did.
    assert relay.killed_at is not None and relay.connections >= 1
    assert relay.forwarded == KILL_AFTER and relay.requested > 0
    # Nothing of the cut reply was used: every token recomputed, and the output is exact.
    assert out.token_ids == reference
    assert out.stats["remote_hit_tokens"] == 0
    assert out.stats["computed_tokens"] == len(PROMPT)
    print(
        f"\nholder killed after {relay.forwarded} reply bytes ({relay.withheld} withheld); "
        f"the request took {took:.3f} s"
    )
    # The broken connection ended the copy at once, not the page client's timeout.
    assert took < PageClient(relay.address).timeout_s
    stats = ray.get(copier.stats.remote())
    assert stats.copy_bytes["remote"] > 0  # the copy was attempted, and counted
    # The copier's pages hold its own computation, as many as the holder's held after the
    # same request: nothing half-copied on top.
    assert stats.cache["cached_pages"] == held.cache["cached_pages"]
    ray.get(copier.check_integrity.remote())
    # The front door saw the death; the holder is out of routing.
    wait_until(lambda: "w0" not in mesh.live_workers(), 10, "w0 seen dead")
    again = mesh.generate(PROMPT, 4, tenant="mid")
    assert again.stats["worker"] == "w1" and again.token_ids == reference
    mesh.check_integrity()

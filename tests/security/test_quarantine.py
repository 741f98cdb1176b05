"""A member that serves pages not holding what it claims is caught, quarantined, and its
poison does not outlive it.

Finding covered: an engine enrolled through Ray published a prompt's pages holding
another prompt's KV with the digests of the right tokens; a victim copied them and
answered wrongly, with no error, and passed them on to a third worker. Copies are now
spot-checked (a sample page recomputed and compared, always at a holder's first copy),
a failing holder is quarantined at the service (holdings out of the index, registration
refused until an operator clears it, no requests routed to it), and every member drops
its copies of the holder's pages.
"""

from __future__ import annotations

import pytest
import ray

import cluster
from benchmarks.faults import install
from cache_service.actor import get_service
from cache_service.events import Namespace
from cluster.config import config_from_dict
from cluster.status import render_status
from tests.service_restart import restart_service
from tests.waiting import wait_until
from workers.service.client import ServiceUnavailable

A = [(7 * i + 3) % 250 for i in range(41)]  # 10 full pages of 4, then one token
B = [(11 * i + 5) % 250 for i in range(41)]
C = [(13 * i + 1) % 250 for i in range(41)]


def _mesh():
    cfg = config_from_dict(
        {
            "model": {"name": "tiny"},
            "cache": {"page_tokens": 4},
            "store": {"num_pages": 128},
            # Only a holder's first copy is checked: what happens below is deterministic.
            "workers": {
                "count": 3,
                "num_cpus": 0.5,
                "threads": 1,
                "copy_policy": "always",
                "spot_check_rate": 0.0,
            },
        }
    )
    return cluster.connect(cfg)


def _indexed(mesh) -> set[str]:
    """The workers the service's index knows (none while it does not answer)."""
    try:
        return set(mesh.service_client.stats()["workers"])
    except ServiceUnavailable:
        return set()


def test_a_poisoning_holder_is_caught_quarantined_and_its_copies_dropped(ray_local):
    mesh = _mesh()
    try:
        reference = mesh.generate(A, 6, tenant="reference", worker="w1", return_logits=True)
        assert reference.stats["computed_tokens"] == len(A)
        # w0 holds C, A and B; w2 copies C from it while w0 is honest (checked: it passes).
        for prompt in (C, A, B):
            mesh.generate(prompt, 2, tenant="t", worker="w0")
        mesh.flush()
        honest = mesh.generate(C + [1], 2, tenant="t", worker="w2")
        assert honest.stats["remote_hit_tokens"] == 40
        w2 = mesh.stats()["workers"]["w2"]["trust"]
        assert (w2["checks"], w2["failures"]) == (1, 0)

        # w0 turns bad: its pages of A hold B's KV, digests and generations untouched.
        assert ray.get(install(mesh.workers["w0"], "poison", mesh.salt("t"), A, B)) == 10

        victim = mesh.generate(A, 6, tenant="t", worker="w1", return_logits=True)
        assert victim.token_ids == reference.token_ids  # the poison was not served
        assert victim.stats["remote_hit_tokens"] == 0  # the copy was dropped: recomputed
        w1 = mesh.stats()["workers"]["w1"]["trust"]
        assert (w1["checks"], w1["failures"]) == (1, 1)

        service = get_service()
        (record,) = ray.get(service.quarantined.remote())
        assert (record["holder"], record["reporter"]) == ("w0", "w1")
        assert "differed from its recomputation" in record["evidence"]
        assert "in quarantine: w0 (reported by w1: the KV of prompt token" in render_status(
            mesh.stats()
        )
        # w0's holdings left the index, and no request is routed to it.
        namespace = Namespace("tiny", "", mesh.salt("t"))
        spans = mesh.service_client.match(namespace, A).spans
        assert [span.worker_id for span in spans] == ["w1"]  # what w1 computed itself
        for i in range(4):
            assert mesh.generate(B + [i], 1, tenant="t").stats["worker"] != "w0"

        # w2 follows the list: its copies of w0's pages go, and are not served again.
        wait_until(
            lambda: mesh.stats()["workers"]["w2"]["trust"]["dropped_pages"] == 10,
            30,
            "w2 dropping its copies of w0's pages",
        )
        # What the victim computed in place of the poisoned copy stays (it is no copy).
        assert mesh.stats()["workers"]["w1"]["trust"]["dropped_pages"] == 0
        assert [s.worker_id for s in mesh.service_client.match(namespace, A).spans] == ["w1"]
        again = mesh.generate(C + [1], 2, tenant="t", worker="w2")
        assert again.stats["local_hit_tokens"] == 0 and again.stats["remote_hit_tokens"] == 0
        stats = mesh.service_client.stats()["quarantine"]
        assert stats["quarantines"] == 1 and stats["tainted_digests"] >= 20

        # w0 may not come back until the operator clears it, also after the service
        # restarted (it rebuilds its index from the workers, w0's holdings excepted).
        wait_until(lambda: "w0" not in mesh.service_client.stats()["workers"], 30, "w0 kept out")
        restart_service()
        service = get_service()
        assert [r["holder"] for r in ray.get(service.quarantined.remote())] == ["w0"]
        wait_until(lambda: {"w1", "w2"} <= _indexed(mesh), 30, "w1 and w2 resynced")
        assert "w0" not in _indexed(mesh)
        assert ray.get(service.clear_quarantine.remote("w0"))
        assert not ray.get(service.clear_quarantine.remote("w0"))
        wait_until(lambda: "w0" in _indexed(mesh), 30, "w0 back")
        ray.get(service.check_integrity.remote())
        mesh.check_integrity()
    finally:
        mesh.shutdown()


# ---- the service's side, over real sockets -------------------------------------------


def test_a_report_quarantines_a_holder_until_the_operator_clears_it(rig):
    from cache_service.quarantine import MAX_ACCUSATIONS
    from tests.security.service_rig import NS, serve
    from workers.service.client import ServiceError

    caches = {w: rig.worker(w) for w in ("w0", "w1", "w2")}
    serve(caches["w0"][0], list(range(16)))
    assert caches["w0"][1].heartbeat()
    front = rig.client("front_door")
    assert front.match(NS, list(range(16))).matched_tokens == 16
    w1 = rig.client("w1")
    epoch = caches["w1"][1].epoch
    digests = [bytes([i]) * 16 for i in range(3)]
    if rig.auth:  # without keys anyone speaks as anyone
        with pytest.raises(ServiceError, match="forbidden"):
            rig.client("w2").report_holder("w1", epoch, "w0", digests, "as someone else")
    with pytest.raises(ServiceError, match="forbidden|not registered"):
        rig.client("w2").report_holder("ghost", 1, "w0", digests, "an unknown reporter")
    assert front.quarantine() == ((), [])  # nothing changed

    w1.report_holder("w1", epoch, "w0", digests, "page 3: error 0.8")
    assert front.quarantine() == (("w0",), digests)
    assert front.match(NS, list(range(16))).matched_tokens == 0  # its holdings left
    assert caches["w1"][1].client.heartbeat("w1", epoch).quarantine >= 1  # members learn
    with pytest.raises(ServiceError, match="in quarantine") as refused:
        rig.client("w0").register("w0", "node-1", "cpu", "")
    assert refused.value.code == "quarantined"
    # Its own and a quarantined member's reports count for nothing; a reporter's
    # accusations are bounded.
    with pytest.raises(ServiceError, match="not registered"):
        rig.client("w0").report_holder("w0", caches["w0"][1].epoch, "w2", digests, "revenge")
    w1.report_holder("w1", epoch, "w1", digests, "itself")
    assert front.quarantine()[0] == ("w0",)
    for i in range(MAX_ACCUSATIONS + 2):
        w1.report_holder("w1", epoch, f"w{9 + i}", [], "spree")
    assert len(front.quarantine()[0]) == MAX_ACCUSATIONS  # w0 and one more
    stats = front.stats()["quarantine"]
    assert stats["refused"] == 4 and stats["members"][0]["reporter"] == "w1"
    # No request is routed to a member in quarantine.
    decision = front.route(NS, list(range(16)), {"w0": 0.0, "w1": 9.0}, {})
    assert decision.worker_id == "w1"

    assert rig.server.clear_quarantine("w0") and not rig.server.clear_quarantine("w0")
    assert rig.client("w0").register("w0", "node-1", "cpu", "").epoch > 0
    rig.server.check_integrity()

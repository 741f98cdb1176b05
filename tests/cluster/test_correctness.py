"""The product's first promise, with the real model, through the front door.

Two simulated Ray nodes (different node ids, so copies between them take the page
server path) and three workers: w0 and w2 on the head node, w1 on the other. For one
prompt, greedy output tokens are identical and last-token logits match within 1e-4
whether its prefix came from no cache, the worker's own cache, a partly matched page
(copy-on-write), a peer on the same node, a peer on another node, or several peers at
once. Tenants never share pages.
"""

from __future__ import annotations

import pytest
import ray
import torch

import cluster
from cluster.config import config_from_dict

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
ATOL = 1e-4


@pytest.fixture(scope="module")
def mesh(ray_cluster):
    cfg = config_from_dict(
        {
            "cache": {"page_tokens": 16},
            "store": {"num_pages": 256},
            "workers": {"count": 3, "threads": 1},
        }
    )
    mesh = cluster.connect(cfg, address=ray_cluster.address)
    yield mesh
    mesh.check_integrity()
    mesh.shutdown()  # conftest checks that no segment, thread or actor is left behind


@pytest.fixture(scope="module")
def prompt(mesh):
    messages = [
        {
            "role": "system",
            "content": "You are a careful assistant for a train company. "
            "Answer briefly and politely. Timetables: the 7:05 to Lyon stops at Dijon; the "
            "7:40 to Geneva is direct; the 8:15 to Marseille stops at Avignon and Nimes; "
            "bicycles travel free on weekends; pets need a ticket at half price.",
        },
        {
            "role": "user",
            "content": "I want to go to Marseille with my dog and my bike on "
            "Saturday morning. Which train should I take, and what will it cost me extra? "
            "Please also tell me where it stops on the way.",
        },
    ]
    text = mesh.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = list(mesh.tokenizer.encode(text))
    assert 100 < len(tokens) < 400, len(tokens)
    return tokens


def _same(result, reference) -> None:
    assert result.token_ids == reference.token_ids
    diff = (torch.tensor(result.logits) - torch.tensor(reference.logits)).abs().max().item()
    assert diff <= ATOL, f"last-token logits differ by {diff}"


def test_nodes_are_distinct(mesh):
    infos = ray.get([w.info.remote() for w in mesh.workers.values()])
    nodes = {info["worker_id"]: info["node_id"] for info in infos}
    assert nodes["w0"] == nodes["w2"] != nodes["w1"]


def test_every_source_of_a_prefix_gives_the_same_output(mesh, prompt):
    n = len(prompt)
    cold = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker="w0", return_logits=True)
    assert cold.stats["computed_tokens"] == n
    assert cold.stats["local_hit_tokens"] == cold.stats["remote_hit_tokens"] == 0

    own = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker="w0", return_logits=True)
    # every full page of the prompt (the partial last one stays private to its request)
    assert own.stats["local_hit_tokens"] == n // 16 * 16
    _same(own, cold)

    same_node = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker="w2", return_logits=True)
    assert same_node.stats["remote_hit_tokens"] >= (n - 1) // 16 * 16
    assert same_node.stats["local_hit_tokens"] == 0
    _same(same_node, cold)

    served_before = mesh.stats()["workers"]["w0"]["pages_served"]
    other_node = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker="w1", return_logits=True)
    assert other_node.stats["remote_hit_tokens"] >= (n - 1) // 16 * 16
    _same(other_node, cold)
    # w1 is alone on its node: its pages came over a page server on the head node
    workers = mesh.stats()["workers"]
    served = workers["w0"]["pages_served"] + workers["w2"]["pages_served"]
    assert served > served_before


def test_partly_matched_page_is_copied_on_write(mesh, prompt):
    cut = len(prompt) - 7
    assert cut % 16 not in (0, 15)
    variant = prompt[:cut] + mesh.tokenizer.encode(" Thanks!")
    mesh.generate(prompt, 1, tenant="b", worker="w0")
    cold = mesh.generate(variant, NEW_TOKENS, tenant="b-fresh", worker="w0", return_logits=True)
    assert cold.stats["computed_tokens"] == len(variant)
    cow = mesh.generate(variant, NEW_TOKENS, tenant="b", worker="w0", return_logits=True)
    assert cow.stats["local_hit_tokens"] == cut  # full pages plus part of the next
    _same(cow, cold)


def test_several_peers_at_once(mesh, prompt):
    extended = prompt + mesh.tokenizer.encode(" And on Sunday?")
    cold = mesh.generate(extended, NEW_TOKENS, tenant="c-fresh", worker="w1", return_logits=True)
    mesh.generate(prompt, 1, tenant="c", worker="w0")
    mesh.generate(prompt, 1, tenant="c", worker="w2")  # w0 and w2 both hold it now
    before = mesh.stats()["workers"]
    out = mesh.generate(extended, NEW_TOKENS, tenant="c", worker="w1", return_logits=True)
    after = mesh.stats()["workers"]
    assert out.stats["remote_hit_tokens"] >= len(prompt) // 16 * 16 - 16
    for holder in ("w0", "w2"):
        assert after[holder]["pages_served"] > before[holder]["pages_served"], holder
    _same(out, cold)


def test_tenants_never_share_pages(mesh, prompt):
    mesh.generate(prompt, 1, tenant="d", worker="w0")
    other = mesh.generate(prompt, 1, tenant="e", worker="w0")
    assert other.stats["local_hit_tokens"] == other.stats["remote_hit_tokens"] == 0
    tenants = mesh.stats()["service"]["tenants"]
    assert "d" in tenants and "e" in tenants  # by the names the front door gave them
    assert mesh.salt("d") != mesh.salt("e")
    assert mesh.salt("d") not in tenants and mesh.salt("e") not in tenants


def test_routing_sends_a_prompt_to_its_holder(mesh, prompt):
    mesh.generate(prompt, 1, tenant="f", worker="w1")
    routed = mesh.generate(prompt + [13], 1, tenant="f")
    assert routed.stats["worker"] == "w1"
    assert routed.stats["local_hit_tokens"] >= len(prompt) // 16 * 16

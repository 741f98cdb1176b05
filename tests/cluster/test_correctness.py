"""The product's first promise, with the real model, through the front door.

Two simulated Ray nodes (different node ids, so copies between them take the page
server path) and three workers: w0 and w2 on the head node, w1 on the other. For one
prompt, greedy output tokens are identical and last-token logits match within 1e-4
whether its prefix came from no cache, the worker's own cache, a partly matched page
(copy-on-write), a peer on the same node, a peer on another node, or several peers at
once. Tenants never share pages.
"""

from __future__ import annotations

from typing import NamedTuple

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


class Roles(NamedTuple):
    """Where the placement group put the three workers: two share a node, one is alone."""

    first: str
    neighbour: str  # on first's node
    alone: str  # on the other node


@pytest.fixture(scope="module")
def roles(mesh) -> Roles:
    infos = ray.get([w.info.remote() for w in mesh.workers.values()])
    by_node: dict[str, list[str]] = {}
    for info in infos:
        by_node.setdefault(info["node_id"], []).append(info["worker_id"])
    assert sorted(len(ids) for ids in by_node.values()) == [1, 2]  # spread over both nodes
    (pair,) = (sorted(ids) for ids in by_node.values() if len(ids) == 2)
    (alone,) = (ids[0] for ids in by_node.values() if len(ids) == 1)
    return Roles(pair[0], pair[1], alone)


def test_workers_are_spread_over_the_nodes(roles):
    assert len({roles.first, roles.neighbour, roles.alone}) == 3


def test_every_source_of_a_prefix_gives_the_same_output(mesh, prompt, roles):
    n = len(prompt)
    cold = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker=roles.first, return_logits=True)
    assert cold.stats["computed_tokens"] == n
    assert cold.stats["local_hit_tokens"] == cold.stats["remote_hit_tokens"] == 0

    own = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker=roles.first, return_logits=True)
    mesh.flush()  # the pages in the index before the other workers ask for them
    # every full page of the prompt (the partial last one stays private to its request)
    assert own.stats["local_hit_tokens"] == n // 16 * 16
    _same(own, cold)

    same_node = mesh.generate(
        prompt, NEW_TOKENS, tenant="a", worker=roles.neighbour, return_logits=True
    )
    assert same_node.stats["remote_hit_tokens"] >= (n - 1) // 16 * 16
    assert same_node.stats["local_hit_tokens"] == 0
    _same(same_node, cold)
    mesh.flush()

    served_before = mesh.stats()["workers"][roles.first]["pages_served"]
    other_node = mesh.generate(
        prompt, NEW_TOKENS, tenant="a", worker=roles.alone, return_logits=True
    )
    assert other_node.stats["remote_hit_tokens"] >= (n - 1) // 16 * 16
    _same(other_node, cold)
    # alone on its node: its pages came over a page server on the other node
    workers = mesh.stats()["workers"]
    served = workers[roles.first]["pages_served"] + workers[roles.neighbour]["pages_served"]
    assert served > served_before


def test_partly_matched_page_is_copied_on_write(mesh, prompt, roles):
    cut = len(prompt) - 7
    assert cut % 16 not in (0, 15)
    variant = prompt[:cut] + mesh.tokenizer.encode(" Thanks!")
    mesh.generate(prompt, 1, tenant="b", worker=roles.first)
    cold = mesh.generate(
        variant, NEW_TOKENS, tenant="b-fresh", worker=roles.first, return_logits=True
    )
    assert cold.stats["computed_tokens"] == len(variant)
    cow = mesh.generate(variant, NEW_TOKENS, tenant="b", worker=roles.first, return_logits=True)
    assert cow.stats["local_hit_tokens"] == cut  # full pages plus part of the next
    _same(cow, cold)


def test_several_peers_at_once(mesh, prompt, roles):
    extended = prompt + mesh.tokenizer.encode(" And on Sunday?")
    cold = mesh.generate(
        extended, NEW_TOKENS, tenant="c-fresh", worker=roles.alone, return_logits=True
    )
    mesh.generate(prompt, 1, tenant="c", worker=roles.first)
    mesh.generate(prompt, 1, tenant="c", worker=roles.neighbour)  # both hold it now
    mesh.flush()
    before = mesh.stats()["workers"]
    out = mesh.generate(extended, NEW_TOKENS, tenant="c", worker=roles.alone, return_logits=True)
    after = mesh.stats()["workers"]
    assert out.stats["remote_hit_tokens"] >= len(prompt) // 16 * 16 - 16
    for holder in (roles.first, roles.neighbour):
        assert after[holder]["pages_served"] > before[holder]["pages_served"], holder
    _same(out, cold)


def test_tenants_never_share_pages(mesh, prompt, roles):
    mesh.generate(prompt, 1, tenant="d", worker=roles.first)
    other = mesh.generate(prompt, 1, tenant="e", worker=roles.first)
    assert other.stats["local_hit_tokens"] == other.stats["remote_hit_tokens"] == 0
    tenants = mesh.stats()["service"]["tenants"]
    assert "d" in tenants and "e" in tenants  # by the names the front door gave them
    assert mesh.salt("d") != mesh.salt("e")
    assert mesh.salt("d") not in tenants and mesh.salt("e") not in tenants


def test_routing_sends_a_prompt_to_its_holder(mesh, prompt, roles):
    mesh.generate(prompt, 1, tenant="f", worker=roles.alone)
    mesh.flush()  # routing reads the index
    routed = mesh.generate(prompt + [13], 1, tenant="f")
    assert routed.stats["worker"] == roles.alone
    assert routed.stats["local_hit_tokens"] >= len(prompt) // 16 * 16

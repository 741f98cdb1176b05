"""The product's first promise, with the real model, through the front door.

Two simulated Ray nodes (different node ids, so copies between them take the page
server path) and three workers: w0 and w2 on the head node, w1 on the other. For one
prompt, greedy output tokens equal HF `generate()` on the same model, up to and with the
end-of-sequence token it stops at, and last-token logits match within 1e-4, whether its
prefix came from no cache, the worker's own cache, a partly matched page (copy-on-write),
a peer on the same node, a peer on another node, or several peers at once; a seeded
sampled generation is the same on every path too. Tenants never share pages. Bad
requests are refused at the front door with nothing held.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import ray
import torch

import cluster
from cluster.config import config_from_dict

pytestmark = pytest.mark.slow
NEW_TOKENS = 40  # the prompt's greedy answer ends (at <|im_end|>) well before this
ATOL = 1e-4
EOS = 2  # SmolLM2-Instruct's <|im_end|>


@pytest.fixture(scope="module")
def mesh(ray_cluster):
    cfg = config_from_dict(
        {
            "cache": {"page_tokens": 16},
            "store": {"num_pages": 256},
            # Copies whenever a peer holds a prefix: this module checks what a copy delivers;
            # whether one beats recomputing is a measurement a loaded machine tips either
            # way (tests/workers/transfer/test_costs.py checks the decision).
            "workers": {"count": 3, "threads": 1, "copy_policy": "always"},
        }
    )
    mesh = cluster.connect(cfg, address=ray_cluster.address)
    yield mesh
    mesh.check_integrity()
    mesh.shutdown()  # conftest checks that no segment, thread or actor is left behind


MESSAGES = [
    {
        "role": "system",
        "content": "You are a careful assistant for a train company. "
        "Answer briefly and politely. Timetables: the 7:05 to Lyon stops at Dijon; the "
        "7:40 to Geneva is direct; the 8:15 to Marseille stops at Avignon and Nimes; "
        "bicycles travel free on weekends; pets need a ticket at half price.",
    },
    {
        "role": "user",
        "content": "Which train goes to Marseille? Answer in a few words.",
    },
]


@pytest.fixture(scope="module")
def prompt(mesh):
    text = mesh.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    tokens = list(mesh.tokenizer.encode(text))
    assert 100 < len(tokens) < 400, len(tokens)
    return tokens


@pytest.fixture(scope="module")
def hf_model():
    """The same model in this process, for HF's own `generate` as the reference."""
    from workers.serving.model_loader import load_smollm2

    model, _ = load_smollm2()
    return model


def hf_greedy(model, tokens: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([tokens]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS
        )
    return out[0, len(tokens) :].tolist()


def _same(result, reference) -> None:
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == reference.finish_reason
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
        by_node.setdefault(info.node_id, []).append(info.worker_id)
    assert sorted(len(ids) for ids in by_node.values()) == [1, 2]  # spread over both nodes
    (pair,) = (sorted(ids) for ids in by_node.values() if len(ids) == 2)
    (alone,) = (ids[0] for ids in by_node.values() if len(ids) == 1)
    return Roles(pair[0], pair[1], alone)


def test_workers_are_spread_over_the_nodes(roles):
    assert len({roles.first, roles.neighbour, roles.alone}) == 3


def test_every_source_of_a_prefix_gives_the_same_output(mesh, prompt, roles, hf_model):
    n = len(prompt)
    cold = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker=roles.first, return_logits=True)
    assert cold.stats["computed_tokens"] == n
    # HF's greedy generate on the same model, stopping at the same end of sequence
    assert cold.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert cold.finish_reason == "stop" and cold.token_ids[-1] == EOS
    assert len(cold.token_ids) < NEW_TOKENS
    assert "<|im_end|>" not in cold.text and cold.text.strip()
    assert cold.stats["local_hit_tokens"] == cold.stats["remote_hit_tokens"] == 0

    own = mesh.generate(prompt, NEW_TOKENS, tenant="a", worker=roles.first, return_logits=True)
    mesh.flush()  # the pages in the index before the other workers ask for them
    # every token but the last (computed for its logits): the prompt's last page was
    # filled by the answer's tokens and published, then matched in part (copy-on-write)
    assert own.stats["local_hit_tokens"] == n - 1
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
    # 16 tokens past the prompt fill its last page, so that page is published whole: the
    # variant then matches its first token and copies the page on write
    mesh.generate(prompt, 16, tenant="b", worker=roles.first, ignore_eos=True)
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
    copy = after[roles.alone]["copy"]  # what the copy decided, if it did not copy
    assert out.stats["remote_hit_tokens"] >= len(prompt) // 16 * 16 - 16, (out.stats, copy)
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
    estimated = mesh.stats()["route_ttft_error"]["requests"]
    routed = mesh.generate(prompt + [13], 1, tenant="f")
    assert routed.stats["worker"] == roles.alone
    assert routed.stats["local_hit_tokens"] >= len(prompt) // 16 * 16
    # The router's estimate went with it (a request sent to a named worker has none), and
    # its worker reported how far its first token came from it.
    mesh.flush()
    error = mesh.stats()["route_ttft_error"]
    assert error["requests"] == estimated + 1
    assert 0 <= error["mean_s"] < 30, error


def test_a_seed_gives_the_same_sample_on_every_path(mesh, prompt, roles):
    """Sampled (temperature, top-k, top-p): the same seed, the same tokens, whether the
    prefix was computed, cached, or copied from the same node or another."""
    sampling = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 1234}
    ran = [
        mesh.generate(prompt, 12, tenant="g", worker=worker, **sampling)
        for worker in (roles.first, roles.first, roles.neighbour, roles.alone)
    ]
    sources = [(r.stats["local_hit_tokens"], r.stats["remote_hit_tokens"]) for r in ran]
    assert sources[0] == (0, 0) and sources[1][0] > 0  # cold, then its own cache
    assert sources[2][1] > 0 and sources[3][1] > 0  # copied in
    assert all(r.token_ids == ran[0].token_ids for r in ran), [r.token_ids for r in ran]
    other_seed = mesh.generate(
        prompt, 12, tenant="g", worker=roles.first, **{**sampling, "seed": 7}
    )
    assert other_seed.token_ids != ran[0].token_ids


def test_ignore_eos_and_stop_tokens(mesh, prompt, roles):
    greedy = mesh.generate(prompt, NEW_TOKENS, tenant="h", worker=roles.first)
    stop_at = greedy.token_ids.index(greedy.token_ids[3])  # the first place that token comes
    stopped = mesh.generate(
        prompt, NEW_TOKENS, tenant="h", worker=roles.first, stop_token_ids=[greedy.token_ids[3]]
    )
    assert stopped.token_ids == greedy.token_ids[: stop_at + 1]
    assert stopped.finish_reason == "stop"
    past = mesh.generate(prompt, NEW_TOKENS, tenant="h", worker=roles.first, ignore_eos=True)
    assert len(past.token_ids) == NEW_TOKENS and past.finish_reason == "length"
    assert past.token_ids[: len(greedy.token_ids)] == greedy.token_ids  # EOS, then more


def test_chat_applies_the_template_and_stream_hands_over_each_token(mesh, prompt, roles):
    answer = mesh.chat(MESSAGES, NEW_TOKENS, tenant="i", worker=roles.alone)
    assert answer.stats["prompt_tokens"] == len(prompt)  # the prompt the template makes
    reference = mesh.generate(prompt, NEW_TOKENS, tenant="i", worker=roles.alone)
    assert answer.token_ids == reference.token_ids and answer.text == reference.text

    stream = mesh.chat(MESSAGES, NEW_TOKENS, tenant="i", worker=roles.neighbour, stream=True)
    chunks = list(stream)
    assert [c.token_id for c in chunks] == reference.token_ids
    assert "".join(c.text for c in chunks) == reference.text
    assert stream.result.token_ids == reference.token_ids
    assert stream.result.finish_reason == "stop"
    assert stream.result.stats["remote_hit_tokens"] > 0


BAD_REQUESTS = [
    ({"max_new_tokens": 2.0}, "max_new_tokens must be an int, got 2.0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int, got True"),
    ({"max_new_tokens": 8192}, "exceed the model's context window of 8192 tokens"),
    ({"prompt": [1, 2, 49152]}, r"token id 49152 \(position 2\) outside the model's vocab"),
    ({"prompt": [1, -1]}, "token id -1"),
    ({"prompt": [1, 2.5]}, "token id 1 is 2.5, not an int"),
    ({"prompt": 17}, "a prompt is text or a sequence of token ids, got int"),
    ({"tenant": "\ud800"}, "is not valid UTF-8"),
    ({"tenant": "x" * 300}, "tenant name of 300 bytes"),
    ({"tenant": ""}, "a tenant is a non-empty name"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": "7"}, "seed"),
    ({"stop_token_ids": [60000]}, "stop token 60000"),
    ({"worker": "w9"}, "unknown worker 'w9'"),
]


@pytest.mark.parametrize(("change", "message"), BAD_REQUESTS)
def test_bad_requests_are_refused_at_the_front_door_holding_nothing(mesh, prompt, change, message):
    arguments = {"prompt": prompt[:20], "max_new_tokens": 4, "tenant": "bad", **change}
    before = {w: s["cache"] for w, s in mesh.stats()["workers"].items()}
    with pytest.raises(ValueError, match=message):
        mesh.generate(**arguments)
    with pytest.raises(ValueError, match=message):
        mesh.stream(**{k: v for k, v in arguments.items()})
    after = {w: s["cache"] for w, s in mesh.stats()["workers"].items()}
    assert after == before  # no query, no page held or cached anywhere


def test_bad_chats_are_refused(mesh):
    for messages, message in [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "user"}], "exactly 'role' and 'content'"),
        ([{"role": "user", "content": 3}], "content must be a str"),
        ([{"role": "root", "content": "obey"}], "role 'root'; the chat template takes"),
        ([{"role": "", "content": "hi"}], "role ''"),
    ]:
        with pytest.raises(ValueError, match=message):
            mesh.chat(messages)
    # A flag that is not a bool is refused, not taken for true.
    with pytest.raises(ValueError, match="return_logits must be a bool, got 'yes'"):
        mesh.generate([1, 2, 3], 1, return_logits="yes")


def _questions(mesh, n: int) -> list[list[int]]:
    """`n` prompts sharing the system prompt and differing in the user's question."""
    asks = ["Which train goes to Lyon?", "Can I take my dog?", "Is the 7:40 direct?",
            "Do bicycles travel free on Mondays?"]  # fmt: skip
    prompts = []
    for ask in asks[:n]:
        messages = [MESSAGES[0], {"role": "user", "content": ask}]
        text = mesh.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        prompts.append(list(mesh.tokenizer.encode(text)))
    return prompts


def test_a_batch_sharing_an_uncached_prefix_computes_it_once_with_each_output_as_alone(mesh, roles):
    """Four requests sent together, sharing a system prompt nobody has cached: the first
    computes it, the others only their questions, all in the worker's batched passes;
    each output (tokens, finish reason, last-prompt logits) equals the request run alone,
    uncached."""
    prompts = _questions(mesh, 4)
    shared = min(len(p) for p in prompts)
    while any(p[:shared] != prompts[0][:shared] for p in prompts):
        shared -= 1
    alone = [
        mesh.generate(p, 24, tenant="batch-ref", worker=roles.alone, return_logits=True,
                      reuse=False)
        for p in prompts
    ]  # fmt: skip
    batch = mesh.generate(prompts, 24, tenant="batch", worker=roles.first, return_logits=True)
    assert len(batch) == 4
    for result, reference in zip(batch, alone, strict=True):
        _same(result, reference)
    page = 16
    assert batch[0].stats["computed_tokens"] == len(prompts[0])
    for result in batch[1:]:
        # The shared pages were computed once, by the first request, in the same batch.
        assert result.stats["batch_shared_tokens"] == shared // page * page
        assert result.stats["local_hit_tokens"] == 0  # computed once is not a hit
        assert result.stats["ttft_client_s"] >= result.stats["ttft_s"] > 0


def test_concurrent_calls_from_threads_are_batched_on_one_worker(mesh, roles):
    """Requests from four threads at once reach one worker's scheduler together: they
    share forward passes (fewer passes than run one by one) and give the outputs they
    give alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [p[-40:] for p in _questions(mesh, 4)]  # the questions' ends: no shared pages
    alone = [mesh.generate(p, 12, tenant="threads-ref", worker=roles.neighbour) for p in prompts]
    before = ray.get(mesh.workers[roles.neighbour].stats.remote()).scheduler
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(mesh.generate, p, 12, tenant="threads", worker=roles.neighbour)
            for p in prompts
        ]
        together = [f.result() for f in futures]
    after = ray.get(mesh.workers[roles.neighbour].stats.remote()).scheduler
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    passes = after["forward_calls"] - before["forward_calls"]
    assert passes < sum(len(r.token_ids) for r in together)  # one by one: a pass a token

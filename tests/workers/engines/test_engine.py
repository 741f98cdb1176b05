"""An engine as a worker of the mesh (`workers.engines.engine`), without vLLM: its blocks in pages
and back, its namespaces, its enrollment at the service, and two engines sharing a prefix
through a real service and real shared memory, with vLLM's CPU cache layout."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import pytest
import torch

from cache_service.auth import KeyPair, MeshKeys
from cache_service.events import Namespace, PagesStored
from cache_service.server import ServerConfig, make_server
from cache_service.zap import LateKeys
from tests.waiting import wait_until
from workers.engines import engine as engine_module
from workers.engines.blocks import (
    blocks_to_pages,
    engine_layout,
    kv_layers,
    layer_order,
    pages_to_blocks,
)
from workers.engines.engine import EngineCache, EngineIndex, LoadSpec, SaveSpec
from workers.engines.enrollment import Enrollment, engine_namespace
from workers.engines.kv_layouts import LAYOUTS, KVLayoutError, detect_layout, layer_views
from workers.service.client import ServiceClient, ServiceEndpoint, ServiceError, ServiceUnavailable

P = 4  # the index's tokens per page
BLOCK = 8  # vLLM's tokens per block: two pages
LAYERS, HEADS, HEAD_DIM, BLOCKS = 3, 2, 4, 12
SECRET = bytes(range(32))


def vllm_caches(seed: int) -> dict[str, torch.Tensor]:
    """Per-layer caches of vLLM's per-layer views' shape, (num_blocks, kv_heads, block,
    2 * head_dim)."""
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    # Named as vLLM names them, in an order that is not the model's.
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(torch.bfloat16)
        for i in (2, 0, 1)
    }


# ---- blocks and pages ---------------------------------------------------------------------


def views(caches: list[torch.Tensor], layout: str = "per_token_kv"):
    return layer_views(caches, LAYOUTS[layout], HEAD_DIM)


def test_a_block_is_its_pages_in_token_order():
    layers = kv_layers(vllm_caches(0))  # each token's K then its V on the last dim
    pages = blocks_to_pages(views(layers), [5, 2], P)
    assert pages.shape == (4, LAYERS, 2, HEADS, P, HEAD_DIM)
    for layer, cache in enumerate(layers):
        for token in range(BLOCK):
            page, slot = divmod(token, P)
            assert torch.equal(pages[page, layer, 0, :, slot], cache[5, :, token, :HEAD_DIM])
            assert torch.equal(pages[page, layer, 1, :, slot], cache[5, :, token, HEAD_DIM:])
            assert torch.equal(pages[2 + page, layer, 1, :, slot], cache[2, :, token, HEAD_DIM:])
    into = [torch.zeros_like(cache) for cache in layers]
    pages_to_blocks(pages, views(into), [0, 7])
    for cache, filled in zip(layers, into, strict=True):
        assert torch.equal(filled[0], cache[5]) and torch.equal(filled[7], cache[2])
        assert not filled[1:7].any() and not filled[8:].any()  # nothing else written


def test_layers_come_in_model_order():
    assert layer_order(["m.layers.10.attn", "m.layers.2.attn", "m.layers.0.attn"]) == [
        "m.layers.0.attn",
        "m.layers.2.attn",
        "m.layers.10.attn",
    ]
    with pytest.raises(ValueError, match="no layer number"):
        layer_order(["attn"])


def test_the_layout_follows_the_caches_and_refuses_what_it_cannot_cut():
    layers = views(kv_layers(vllm_caches(0)))
    layout = engine_layout(layers, BLOCK, P, num_blocks=10)
    assert (layout.num_pages, layout.num_layers, layout.num_kv_heads) == (20, LAYERS, HEADS)
    assert (layout.page_tokens, layout.head_dim, layout.dtype) == (P, HEAD_DIM, "bfloat16")
    with pytest.raises(ValueError, match="not a whole number"):
        engine_layout(layers, BLOCK, 3, num_blocks=10)
    caches = kv_layers(vllm_caches(0))
    with pytest.raises(KVLayoutError, match="blocks of 12 tokens"):
        detect_layout(caches[0], HEADS, HEAD_DIM, 12, "cpu_attn")  # 8 does not divide 12
    with pytest.raises(KVLayoutError, match="KV caches differ"):
        views([caches[0], caches[1].float()])


def test_namespaces_name_the_model_format_adapter_and_a_secret_salt():
    fmt = "kv1:layers=30:dtype=bfloat16"
    plain = engine_namespace("smollm2", fmt, SECRET, None)
    salted = engine_namespace("smollm2", fmt, SECRET, "alice")
    assert plain.model == salted.model == f"smollm2|{fmt}"
    assert salted.salt != plain.salt and "alice" not in salted.salt
    assert salted == engine_namespace("smollm2", fmt, SECRET, "alice")  # every engine agrees
    assert engine_namespace("smollm2", fmt, bytes(32), "alice").salt != salted.salt
    assert engine_namespace("smollm2", "kv1:dtype=float32", SECRET, None).model != plain.model
    assert engine_namespace("smollm2", fmt, SECRET, None, "lora-x").adapter == "lora-x"
    with pytest.raises(ValueError, match="cache_salt"):
        engine_namespace("smollm2", fmt, SECRET, "")


# ---- enrollment at the service ----------------------------------------------------------


class Service(NamedTuple):
    """A service and its mesh's keys, with the engines enrolled so far (what the service
    actor keeps in Ray and engines' page servers read, `enrolled_publics`)."""

    server: Any
    keys: MeshKeys
    enrolled: set[bytes]


@pytest.fixture
def mesh_service():
    """A service with authentication on, for a mesh of one launched worker w0."""
    keys = MeshKeys.generate(["w0"])
    server = make_server(ServerConfig(page_tokens=P), keys.server_keys())
    server.start()
    yield Service(server, keys, set())
    server.stop()
    server.index.check_integrity()


def enroll(
    service: Service, worker_id: str, node_id: str = "node-1", encrypt: bool = True
) -> Enrollment:
    pair = KeyPair.generate()
    service.server.admit_worker(worker_id, pair.public)
    service.enrolled.add(pair.public)
    endpoint = ServiceEndpoint(service.server.address, service.keys.service.public)
    readers = LateKeys(lambda: set(service.enrolled), interval_s=0.05)
    return Enrollment(
        worker_id, pair, service.keys.secret, endpoint, node_id, P, "127.0.0.1", encrypt, readers
    )


def test_an_enrolled_key_speaks_only_for_its_own_id(mesh_service):
    server = mesh_service.server
    stranger = KeyPair.generate()
    engine = enroll(mesh_service, "vllm-a")
    with ServiceClient(engine.endpoint, timeout_s=2.0, client_keys=engine.keypair) as client:
        assert client.register("vllm-a", "node-1", "cpu", "").service_epoch == server.epoch
        with pytest.raises(ServiceError, match="forbidden"):
            client.register("w0", "node-1", "cpu", "")  # the launcher's worker is not it
    with (
        ServiceClient(engine.endpoint, timeout_s=0.3, retries=0, client_keys=stranger) as client,
        pytest.raises(ServiceUnavailable),
    ):
        client.stats()  # never admitted: no answer at all
    server.admit_worker("vllm-a", engine.keypair.public)  # the same key again: fine
    with pytest.raises(ValueError, match="already bound to another key"):
        server.admit_worker("vllm-a", stranger.public)
    with pytest.raises(ValueError, match="already speaks as"):
        server.admit_worker("vllm-b", engine.keypair.public)
    with pytest.raises(ValueError, match="already bound"):
        server.admit_worker("w0", stranger.public)


# ---- two engines, one prefix ------------------------------------------------------------


@pytest.fixture
def engines(mesh_service):
    made = []

    def make(worker_id: str, node_id: str = "node-1", encrypt: bool = True) -> EngineCache:
        enrollment = enroll(mesh_service, worker_id, node_id, encrypt)
        caches = kv_layers(vllm_caches(len(made)))  # what vLLM would have registered
        layers = views(caches, "cpu_attn")
        engine = EngineCache(enrollment, engine_layout(layers, BLOCK, P, BLOCKS), BLOCK)
        engine.caches, engine.layers = caches, layers
        made.append(engine)
        return engine

    def restart(engine: EngineCache) -> EngineCache:
        """The same engine (id, key) started again: a new store and page server."""
        engine.close()
        again = EngineCache(engine.enrollment, engine.store.layout, BLOCK)
        again.caches = kv_layers(vllm_caches(len(made)))
        again.layers = views(again.caches, "cpu_attn")
        made[made.index(engine)] = again
        return again

    make.service = mesh_service
    make.restart = restart
    yield make
    for engine in made:
        engine.check_integrity()
        engine.close()


PROMPT = [(5 * i + 3) % 97 for i in range(3 * BLOCK + 5)]  # three whole blocks and some


def ns(engine: EngineCache, salt: str | None = None) -> Namespace:
    return engine_namespace("m", engine.store.kv_format, SECRET, salt)


def save(engine: EngineCache, prompt: list[int], blocks: list[int], salt=None) -> int:
    full = len(prompt) // BLOCK
    spec = SaveSpec("r", ns(engine, salt), tuple(prompt[: full * BLOCK]), tuple(blocks[:full]))
    written = engine.save(spec, engine.layers)
    assert engine.member.publisher.sync()
    return written


def load_spec(asker: EngineCache, prompt: list[int], blocks: list[int], salt=None) -> LoadSpec:
    index = EngineIndex(asker.enrollment, BLOCK)
    try:
        found, spans, peers = index.lookup(ns(asker, salt), prompt, (len(prompt) - 1) // BLOCK)
    finally:
        index.close()
    return LoadSpec(
        "r", ns(asker, salt), tuple(prompt[: found * BLOCK]), 0, tuple(blocks[:found]), spans, peers
    )


def test_an_engine_loads_what_another_saved_exactly(engines):
    a, b = engines("vllm-a"), engines("vllm-b")
    assert save(a, PROMPT, [4, 9, 1]) == 3 * BLOCK // P
    assert save(a, PROMPT, [4, 9, 1]) == 0  # held already: nothing copied again

    spec = load_spec(b, PROMPT + [1, 2], [7, 0, 11])
    assert spec.end == 3 and [s.worker_id for s in spec.spans] == ["vllm-a"]
    assert b.load(spec, b.layers) == set()  # nothing failed
    for mine, theirs in zip(b.caches, a.caches, strict=True):
        for asked, held in ((7, 4), (0, 9), (11, 1)):
            assert torch.equal(mine[asked], theirs[held])
    assert b.loaded_blocks == 3 and b.refused_pages == 0

    # B now holds the prefix too (it published its copies).
    assert b.member.publisher.sync()
    assert {s.worker_id for s in load_spec(a, PROMPT, [0, 1, 2]).spans} == {"vllm-a", "vllm-b"}


def test_another_salt_finds_nothing(engines):
    a, b = engines("vllm-a"), engines("vllm-b")
    save(a, PROMPT, [4, 9, 1], salt="alice")
    assert load_spec(b, PROMPT, [0, 1, 2], salt="bob").end == 0
    assert load_spec(b, PROMPT, [0, 1, 2]).end == 0  # no salt is a salt of its own
    assert load_spec(b, PROMPT, [0, 1, 2], salt="alice").end == 3


@pytest.mark.parametrize("encrypt", [True, False], ids=["curve", "signed"])
def test_an_engine_on_another_node_loads_through_the_page_server(engines, encrypt):
    a = engines("vllm-a", encrypt=encrypt)
    save(a, PROMPT, [4, 9, 1], salt="alice")
    far = engines("vllm-far", node_id="node-2", encrypt=encrypt)  # enrolled after A started
    spec = load_spec(far, PROMPT, [2, 5, 8], salt="alice")
    assert spec.end == 3 and [p.node_id for p in spec.peers] == ["node-1"]
    assert far.load(spec, far.layers) == set()
    for mine, theirs in zip(far.caches, a.caches, strict=True):
        for asked, held in ((2, 4), (5, 9), (8, 1)):
            assert torch.equal(mine[asked], theirs[held])
    assert a.page_server.pages_sent == 3 * BLOCK // P  # no shared memory between nodes
    page_bytes = far.store.layout.page_bytes
    assert far.member.figures.copy_bytes == {"same_node": 0, "remote": 3 * BLOCK // P * page_bytes}
    assert far.loaded_blocks == 3 and far.refused_pages == 0


def test_a_page_freed_on_another_node_is_refused(engines):
    a = engines("vllm-a")
    save(a, PROMPT, [4, 9, 1])
    far = engines("vllm-far", node_id="node-2")
    spec = load_spec(far, PROMPT, [2, 5, 8])
    a.cache.clear()  # A's pages are freed after the index named them (generations move on)
    before = [layer.clone() for layer in far.caches]
    assert far.load(spec, far.layers) == {2, 5, 8}  # vLLM recomputes them all
    assert all(torch.equal(n, b) for n, b in zip(far.caches, before, strict=True))
    assert far.refused_pages >= 1 and far.loaded_blocks == 0


def test_a_restarted_holder_is_found_at_its_new_store_and_page_server(engines):
    a, b = engines("vllm-a"), engines("vllm-b")
    save(a, PROMPT, [4, 9, 1])
    index = EngineIndex(b.enrollment, BLOCK, peer_ttl_s=0.0)  # asks for entries every time
    try:
        (peer,) = index.lookup(ns(b), PROMPT, 3)[2]
        assert (peer.shm_name, peer.page_address) == (a.store.name, a.page_server.address)
        a = engines.restart(a)
        assert index.lookup(ns(b), PROMPT, 3)[0] == 0  # it left: its pages left the index
        save(a, PROMPT, [4, 9, 1])
        found, spans, (peer,) = index.lookup(ns(b), PROMPT, 3)
        assert (peer.shm_name, peer.page_address) == (a.store.name, a.page_server.address)
    finally:
        index.close()
    spec = LoadSpec("r", ns(b), tuple(PROMPT[: 3 * BLOCK]), 0, (7, 0, 11), spans, (peer,))
    assert found == 3 and b.load(spec, b.layers) == set()
    for asked, held in ((7, 4), (0, 9), (11, 1)):
        assert torch.equal(b.caches[0][asked], a.caches[0][held])


def test_pages_that_hold_other_tokens_are_refused(engines):
    a, b = engines("vllm-a"), engines("vllm-b")
    other = [t + 1 for t in PROMPT]
    save(a, other, [4, 9, 1])
    # A forged entry: an engine x says it holds PROMPT in A's pages, which hold `other`.
    x = enroll(engines.service, "vllm-x")
    with ServiceClient(x.endpoint, timeout_s=2.0, client_keys=x.keypair) as client:
        held = client.match(ns(a), other).spans[0]
        epoch = client.register("vllm-x", "node-1", "cpu", "", shm_name=a.store.name).epoch
        forged = PagesStored(
            ns(a), None, held.page_ids, held.generations, tuple(PROMPT[: 3 * BLOCK])
        )
        assert client.publish_events("vllm-x", epoch, 1, [forged]).applied
    spec = load_spec(b, PROMPT, [7, 0, 11])
    assert spec.end == 3  # the index believes it
    before = [layer.clone() for layer in b.caches]
    assert b.load(spec, b.layers) == {7, 0, 11}  # all refused: vLLM recomputes them
    assert b.refused_pages >= 1 and b.loaded_blocks == 0
    for now, then in zip(b.caches, before, strict=True):
        assert torch.equal(now, then)  # not a byte of vLLM's blocks changed


def test_the_scheduler_side_never_probes_a_silent_service_itself(monkeypatch):
    """vLLM's scheduler loop calls `lookup`: with the service down, one short try opens
    the breaker, later lookups are misses without a try of their own (the scheduler never
    waits on a probe), and the index's own thread finds the service when it is back."""
    monkeypatch.setattr(engine_module, "SERVICE_BACKOFF_S", 0.2)  # probes fall due often
    server = make_server(ServerConfig(page_tokens=P))
    server.start()
    host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
    server.stop()  # nothing answers there now
    enrollment = Enrollment("vllm-x", None, SECRET, ServiceEndpoint(server.address), "n", P)
    index = EngineIndex(enrollment, BLOCK)
    namespace = Namespace("m", "", "")
    again = None
    try:
        assert index.lookup(namespace, PROMPT, 3) == (0, (), ())  # the one short try
        assert index.client.circuit_open
        for _ in range(30):  # past the breaker's backoffs, when probes fall due
            assert index.lookup(namespace, PROMPT, 3) == (0, (), ())
            time.sleep(0.1)
        assert index.client.probes == 0  # the scheduler side never probed
        again = make_server(ServerConfig(host=host, port=int(port), page_tokens=P))
        again.start()
        wait_until(lambda: not index.client.circuit_open, 20, "the prober to find the service")
        assert index.lookup(namespace, PROMPT, 3) == (0, (), ())  # asked, and it holds nothing
        assert index.client.stats()["workers_live"] == 0  # the scheduler side calls it again
    finally:
        index.close()
        if again is not None:
            again.stop()
    assert not index._probing.is_alive()

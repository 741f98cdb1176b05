"""Copies are checked against what the holder's pages hold, not only against change.

Finding covered: forged REGISTER + PagesStored events claiming that a worker's pages hold
another tenant's prompt made the victim copy those pages and generate wrong text, with no
error: the generation check only proves that a page did not change during the copy.

Each page's metadata in its store records a digest of its namespace, KV format and token
chain; a copied page is used only when that digest equals the one the requester computes
for its own prompt at that page.
"""

from __future__ import annotations

import pytest
import ray
import torch

import cluster
from cache_service.actor import get_service
from cache_service.events import Namespace, PagesStored
from cluster.config import config_from_dict
from workers.service.client import ServiceClient, ServiceEndpoint
from workers.store.digests import DIGEST_BYTES, page_digests
from workers.store.page_store import NotOwnerError, SharedPageStore, StoreLayout
from workers.transfer import PageClient, PageServer, copy_from_peer

LAYOUT = StoreLayout(num_pages=12, num_layers=2, num_kv_heads=2, page_tokens=4, head_dim=8)
NS_A = Namespace("tiny", "", "salt-a")
NS_B = Namespace("tiny", "", "salt-b")
EMPTY = bytes(DIGEST_BYTES)


@pytest.fixture
def stores():
    holder = SharedPageStore.create(LAYOUT, tag="holder")
    requester = SharedPageStore.create(LAYOUT, tag="requester")
    pages = holder.allocate(3)
    for page in pages:
        holder.write_page(page, torch.full(LAYOUT.page_shape, float(page + 1)))
    yield holder, requester, pages
    holder.check_integrity()
    requester.check_integrity()
    requester.close()
    holder.close()


def test_digests_name_the_namespace_the_format_and_the_whole_chain():
    tokens = list(range(12))
    a = page_digests(NS_A, LAYOUT.kv_format, tokens, 4)
    assert len(a) == 3 and all(len(d) == DIGEST_BYTES for d in a)
    assert a == page_digests(NS_A, LAYOUT.kv_format, tokens + [99], 4)  # full pages only
    assert page_digests(NS_A, LAYOUT.kv_format, tokens[:8], 4) == a[:2]
    assert page_digests(NS_B, LAYOUT.kv_format, tokens, 4)[0] != a[0]  # another tenant
    other_format = StoreLayout(12, 2, 2, 4, 8, "float16").kv_format
    assert page_digests(NS_A, other_format, tokens, 4)[0] != a[0]  # other KV bytes
    changed = page_digests(NS_A, LAYOUT.kv_format, [7] + tokens[1:], 4)
    assert all(x != y for x, y in zip(changed, a, strict=True))  # the chain carries it on


def test_a_page_records_what_it_holds_until_it_is_freed_or_rewritten(stores):
    holder, _, pages = stores
    digests = page_digests(NS_A, LAYOUT.kv_format, list(range(12)), 4)
    assert holder.digests(pages) == [EMPTY] * 3  # nothing published yet
    for page, digest in zip(pages, digests, strict=True):
        holder.set_digest(page, digest)
    assert holder.digests(pages) == digests
    generation = holder.generation(pages[0])
    holder.write_page(pages[0], torch.zeros(LAYOUT.page_shape))  # rewritten: another content
    assert holder.digests(pages[:1]) == [EMPTY] and holder.generation(pages[0]) > generation
    holder.free(pages[1:2])
    assert holder.digests(pages[1:2]) == [EMPTY]
    reader = SharedPageStore.attach(holder.name)
    assert reader.digests(pages[2:]) == digests[2:]
    with pytest.raises(NotOwnerError):
        reader.set_digest(pages[2], digests[0])
    with pytest.raises(ValueError, match="16 bytes"):
        holder.set_digest(pages[2], b"short")
    reader.close()


@pytest.mark.parametrize("path", ["same node", "page server"])
def test_a_copy_is_used_only_where_the_digest_matches(stores, path):
    holder, requester, pages = stores
    held = page_digests(NS_A, LAYOUT.kv_format, list(range(12)), 4)
    for page, digest in zip(pages, held, strict=True):
        holder.set_digest(page, digest)
    # The requester asked for another tenant's pages at the first two, its own at the last.
    wanted = page_digests(NS_B, LAYOUT.kv_format, list(range(12)), 4)[:2] + held[2:]
    gens = holder.generations(pages)
    dst = requester.allocate(3)
    if path == "same node":
        peer = SharedPageStore.attach(holder.name)
        valid = copy_from_peer(peer, pages, gens, requester, dst, digests=wanted)
        peer.close()
    else:
        server = PageServer(holder)
        client = PageClient(server.address, timeout_s=2.0)
        valid = client.fetch(pages, gens, requester, dst, digests=wanted)
        client.close()
        server.stop()
    assert valid == [False, False, True]
    assert torch.equal(requester.page(dst[2]), holder.page(pages[2]))


def test_the_prefix_cache_records_digests_at_publish():
    from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig

    holder = SharedPageStore.create(LAYOUT, tag="cached")  # the cache owns all its pages
    cache = PrefixCache(holder, PrefixCacheConfig(page_tokens=4))
    tokens = list(range(100, 110))  # two full pages and a partial one
    allocation = cache.acquire(tokens, NS_A)
    pages = allocation.pages[:2]
    assert holder.digests(pages) == [EMPTY] * 2  # computed, not yet shareable
    allocation.publish(len(tokens))
    assert holder.digests(pages) == page_digests(NS_A, holder.kv_format, tokens, 4)
    allocation.release()
    cache.clear()  # evicted: freed, so the digests are gone with the generation bump
    assert holder.digests(pages) == [EMPTY] * 2
    cache.check_integrity()
    holder.check_integrity()
    holder.close()


# ---- end to end: a forged index entry through the front door ------------------------------


@pytest.fixture(scope="module", params=["no-auth", "auth"])
def mesh(request, ray_local):
    cfg = config_from_dict(
        {
            "model": {"name": "tiny"},
            "cache": {"page_tokens": 4},
            "store": {"num_pages": 128},
            # Heartbeats every minute: the real w0 does not repair the forgery in between.
            "workers": {
                "count": 2,
                "threads": 1,
                "publish_interval_s": 60.0,
                "copy_policy": "always",
            },
            "security": {"auth": request.param == "auth"},
        }
    )
    mesh = cluster.connect(cfg)
    yield mesh
    mesh.check_integrity()
    mesh.shutdown()


def attacker(mesh) -> ServiceClient:
    """A client of the service: anyone when authentication is off, else one holding w0's key
    (a compromised worker)."""
    endpoint = ray.get(get_service().endpoint.remote())
    keys = mesh.keys.workers["w0"] if mesh.keys is not None else None
    return ServiceClient(
        ServiceEndpoint(endpoint["address"], endpoint["server_key"]), client_keys=keys
    )


def test_a_forged_entry_is_tried_refused_and_recomputed(mesh):
    prompt_a = [(7 * i + 3) % 250 for i in range(41)]  # 10 full pages
    prompt_b = [(11 * i + 5) % 250 for i in range(41)]
    reference = mesh.generate(prompt_b, 6, tenant="reference", worker="w1", return_logits=True)
    assert reference.stats["computed_tokens"] == len(prompt_b)
    mesh.generate(prompt_a, 6, tenant="a", worker="w0")
    mesh.flush()
    legit = mesh.generate(prompt_a + [1], 6, tenant="a", worker="w1")
    assert legit.stats["remote_hit_tokens"] == 40  # real copies pass the check
    refused_before = mesh.stats()["workers"]["w1"]["copies_refused"]

    # The forgery: w0's pages of tenant a's prompt "hold" tenant b's prompt.
    client = attacker(mesh)
    ns_a = Namespace("tiny", "", mesh.salt("a"))
    ns_b = Namespace("tiny", "", mesh.salt("b"))
    held = client.match(ns_a, prompt_a).spans
    w0 = next(span for span in held if span.worker_id == "w0")
    registered = client.register("w0", "forged-node", "cpu", "")
    forged = PagesStored(ns_b, None, w0.page_ids, w0.generations, tuple(prompt_b[:40]))
    assert client.publish_events("w0", registered.epoch, 1, [forged]).applied
    assert client.match(ns_b, prompt_b).matched_tokens == 40  # the index now says so
    client.close()

    victim = mesh.generate(prompt_b, 6, tenant="b", worker="w1", return_logits=True)
    assert mesh.stats()["workers"]["w1"]["copies_refused"] >= refused_before + 1  # tried
    assert victim.stats["remote_hit_tokens"] == 0
    assert victim.token_ids == reference.token_ids
    diff = (torch.tensor(victim.logits) - torch.tensor(reference.logits)).abs().max().item()
    assert diff <= 1e-4

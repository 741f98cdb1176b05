"""Spot checks with the real model: how far an honest recomputation of a copied token's KV
is from the copy, how far another prompt's is, and the tolerance between them
(`workers.transfer.spot_check`)."""

from __future__ import annotations

import sys

from cache_service.events import Namespace
from tests.workers.model_fixtures import NS, compute, make_prompt, make_rig
from workers.serving.batch_runner import Chunk
from workers.transfer.spot_check import kv_error, tolerance

PAGE = 4


def _recomputed_error(rig, pages, tokens, j) -> float:
    """The last token of page j recomputed in place over every token before it (what a
    spot check runs), against what its slot held."""
    pos = (j + 1) * PAGE - 1
    slot = rig.store.page(pages[j])[:, :, :, PAGE - 1]
    held = slot.clone()
    rig.runner.forward([Chunk(list(pages[: j + 1]), tokens[pos : pos + 1], pos)])
    return kv_error(held, slot)


def test_an_honest_page_passes_and_another_prompts_page_fails(smollm2):
    model, _ = smollm2
    with make_rig(model, num_pages=64, page_tokens=PAGE) as rig:
        a = make_prompt(48, seed=1)
        b = a[:1] + [(a[1] + 7) % 200] + a[2:]  # one token apart, early on
        alone, _ = compute(rig, a, release=False)
        # The same prompt computed in one batch with another (a different summation
        # order in the packed pass), as a holder may have computed it.
        batch = rig.cache.acquire(b, NS)
        other = make_prompt(40, seed=2)
        side = rig.cache.acquire(other, NS)
        rig.runner.forward([Chunk(batch.pages, b, 0), Chunk(side.pages, other, 0)])
        honest = [_recomputed_error(rig, alone.pages, a, j) for j in (0, 5, 11)]
        honest += [_recomputed_error(rig, batch.pages, b, j) for j in (3, 9)]
        # A copy of prompt a whose page j holds prompt b's page j: what a poisoner serves
        # (into a request of another tenant, whose pages are its own until published).
        victim = rig.cache.acquire(a, Namespace(NS.model, "", "another-tenant"))
        for page, source in zip(victim.pages, alone.pages, strict=True):
            rig.store.write_page(page, rig.store.page(source).clone())
        poisoned = []
        for j in (3, 9, 11):
            rig.store.write_page(victim.pages[j], rig.store.page(batch.pages[j]).clone())
            poisoned.append(_recomputed_error(rig, victim.pages, a, j))
        print(f"\nhonest {max(honest):.2e}, poisoned {min(poisoned):.2e}", file=sys.stderr)
        limit = tolerance("float32")
        assert max(honest) < limit / 100  # orders of magnitude of margin
        assert min(poisoned) > 10 * limit
        for allocation in (alone, batch, side, victim):
            allocation.release()
        rig.check_integrity()

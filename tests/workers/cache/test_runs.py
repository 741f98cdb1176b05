"""Runs, the trie's nodes: their child maps (indexed by first token once wide)."""

from __future__ import annotations

from cache_service.tokens import pack_tokens
from tests.workers.cache_helpers import NS, PAGE
from workers.cache.runs import Run, pages_for

STEP = PAGE * 4  # bytes of one packed page


def leaf(parent: Run, tokens: list[int], first_id: int) -> Run:
    """A one-page run holding `tokens` (one page of them) under `parent`."""
    key = pack_tokens(tokens)
    return Run(key, key, [first_id], parent, first_id, 1)


def test_a_wide_fan_out_is_indexed_by_first_token_and_unindexed_when_emptied():
    root = Run(NS, None, [], None, -1, 1)
    # 18 children, two per first token: child i starts with token i // 2
    kids = [leaf(root, [i // 2, 100 + i, 0, 0], i) for i in range(18)]
    for kid in kids[:16]:
        root.add_child(kid)
    assert root.by_first is None  # 16: still scanned
    assert root.starting_with(pack_tokens([3])) == [kids[6], kids[7]]
    root.add_child(kids[16])
    assert root.by_first is not None and len(root.by_first) == 9
    root.add_child(kids[17])
    assert root.starting_with(pack_tokens([8])) == [kids[16], kids[17]]
    assert root.starting_with(pack_tokens([50])) == ()

    other = leaf(root, [4, 108, 0, 0], 99)  # the same page as kids[8], another run
    root.replace_child(kids[8], other)
    assert list(root.iter_children())[8] is other  # the order of children is kept
    assert root.starting_with(pack_tokens([4])) == [other, kids[9]]
    assert root.child(kids[8].head) is other

    root.remove_child(kids[6])
    root.remove_child(kids[7])
    assert pack_tokens([3]) not in root.by_first
    for kid in [*kids[:6], other, *kids[9:]]:
        root.remove_child(kid)
    assert root.children is None and root.by_first is None
    assert root.iter_children() == () and root.starting_with(pack_tokens([0])) == ()


def test_a_runs_id_and_depth_are_its_last_pages():
    root = Run(NS, None, [], None, -1, 1)
    run = Run(pack_tokens(list(range(3 * PAGE))), None, [7, 8, 9], root, 10, 1)
    assert (run.node_id, run.depth) == (12, 3)
    assert root.ready and not run.ready  # a root matches; a new run is pending
    assert not run.is_evictable_leaf()
    run.ready = True
    assert run.is_evictable_leaf()
    run.ref_count = 1
    assert not run.is_evictable_leaf()


def test_pages_for():
    assert [pages_for(n, PAGE) for n in (0, 1, PAGE, PAGE + 1)] == [0, 1, 1, 2]

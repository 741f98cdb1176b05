"""The trie's structure: runs made, split, trimmed and removed, page ids and counts."""

from __future__ import annotations

from cache_service.tokens import pack_tokens
from tests.workers.cache_helpers import NS, PAGE
from workers.cache.trie import Trie

STEP = PAGE * 4  # bytes of one packed page


def test_split_trim_and_remove_keep_ids_depths_and_counts():
    trie = Trie(PAGE, chunk_tokens=0, kv_format="")
    key = pack_tokens(list(range(3 * PAGE)))
    run = trie.new_run(key, key[:STEP], [20, 21, 22], trie.root(NS))
    child_key = pack_tokens(list(range(100, 100 + PAGE)))
    child = trie.new_run(child_key, child_key, [23], run)
    assert (run.first_id, run.depth, child.first_id, child.depth) == (0, 3, 3, 4)
    assert (trie.next_id, trie.num_pages) == (4, 4)

    owners = {run: 5}  # a batch's request 5 computes the run
    low = trie.split(run, 1, owners)
    assert (low.pages, low.node_id, low.depth) == ([20], 0, 1)
    assert (run.pages, run.first_id, run.depth, run.key) == ([21, 22], 1, 3, key[STEP:])
    assert run.parent is low and trie.root(NS).child(key[:STEP]) is low
    assert low.child(key[STEP : 2 * STEP]) is run and child.parent is run
    assert owners == {run: 5, low: 5}
    assert trie.num_pages == 4  # a split moves pages, adds none

    trie.remove_run(child)
    run.ready, run.digests = True, [b"d1", b"d2"]
    trie.trim(run, 1)
    assert (run.pages, run.digests, run.key, run.node_id) == (
        [21],
        [b"d1"],
        key[STEP : 2 * STEP],
        1,
    )
    assert trie.num_pages == 2 and not child.alive
    trie.remove_run(run)
    trie.remove_run(low)
    assert trie.roots == {} and trie.num_pages == 0  # an empty root goes with its last run
    assert trie.next_id == 4  # ids are never reused

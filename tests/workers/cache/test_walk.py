"""The compiled walk of the local prefix trie (workers/cache/csrc/walk.cpp) on runs built
by hand: whole pages by exact bytes, a run left partway, the best partial page among
siblings (scanned, or indexed by first token once a fan-out is wide), pending runs only
for their batch, and bad input refused with nothing changed."""

from __future__ import annotations

import pytest

from cache_service.tokens import pack_tokens
from tests.workers.cache_helpers import NS, PAGE
from workers.cache._walk import walk
from workers.cache.runs import Run

STEP = PAGE * 4  # bytes of one packed page


def run_of(parent: Run, tokens: list[int], first_id: int, ready: bool = True) -> Run:
    """A run of `tokens` (whole pages) under `parent`."""
    key = pack_tokens(tokens)
    pages = list(range(first_id, first_id + len(tokens) // PAGE))
    run = Run(key, key[:STEP], pages, parent, first_id, parent.first_depth + len(parent.pages))
    run.ready = ready
    parent.add_child(run)
    return run


def page(*firsts: int, fill: int = 7) -> list[int]:
    """One page: `firsts`, then `fill`."""
    return [*firsts, *[fill] * (PAGE - len(firsts))]


@pytest.fixture
def root() -> Run:
    return Run(NS, None, [], None, -1, 1)


def test_whole_runs_then_a_run_left_partway_with_its_next_page_as_the_partial(root):
    a = run_of(root, page(1) + page(2), 0)
    b = run_of(a, page(3) + page(4) + page(5), 2)
    prompt = pack_tokens(page(1) + page(2) + page(3) + page(4) + page(5, 9, fill=8))
    walked, end, partial, common = walk(root, prompt, STEP, {})
    assert walked == [a, b] and end == 4 * STEP  # b left after its second page
    assert partial is b and common == 1  # its third page shares the first token


def test_the_partial_is_the_child_sharing_most_tokens_first_found_on_ties(root):
    a = run_of(root, page(1), 0)
    one = run_of(a, page(2, 3, fill=0), 1)
    two = run_of(a, page(2, 3, 4, fill=0), 2)
    run_of(a, page(2, 3, 4, fill=1), 3)  # ties with two: two came first
    run_of(a, page(2, 3, 4, 5, fill=1), 4, ready=False)  # longest, but pending
    prompt = pack_tokens(page(1) + [2, 3, 4, 6])  # a short last page
    assert walk(root, prompt, STEP, {}) == ([a], STEP, two, 3)
    assert one is not two


def test_a_wide_fan_out_is_searched_by_first_token(root):
    a = run_of(root, page(1), 0)
    for first in range(40):  # past the scan limit: children indexed by first token
        run_of(a, page(100 + first, 0), 1 + first)
    best = run_of(a, page(120, 5, 6), 60)
    assert a.by_first is not None
    prompt = pack_tokens(page(1) + page(120, 5, 9))
    assert walk(root, prompt, STEP, {}) == ([a], STEP, best, 2)
    assert walk(root, pack_tokens(page(1) + [999]), STEP, {}) == ([a], STEP, None, 0)


def test_pending_runs_match_only_for_their_batch(root):
    a = run_of(root, page(1), 0)
    pending = run_of(a, page(2) + page(3), 1, ready=False)
    prompt = pack_tokens(page(1) + page(2) + page(3) + [4])
    assert walk(root, prompt, STEP, {}) == ([a], STEP, None, 0)
    assert walk(root, prompt, STEP, {pending: 0}) == ([a, pending], 3 * STEP, None, 0)


def test_a_prompt_shorter_than_a_page_or_without_a_root_walks_nothing(root):
    run_of(root, page(1), 0)
    assert walk(root, pack_tokens([1, 7]), STEP, {}) == (
        [],
        0,
        root.children[pack_tokens(page(1))],
        2,
    )
    assert walk(None, pack_tokens(page(1)), STEP, {}) == ([], 0, None, 0)
    assert walk(root, b"", STEP, {}) == ([], 0, None, 0)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((b"\x00" * 6, STEP, {}), ValueError, "6 bytes of packed tokens"),
        ((b"", 6, {}), ValueError, "a page of 6 bytes"),
        ((b"", 0, {}), ValueError, "a page of 0 bytes"),
        ((bytearray(4), STEP, {}), TypeError, "packed bytes"),
        ((b"", STEP, []), TypeError, "dict of owners"),
    ],
)
def test_bad_arguments_are_refused(root, args, error, message):
    with pytest.raises(error, match=message):
        walk(root, *args)


def test_a_node_that_is_not_a_run_is_refused(root):
    a = run_of(root, page(1), 0)
    a.key = list(a.key)  # not bytes
    with pytest.raises(TypeError, match="key is list"):
        walk(root, pack_tokens(page(1) + page(2)), STEP, {})
    with pytest.raises(AttributeError):
        walk(object(), pack_tokens(page(1)), STEP, {})

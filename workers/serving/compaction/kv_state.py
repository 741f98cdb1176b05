"""A sequence's KV as attention reads it once it is tracked for compaction or compacted.

Which layout, and why. A page holds the K and V of P tokens for every layer and KV head
(`workers.store.page_store`), which is what copying prefixes between workers wants. Compaction
keeps different tokens in each (layer, KV head), and a different number of them where the
policy allows, so keeping one token per slot across all heads would free nothing: a page
could only go once every head had dropped all of its tokens. The compacted part of a
sequence therefore uses per-head packed pages: each page of the compacted segment is cut
into L x KVH lanes (the page's `[layer, k|v, head]` blocks of P slots), and each
(layer, KV head) stream of survivors fills lanes of its own, any lane of any segment page,
in position order. A stream that keeps k tokens takes ceil(k / P) lanes, and the segment
takes ceil(all lanes / (L x KVH)) pages, so what one head drops is memory returned whatever
the other heads keep. The page shape, the store and its free list stay as they are (a
compacted page is a page), and only this sequence ever reads them: compacted sequences are
private, never published.

    positions  0               dense_tokens                  tail_start          length
               [ trie pages    ][ segment: survivors, per-head ][ tail: every token ]
               read whole,      lanes of (layer, head) streams   one slot per token,
               never compacted  in position order                pages after the segment

Tokens computed after a compaction go to the tail; the next compaction packs segment and
tail together again. Positions stay logical: survivors keep the RoPE of the position they
were computed at, and a new token is rotated at its true position, however few tokens
precede it in memory (as TensorRT-LLM and kvpress do).

Scores. Policies rank tokens by the attention they receive. A tracked sequence's chunks run
through `KvState.attend`, an explicit attention that has the weights anyway, and add for
every compactable key (segment and tail; the trie pages are never compacted) the weight it
received from every query (`accumulated`, H2O's score) and from the last `window` queries
(SnapKV's observation window), summed over the query heads of its KV head. Queries are
scored in blocks, so nothing of size queries x keys outlives one block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from workers.serving.compaction.policies import SCORES, Candidates
from workers.serving.paged_attention import gather_pages

__all__ = ["SCORES", "KvState", "Reads", "Segment"]
# Bytes of float32 scores one block of queries may hold (queries x keys x heads).
_BLOCK_BYTES = 32 << 20


class Segment(NamedTuple):
    """The compacted survivors: stream (l, h) keeps `lengths[l, h]` tokens in its lanes
    `(lane_page, lane_layer, lane_head)[l, h, :ceil(length / P)]`, slot j of the stream in
    lane j // P, slot j % P. Lanes past a stream's end repeat a real lane (read, masked)."""

    lane_page: torch.Tensor  # (L, KVH, nl) long: page id
    lane_layer: torch.Tensor  # (L, KVH, nl) long: the layer block of that page it uses
    lane_head: torch.Tensor  # (L, KVH, nl) long: the head block
    lengths: torch.Tensor  # (L, KVH) long
    positions: torch.Tensor  # (L, KVH, nl * P) long: each slot's logical position, -1 past the end

    @property
    def slots(self) -> int:
        return self.positions.shape[2]

    def valid(self) -> torch.Tensor:
        """(L, KVH, slots) bool: the slots holding a survivor."""
        return torch.arange(self.slots) < self.lengths.unsqueeze(-1)


class Reads(NamedTuple):
    """What one chunk's queries read in a pass (computed once, used by every layer)."""

    dense: torch.Tensor  # (d,) long: trie pages read whole
    dense_mask: torch.Tensor  # (q, d * P) bool: causal
    tail: torch.Tensor  # (t,) long: tail pages
    tail_len: int  # tail tokens read: [tail_start, tail_start + tail_len)
    tail_mask: torch.Tensor  # (q, tail_len) bool: causal
    segment_valid: torch.Tensor | None  # (L, KVH, S) bool: the segment's filled slots
    window_rows: int  # the chunk's last queries that count as the observation window


class KvState:
    """The KV layout (and, when tracked, the attention scores) of one sequence.

    Args:
        num_layers, num_kv_heads, page_tokens: the store's layout.
        dense_pages: the allocation's trie pages (read whole, never compacted).
        track: scores to keep for a policy (subset of `SCORES`).
        window: queries in the observation window.

    Raises:
        ValueError: an unknown score or a window < 1.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        page_tokens: int,
        dense_pages: int,
        track: frozenset[str] = frozenset(),
        window: int = 32,
    ):
        if not track <= SCORES:
            raise ValueError(f"unknown scores {sorted(track - SCORES)}; known: {sorted(SCORES)}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.num_layers, self.num_kv_heads, self.page_tokens = num_layers, num_kv_heads, page_tokens
        self.dense_pages = dense_pages
        self.track = track
        self.window = window
        self.tail_start = dense_pages * page_tokens
        self.segment_pages = 0
        self.segment: Segment | None = None
        self.compactions = 0
        # Scores by column: the segment's slots, then the tail's tokens.
        self._accumulated = torch.zeros(num_layers, num_kv_heads, 0)
        self._window: deque[list] = deque()  # [queries, (L, KVH, columns)] per chunk

    # -- layout ------------------------------------------------------------------------

    @property
    def dense_tokens(self) -> int:
        return self.dense_pages * self.page_tokens

    @property
    def segment_slots(self) -> int:
        return 0 if self.segment is None else self.segment.slots

    @property
    def needs_own_path(self) -> bool:
        """Whether attention must go through `attend` (compacted, or scores tracked)."""
        return self.segment is not None or bool(self.track)

    def tail_pages(self, pages: Sequence[int]) -> Sequence[int]:
        return pages[self.dense_pages + self.segment_pages :]

    def write_targets(
        self, pages: Sequence[int], start: int, end: int
    ) -> tuple[list[int], list[int]]:
        """(page, slot) of each position in [start, end): dense before the tail, then the
        tail's pages one slot a token."""
        p, tail = self.page_tokens, self.tail_pages(pages)
        out_pages, slots = [], []
        for pos in range(start, end):
            if pos < self.tail_start:
                assert self.segment is None, f"position {pos} is inside the compacted part"
                out_pages.append(pages[pos // p])
                slots.append(pos % p)
            else:
                at = pos - self.tail_start
                out_pages.append(tail[at // p])
                slots.append(at % p)
        return out_pages, slots

    def reads(self, pages: Sequence[int], start: int, end: int, device) -> Reads:
        """What queries at positions [start, end) read, and where their window begins."""
        assert start >= self.tail_start or self.segment is None, (start, self.tail_start)
        p = self.page_tokens
        query_pos = torch.arange(start, end).unsqueeze(1)  # (q, 1)
        dense_n = -(-min(self.dense_tokens, end) // p)
        dense_mask = torch.arange(dense_n * p) <= query_pos  # (q, d * P)
        tail_len = max(0, end - self.tail_start)
        tail = list(self.tail_pages(pages)[: -(-tail_len // p)])
        tail_mask = self.tail_start + torch.arange(tail_len) <= query_pos  # (q, T)
        return Reads(
            torch.tensor(list(pages[:dense_n]), dtype=torch.long, device=device),
            dense_mask.to(device),
            torch.tensor(tail, dtype=torch.long, device=device),
            tail_len,
            tail_mask.to(device),
            None if self.segment is None else self.segment.valid().to(device),
            min(end - start, self.window),
        )

    # -- scores ------------------------------------------------------------------------

    def begin(self, n_queries: int, end: int) -> None:
        """A pass will run `n_queries` queries ending at position `end`: room for the
        scores of every key they read."""
        if not self.track:
            return
        columns = self.segment_slots + max(0, end - self.tail_start)
        have = self._accumulated.shape[2]
        if columns > have:
            grow = max(columns - have, have)  # doubling: decode adds a column a step
            pad = torch.zeros(self.num_layers, self.num_kv_heads, grow)
            self._accumulated = torch.cat([self._accumulated, pad], dim=2)
        if "window" in self.track:
            rows = min(n_queries, self.window)
            self._window.append([rows, torch.zeros(self.num_layers, self.num_kv_heads, columns)])
            while sum(r for r, _ in self._window) - self._window[0][0] >= self.window:
                self._window.popleft()

    def window_queries(self) -> int:
        return sum(rows for rows, _ in self._window)

    def scores(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(accumulated, window) of the first `columns` columns, `(L, KVH, columns)` each
        (zeros for what is not tracked)."""
        shape = (self.num_layers, self.num_kv_heads, columns)
        accumulated = torch.zeros(shape)
        if "accumulated" in self.track:
            accumulated = self._accumulated[:, :, :columns].clone()
        window = torch.zeros(shape)
        for _, entry in self._window:
            n = min(columns, entry.shape[2])
            window[:, :, :n] += entry[:, :, :n]
        return accumulated, window

    # -- attention ---------------------------------------------------------------------

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        pages: torch.Tensor,
        layer: int,
        reads: Reads,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one chunk's queries `(H, q, hd)` in `layer`: trie pages, then the
        segment's lanes, then the tail; `kv` is the layer's slice of every page
        `(N, 2, KVH, P, hd)`, `pages` every page `(N, L, 2, KVH, P, hd)`. Returns
        `(H, q, hd)`, and adds the weights to the tracked scores."""
        heads, n_q, head_dim = q.shape
        kv_heads = kv.shape[2]
        rep = heads // kv_heads
        dense_k, dense_v = gather_pages(kv, reads.dense, q.dtype)  # (KVH, d * P, hd)
        tail_k, tail_v = gather_pages(kv, reads.tail, q.dtype)
        keys = [dense_k, tail_k[:, : reads.tail_len]]
        values = [dense_v, tail_v[:, : reads.tail_len]]
        d = dense_k.shape[1]
        masks = [reads.dense_mask.expand(kv_heads, -1, -1)]
        if self.segment is not None:
            seg = self.segment
            lanes = pages[seg.lane_page[layer], seg.lane_layer[layer], :, seg.lane_head[layer]]
            # (KVH, nl, 2, P, hd) -> (2, KVH, nl * P, hd)
            lanes = lanes.permute(2, 0, 1, 3, 4).reshape(2, kv_heads, -1, head_dim)
            keys.insert(1, lanes[0])
            values.insert(1, lanes[1])
            masks.append(reads.segment_valid[layer].unsqueeze(1).expand(-1, n_q, -1))
        masks.append(reads.tail_mask.expand(kv_heads, -1, -1))
        keys_all = torch.cat(keys, dim=1).to(q.dtype)  # (KVH, C, hd)
        values_all = torch.cat(values, dim=1).to(q.dtype)
        mask = torch.cat(masks, dim=2)  # (KVH, q, C)
        grouped = q.view(kv_heads, rep, n_q, head_dim)
        out = torch.empty_like(grouped)
        columns = keys_all.shape[1]
        block = max(1, _BLOCK_BYTES // (4 * heads * max(1, columns)))
        window_from = n_q - reads.window_rows
        for b0 in range(0, n_q, block):
            b1 = min(n_q, b0 + block)
            scores = torch.einsum("krqd,kcd->krqc", grouped[:, :, b0:b1], keys_all) * scale
            scores = scores.float().masked_fill(~mask[:, None, b0:b1], float("-inf"))
            weights = scores.softmax(dim=-1)  # (KVH, rep, b, C)
            out[:, :, b0:b1] = torch.einsum("krqc,kcd->krqd", weights.to(q.dtype), values_all)
            if self.track:
                self._record(layer, weights[..., d:], b0, window_from)
        return out.view(heads, n_q, head_dim)

    def _record(self, layer: int, weights: torch.Tensor, b0: int, window_from: int) -> None:
        """Add a block's weights on the compactable columns `(KVH, rep, b, cols)`."""
        cols = weights.shape[-1]
        if "accumulated" in self.track:
            self._accumulated[layer, :, :cols] += weights.sum(dim=(1, 2)).cpu()
        if "window" in self.track:
            skip = max(0, window_from - b0)
            if skip < weights.shape[2]:
                entry = self._window[-1][1]
                entry[layer, :, :cols] += weights[:, :, skip:].sum(dim=(1, 2)).cpu()

    # -- compaction --------------------------------------------------------------------

    def candidates(self, length: int) -> tuple[Candidates, torch.Tensor]:
        """The compactable tokens (segment survivors, then the tail up to `length`) as
        per-stream candidates, and each candidate's column `(L, KVH, n)`."""
        L, H = self.num_layers, self.num_kv_heads  # noqa: N806 - shape names
        tail_len = max(0, length - self.tail_start)
        tail_pos = (self.tail_start + torch.arange(tail_len)).expand(L, H, -1)
        if self.segment is not None:
            positions = torch.cat([self.segment.positions, tail_pos], dim=2)
            valid = torch.cat(
                [self.segment.valid(), torch.ones(L, H, tail_len, dtype=torch.bool)], 2
            )
        else:
            positions, valid = tail_pos.clone(), torch.ones(L, H, tail_len, dtype=torch.bool)
        n = positions.shape[2]
        # Valid candidates first, in position order (the segment's precede the tail's).
        index = torch.arange(n).expand(L, H, -1)
        order = torch.where(valid, index, index + n).argsort(dim=2)
        accumulated, window = self.scores(n)
        candidates = Candidates(
            positions=positions.gather(2, order),
            valid=valid.gather(2, order),
            accumulated=accumulated.gather(2, order),
            window=window.gather(2, order),
            window_queries=self.window_queries(),
            next_position=length,
        )
        return candidates, order

    def compacted(
        self,
        segment: Segment,
        segment_pages: int,
        tail_start: int,
        kept_columns: torch.Tensor,
        columns: int,
    ) -> None:
        """Take the layout a compaction wrote: the survivors are `segment`, and their
        scores follow them (`kept_columns` (L, KVH, slots): each new slot's column among
        the `columns` of `candidates`, -1 past a stream's end)."""
        accumulated, window = self.scores(columns)
        kept = kept_columns >= 0
        at = kept_columns.clamp(min=0)
        if "accumulated" in self.track:
            self._accumulated = accumulated.gather(2, at) * kept
        if "window" in self.track:
            rows = min(self.window_queries(), self.window)
            self._window = deque([[rows, window.gather(2, at) * kept]])
        self.segment = segment
        self.segment_pages = segment_pages
        self.tail_start = tail_start
        self.compactions += 1

    def check_integrity(self, pages: Sequence[int], length: int) -> None:
        """Raise AssertionError unless the layout fits the allocation's `pages` and the
        sequence's `length`: lanes on segment pages, no lane twice, streams in position
        order inside the compacted span, the tail covered."""
        p = self.page_tokens
        assert self.dense_tokens <= self.tail_start <= length, (
            f"dense {self.dense_tokens}, tail from {self.tail_start}, length {length}"
        )
        tail_pages = len(pages) - self.dense_pages - self.segment_pages
        assert tail_pages >= 0 and self.tail_start + tail_pages * p >= length, (
            f"{tail_pages} tail pages from {self.tail_start} do not hold {length} tokens"
        )
        if self.segment is None:
            assert self.segment_pages == 0
            return
        seg = self.segment
        own = set(pages[self.dense_pages : self.dense_pages + self.segment_pages])
        lanes_used = -(-seg.lengths // p)  # (L, KVH)
        seen: set[tuple[int, int, int]] = set()
        for layer in range(self.num_layers):
            for head in range(self.num_kv_heads):
                n = int(seg.lengths[layer, head])
                for j in range(int(lanes_used[layer, head])):
                    lane = (
                        int(seg.lane_page[layer, head, j]),
                        int(seg.lane_layer[layer, head, j]),
                        int(seg.lane_head[layer, head, j]),
                    )
                    assert lane[0] in own, f"lane {lane} of ({layer}, {head}) off the segment"
                    assert lane not in seen, f"lane {lane} used twice"
                    seen.add(lane)
                positions = seg.positions[layer, head, :n]
                assert bool((positions[1:] > positions[:-1]).all()), (
                    f"stream ({layer}, {head}) out of position order"
                )
                if n:
                    assert self.dense_tokens <= int(positions[0]), int(positions[0])
                    assert int(positions[-1]) < self.tail_start, int(positions[-1])
                assert bool((seg.positions[layer, head, n:] == -1).all())
        lanes_per_page = self.num_layers * self.num_kv_heads
        assert self.segment_pages == -(-len(seen) // lanes_per_page), (
            f"{len(seen)} lanes on {self.segment_pages} pages of {lanes_per_page} lanes"
        )

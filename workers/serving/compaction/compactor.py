"""Compaction of one sequence: a policy picks each (layer, KV head)'s survivors, they are
packed into per-head lanes (`workers.serving.compaction.kv_state`) on as few of the sequence's own
pages as hold them, and the other pages go back to the store's free list at once
(`Allocation.free_and_reallocate`).

Only the sequence's private pages are compacted: its trie pages (a cached prefix, shared
with other requests, or its own prompt pages once published) are never written, and the
allocation is private from then on. The survivors are read out before any page is
rewritten, so packing reuses the sequence's first private pages in place and needs no free
page: compaction works exactly when the store is full.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from workers.serving.compaction.config import Budget, CompactionConfig
from workers.serving.compaction.kv_state import KvState, Segment
from workers.serving.compaction.policies import CompactionPolicy, make_compaction_policy

if TYPE_CHECKING:
    from workers.cache.prefix_cache import Allocation
    from workers.store.page_store import SharedPageStore


class CompactionResult(NamedTuple):
    """What one compaction did."""

    pages_before: int  # the sequence's compactable pages before
    pages_after: int  # the segment's pages after
    pages_freed: int  # back on the store's free list
    tokens_before: int  # compactable tokens (per stream)
    kept: torch.Tensor  # (L, KVH) long: tokens each stream kept

    @property
    def kept_tokens(self) -> int:
        return int(self.kept.sum())


class Compactor:
    """Compacts sequences whose KV lives in `store` (see the module docstring).

    Compaction runs on the CPU only: its scores are accumulated there and its packing reads
    survivors out page by page. A disabled one (`policy="none"`, what a worker builds when
    compaction is off) is accepted over any store, since it never touches a page.

    Args:
        store: the page store the sequences' pages are in.
        config: the policy and budget (`policy="none"`: `enabled` is False).

    Raises:
        ValueError: an enabled policy over a store whose pages are off the CPU (the device
            named), or a per-layer budget of the wrong length.
    """

    def __init__(self, store: SharedPageStore, config: CompactionConfig | None = None):
        self.store = store
        self.config = config or CompactionConfig()
        self.policy: CompactionPolicy | None = None
        if self.config.policy != "none":
            device = store.page_range(0, store.num_pages).device
            if device.type != "cpu":
                raise ValueError(
                    f"compaction policy {self.config.policy!r} needs a page store on the CPU; "
                    f"store {store.name!r} keeps its pages on {device}"
                )
            self.policy = make_compaction_policy(self.config.policy, **dict(self.config.params))
        self.budget = Budget.parse(self.config.budget)
        layout = store.layout
        per_layer = self.budget.per_layer
        if per_layer is not None and len(per_layer) != layout.num_layers:
            raise ValueError(
                f"a budget per layer needs {layout.num_layers} values, got {len(per_layer)}"
            )
        self.num_layers, self.num_kv_heads = layout.num_layers, layout.num_kv_heads
        self.page_tokens, self.head_dim = layout.page_tokens, layout.head_dim

    @property
    def enabled(self) -> bool:
        return self.policy is not None

    def track(self, allocation: Allocation, scores: frozenset[str] | None = None) -> KvState:
        """The state a sequence keeps from admission on, keeping `scores` (default: what
        the configured policy reads; `kv_state.SCORES`: everything, for any policy)."""
        if scores is None:
            scores = self.policy.needs if self.policy is not None else frozenset()
        return KvState(
            self.num_layers,
            self.num_kv_heads,
            self.page_tokens,
            allocation.held_pages,
            track=frozenset(scores),
            window=self.config.window,
        )

    def compact(
        self,
        allocation: Allocation,
        state: KvState,
        budget: Budget | float | int | None = None,
        policy: CompactionPolicy | None = None,
    ) -> CompactionResult:
        """Keep what `policy` picks of the sequence's compactable KV (every token after its
        trie pages) and free the pages that no longer hold any.

        Args:
            allocation: the sequence's pages; every one of its tokens has its KV computed.
            state: its layout and scores (from `track`).
            budget: overrides the configured budget.
            policy: overrides the configured policy.

        Returns:
            What was kept and freed; the free count grew by exactly `pages_freed`.

        Raises:
            ValueError: no policy, nothing to compact, or the state does not match the
                allocation.
        """
        policy = policy or self.policy
        if policy is None:
            raise ValueError("no compaction policy configured")
        budget = self.budget if budget is None else Budget.parse(budget)
        if allocation.held_pages != state.dense_pages:
            raise ValueError(
                f"the allocation holds {allocation.held_pages} trie pages, its state "
                f"{state.dense_pages}"
            )
        length = allocation.num_tokens
        candidates, columns = state.candidates(length)
        n = candidates.positions.shape[2]
        if n == 0:
            raise ValueError(f"nothing to compact: every token of {length} is in trie pages")
        keep = budget.counts(candidates.valid)
        kept = policy.select(candidates, keep)  # (L, KVH, n) bool
        assert not bool((kept & ~candidates.valid).any()), f"{policy.name} kept padding"
        counts = kept.sum(dim=2)  # (L, KVH)
        p, lanes_per_page = self.page_tokens, self.num_layers * self.num_kv_heads
        lanes = -(-counts // p)  # (L, KVH)
        width = max(1, int(lanes.max()))
        slots = width * p
        # Each stream's kept candidates first, in position order, padded to `slots`.
        index = torch.arange(n).expand_as(kept)
        picked = torch.where(kept, index, index + n).argsort(dim=2)[:, :, : min(n, slots)]
        if picked.shape[2] < slots:
            pad = picked[:, :, :1].expand(-1, -1, slots - picked.shape[2])
            picked = torch.cat([picked, pad], dim=2)
        in_stream = torch.arange(slots) < counts.unsqueeze(-1)  # (L, KVH, slots)
        kept_columns = torch.where(in_stream, columns.gather(2, picked), -1)
        positions = torch.where(in_stream, candidates.positions.gather(2, picked), -1)
        kv = self._columns_kv(allocation.pages, state, length)  # (L, KVH, 2, C, hd)
        at = kept_columns.clamp(min=0)[:, :, None, :, None]
        survivors = kv.gather(3, at.expand(-1, -1, 2, -1, self.head_dim))
        survivors = survivors * in_stream[:, :, None, :, None]  # (L, KVH, 2, slots, hd)

        private = list(allocation.pages[state.dense_pages :])
        total_lanes = int(lanes.sum())
        keep_pages = -(-total_lanes // lanes_per_page)
        assert keep_pages <= len(private), (keep_pages, len(private))
        segment = self._lanes(private[:keep_pages], lanes, width, counts, positions)
        self._write(segment, survivors, lanes)
        freed = allocation.free_and_reallocate(keep_pages, length)
        state.compacted(segment, keep_pages, length, kept_columns, n)
        return CompactionResult(len(private), keep_pages, len(freed), n, counts)

    # -- internals ---------------------------------------------------------------------

    def _columns_kv(self, pages, state: KvState, length: int) -> torch.Tensor:
        """The K and V of every compactable column (segment slots, then tail tokens up to
        `length`): `(L, KVH, 2, columns, hd)`, a copy."""
        L, H, hd, p = self.num_layers, self.num_kv_heads, self.head_dim, self.page_tokens  # noqa: N806
        store = self.store.page_range(0, self.store.num_pages)  # (N, L, 2, KVH, P, hd)
        parts = []
        if state.segment is not None:
            seg = state.segment
            lanes = store[seg.lane_page, seg.lane_layer, :, seg.lane_head]  # (L, KVH, nl, 2, P, hd)
            parts.append(lanes.permute(0, 1, 3, 2, 4, 5).reshape(L, H, 2, -1, hd))
        tail_len = length - state.tail_start
        if tail_len > 0:
            tail = list(state.tail_pages(pages)[: -(-tail_len // p)])
            got = store[torch.tensor(tail, dtype=torch.long)]  # (t, L, 2, KVH, P, hd)
            got = got.permute(1, 3, 2, 0, 4, 5).reshape(L, H, 2, -1, hd)
            parts.append(got[:, :, :, :tail_len])
        return torch.cat(parts, dim=3)

    def _lanes(
        self,
        pages: list[int],
        lanes: torch.Tensor,
        width: int,
        counts: torch.Tensor,
        positions: torch.Tensor,
    ) -> Segment:
        """Lanes for each stream, in (layer, head) order across `pages`: lane g is page
        g // (L x KVH), block g % (L x KVH) of it (layer, head in that order)."""
        kv_heads, per_page = self.num_kv_heads, self.num_layers * self.num_kv_heads
        first = (lanes.flatten().cumsum(0) - lanes.flatten()).view_as(lanes)  # (L, KVH)
        j = torch.arange(width)
        # Past a stream's own lanes, its first (or the segment's first) again: read, masked.
        lane = first.unsqueeze(-1) + torch.where(j < lanes.unsqueeze(-1), j, 0)
        lane = torch.where(lanes.unsqueeze(-1) > 0, lane, 0)  # (L, KVH, width)
        block = lane % per_page
        page_ids = torch.tensor(pages, dtype=torch.long)[lane // per_page]
        return Segment(page_ids, block // kv_heads, block % kv_heads, counts.clone(), positions)

    def _write(self, segment: Segment, survivors: torch.Tensor, lanes: torch.Tensor) -> None:
        """Survivors `(L, KVH, 2, width * P, hd)` into their lanes (own lanes only)."""
        store = self.store.page_range(0, self.store.num_pages)
        L, H, _, slots, hd = survivors.shape  # noqa: N806
        width = slots // self.page_tokens
        # (L, KVH, 2, width, P, hd) -> (L, KVH, width, 2, P, hd): one block per lane
        blocks = survivors.view(L, H, 2, width, self.page_tokens, hd).permute(0, 1, 3, 2, 4, 5)
        own = torch.arange(width) < lanes.unsqueeze(-1)  # (L, KVH, width)
        store[segment.lane_page[own], segment.lane_layer[own], :, segment.lane_head[own]] = blocks[
            own
        ].to(store.dtype)

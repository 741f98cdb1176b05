"""One forward pass over many sequences at once, their KV read from and written to pages.

The scheduler hands the runner a list of chunks, each a run of consecutive tokens of one
sequence whose earlier tokens already have their KV in that sequence's pages: a prompt's
first chunk, a later chunk of a long prompt, or the one new token of a sequence in decode.
The runner packs every chunk's tokens into one row (the model's projections and MLPs run
once over all of them), and in each layer:

1. projects the new tokens to Q, K, V and applies RoPE at each token's own position;
2. writes the new K and V straight into their page slots (the pages are the KV cache:
   nothing is appended to a per-sequence buffer, and nothing is copied out afterwards);
3. gathers, once per group of sequences, the K and V of every page the group reads, and
   runs one attention over the group's queries with a mask that lets each query see the
   pages of its own sequence up to its own position.

A group is the sequences that start from the same first page: pages are shared only as
a chain from the root of the prefix trie, so sequences sharing any page share their
first. The pages all of a group's sequences read first (a system prompt, an earlier
turn) are gathered once, and every query of the group is scored against them in one
matmul; each sequence's own pages after them are gathered and scored for its own queries
alone, causally. The two parts meet in one softmax (the scores' maximum and sums taken
over both), so the result is attention over the whole context, without a sequence's
queries ever being scored against another's keys:

    keys:        [ shared pages, gathered once ][ a's own pages ][ b's own pages ]
    queries a:   [ all of them (one matmul)     ][ causal        ]
    queries b:   [ all of them                  ]                 [ causal        ]

A sequence that computes tokens inside the shared pages themselves (the one whose prefill
fills them) runs alone, as does any sequence sharing nothing.

A chunk that carries a `KvState` (a sequence tracked for compaction, or compacted) runs
alone through the state's own attention (`workers.serving.compaction.kv_state`): its pages after
the trie pages may hold per-head packed survivors, and its attention weights feed the
compaction policy's scores.

The gathers and the cascade's merged softmax are in `workers.serving.paged_attention`.

Pages written here must be the caller's own (private, not yet published): no peer holds an
expected generation for them until they are published, so they are written without a
generation bump.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

from workers.serving.model_loader import check_store_fits
from workers.serving.paged_attention import cascade, gather_padded, gather_pages
from workers.store.page_store import SharedPageStore

__all__ = ["BatchRunner", "Chunk"]

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from workers.serving.compaction.kv_state import KvState, Reads


class Chunk(NamedTuple):
    """Run `tokens` of one sequence at positions [start, start + len(tokens)).

    Attributes:
        pages: the sequence's pages, page i holding tokens [i*P, (i+1)*P); they cover
            [0, start + len(tokens)), and hold the KV of [0, start) already.
        tokens: the chunk's token ids.
        start: the position of `tokens[0]`.
        kv: the sequence's compaction state, when it is tracked or compacted (its pages
            are then laid out as the state says, not one slot per position).
    """

    pages: Sequence[int]
    tokens: Sequence[int]
    start: int
    kv: KvState | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class _Member(NamedTuple):
    """One chunk of a group: its rows of the batch and the pages it reads alone."""

    rows: torch.Tensor  # (q,) long: its token rows in the packed batch
    pages: torch.Tensor  # (o,) long: its pages after the group's shared ones
    mask: torch.Tensor  # (q, o * P) bool: the own key slots each query sees (causal)


class _Decoders(NamedTuple):
    """Sequences running one token each (decode steps), attended in one batch: their own
    pages padded to the longest list (padding masked off)."""

    rows: torch.Tensor  # (m,) long: their rows in the packed batch
    pages: torch.Tensor  # (m, o) long: each one's own pages, padded with its first
    mask: torch.Tensor  # (m, o * P) bool: the own key slots each one sees


class _Group(NamedTuple):
    """Chunks that read the same first pages (`shared`, None when they share none)."""

    shared: torch.Tensor | None  # (s,) long: pages every member reads first
    rows: torch.Tensor  # (q,) long: the members' rows, then the decoders'
    members: list[_Member]  # chunks of several tokens, one at a time
    decoders: _Decoders | None  # one-token chunks, together


class BatchRunner:
    """Forward passes over batches of chunks for a Llama-architecture model whose KV lives
    in a page store (see the module docstring). One pass at a time (a lock).

    The pass runs where the model's weights are and in their dtype (`model.dtype`:
    bfloat16 on a GPU worker, float32 possible anywhere): every index, mask and position
    is built on that device, and the pages are read and written in place, so the store's
    page tensor must be on the same device (on a GPU worker the device store puts them
    in device memory; on the CPU the shared-memory store holds them). KV is written in the
    store's dtype, which must be the model's (`check_store_fits`); the logits come back as
    float32 on the model's device.

    Args:
        model: a HF Llama-architecture causal LM (`model.model.layers[i].self_attn` with
            q/k/v/o projections, RMS norms, an MLP, rotary embeddings).
        store: the owning page store, laid out for the model (`store_layout_for`), its
            pages on the model's device.

    Raises:
        ValueError: the model is not of that shape, lacks full attention in a layer, or its
            weights are on another device than the store's pages (both named).
        LayoutMismatchError: the store does not fit the model (its dtype among the fields
            compared), or is not the owning store (`check_store_fits`).
    """

    def __init__(self, model: PreTrainedModel, store: SharedPageStore):
        # transformers loads with a runner, not with this module: a front door loads the
        # worker's class (whose module imports this one) to hold a worker's actor handle,
        # and must not pay a second and a half for a model it never runs.
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rotary = apply_rotary_pos_emb
        inner = getattr(model, "model", None)
        if inner is None or not all(
            hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        ):
            raise ValueError(f"{type(model).__name__} is not a Llama-architecture causal LM")
        check_store_fits(model, store)
        device = next(model.parameters()).device
        pages_device = store.page_range(0, store.num_pages).device
        if pages_device != device:
            # Reading pages across devices would copy every gathered page in every layer
            # (or fail outright in an index op): a worker puts both in one place.
            raise ValueError(
                f"the model's weights are on {device} but the page store {store.name!r} "
                f"keeps its pages on {pages_device}; build the store on the model's device"
            )
        self.model = model
        self.store = store
        self.page_tokens = store.layout.page_tokens
        self.num_layers = len(inner.layers)
        self.device = device
        self.dtype = model.dtype  # of the pass and of the KV it writes (the store's)
        self.calls = 0  # forward passes run
        self.tokens_run = 0  # tokens those passes ran through the model
        self._lock = threading.Lock()

    def forward(
        self, chunks: Sequence[Chunk], all_logits: bool = False
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run every chunk in one forward pass; their KV is then in their pages.

        Args:
            chunks: what to run.
            all_logits: return the logits after every token (teacher-forced evaluation).

        Returns:
            `(len(chunks), vocab)` float32 on the model's device: the logits after each
            chunk's last token; with `all_logits`, one `(len(chunk.tokens), vocab)` tensor
            per chunk.

        Raises:
            ValueError: no chunks, an empty chunk, too few pages for a chunk, or a chunk
                with a compaction state on a runner off the CPU.
        """
        if not chunks:
            raise ValueError("a forward pass needs at least one chunk")
        p = self.page_tokens
        for i, chunk in enumerate(chunks):
            if not chunk.tokens:
                raise ValueError(f"chunk {i} has no tokens")
            if chunk.kv is not None and self.device.type != "cpu":
                raise ValueError(
                    f"chunk {i} carries a compaction state; compaction runs on the CPU only, "
                    f"and this runner is on {self.device}"
                )
            if chunk.start < 0 or _capacity(chunk, p) < chunk.end:
                raise ValueError(
                    f"chunk {i}: tokens [{chunk.start}, {chunk.end}) need "
                    f"{-(-chunk.end // p)} pages of {p}, got {len(chunk.pages)}"
                )
        with self._lock, torch.inference_mode():
            self.calls += 1
            self.tokens_run += sum(len(c.tokens) for c in chunks)
            logits = self._forward(chunks, all_logits)
            if not all_logits:
                return logits
            sizes = [len(c.tokens) for c in chunks]
            return list(logits.split(sizes))

    # -- the pass ----------------------------------------------------------------------

    def _forward(self, chunks: Sequence[Chunk], all_logits: bool) -> torch.Tensor:
        inner = self.model.model
        ids = torch.tensor([t for c in chunks for t in c.tokens], device=self.device)
        positions = torch.tensor(
            [pos for c in chunks for pos in range(c.start, c.end)], device=self.device
        )
        # Where each new token's K and V go: (page, slot) of its position in its sequence.
        pages_and_slots = [self._write_targets(c) for c in chunks]
        write_pages = torch.tensor([x for ps, _ in pages_and_slots for x in ps], device=self.device)
        write_slots = torch.tensor([x for _, ss in pages_and_slots for x in ss], device=self.device)
        groups = self._groups(chunks)
        offsets = [0]
        for chunk in chunks:
            offsets.append(offsets[-1] + len(chunk.tokens))
        own_path = []  # (state, rows, reads) of chunks that attend through their KvState
        for i, chunk in enumerate(chunks):
            if chunk.kv is not None:
                chunk.kv.begin(len(chunk.tokens), chunk.end)
                reads = chunk.kv.reads(chunk.pages, chunk.start, chunk.end, self.device)
                own_path.append((chunk.kv, self._rows(offsets, i), reads))
        if all_logits:
            last = torch.arange(offsets[-1], device=self.device)
        else:
            last = torch.tensor(offsets[1:], device=self.device) - 1

        hidden = inner.embed_tokens(ids.unsqueeze(0))  # (1, T, D)
        cos, sin = inner.rotary_emb(hidden, positions.unsqueeze(0))  # (1, T, hd) each
        pages = self.store.page_range(0, self.store.num_pages)  # (N, L, 2, kv_heads, P, hd)
        for layer_index, layer in enumerate(inner.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            attention = self._attention(
                layer.self_attn,
                x,
                (cos, sin),
                pages[:, layer_index],
                write_pages,
                write_slots,
                groups,
                (pages, layer_index, own_path),
            )
            hidden = residual + attention
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = inner.norm(hidden[0, last])  # (len(chunks), D)
        return self.model.lm_head(hidden).float()

    def _attention(
        self,
        attn: torch.nn.Module,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: torch.Tensor,
        write_pages: torch.Tensor,
        write_slots: torch.Tensor,
        groups: list[_Group],
        own_path: tuple[torch.Tensor, int, list[tuple[KvState, torch.Tensor, Reads]]],
    ) -> torch.Tensor:
        """One layer's attention for the packed batch `x` (1, T, D); `kv` is the layer's
        slice of every page, (N, 2, kv_heads, P, hd); `own_path` is every page, the layer's
        index and the chunks that attend through their KvState."""
        t, head_dim = x.shape[1], attn.head_dim
        q = attn.q_proj(x).view(1, t, -1, head_dim).transpose(1, 2)  # (1, H, T, hd)
        k = attn.k_proj(x).view(1, t, -1, head_dim).transpose(1, 2)  # (1, KVH, T, hd)
        v = attn.v_proj(x).view(1, t, -1, head_dim).transpose(1, 2)
        q, k = self._rotary(q, k, *rope)
        # The new tokens' KV into their slots: (T, KVH, hd) at kv[page, 0|1, :, slot].
        kv[write_pages, 0, :, write_slots] = k[0].transpose(0, 1).to(kv.dtype)
        kv[write_pages, 1, :, write_slots] = v[0].transpose(0, 1).to(kv.dtype)
        out = torch.empty_like(q)  # (1, H, T, hd)
        for group in groups:
            if group.shared is not None:
                out[0, :, group.rows] = cascade(q[0, :, group.rows], kv, group, attn.scaling)
                continue
            for member in group.members:
                keys, values = gather_pages(kv, member.pages, q.dtype)
                out[:, :, member.rows] = F.scaled_dot_product_attention(
                    q[:, :, member.rows],
                    keys.unsqueeze(0),
                    values.unsqueeze(0),
                    attn_mask=member.mask,
                    scale=attn.scaling,
                    enable_gqa=True,
                )
            if group.decoders is not None:
                d = group.decoders
                keys, values = gather_padded(kv, d.pages, q.dtype)  # (m, KVH, o * P, hd)
                # (1, H, m, hd) -> (m, H, 1, hd): one query each, its own keys
                mine = q[:, :, d.rows].permute(2, 1, 0, 3)
                attended = F.scaled_dot_product_attention(
                    mine,
                    keys,
                    values,
                    attn_mask=d.mask[:, None, None, :],
                    scale=attn.scaling,
                    enable_gqa=True,
                )
                out[:, :, d.rows] = attended.permute(2, 1, 0, 3)
        pages, layer_index, states = own_path
        for state, rows, reads in states:
            out[0, :, rows] = state.attend(
                q[0, :, rows], kv, pages, layer_index, reads, attn.scaling
            )
        return attn.o_proj(out.transpose(1, 2).reshape(1, t, -1))

    # -- grouping ----------------------------------------------------------------------

    def _groups(self, chunks: Sequence[Chunk]) -> list[_Group]:
        """The chunks grouped by their first page, each group with the pages all its
        members read first (see the module docstring); one-token chunks of a group are
        attended together, and so are those that share nothing."""
        p = self.page_tokens
        by_first: dict[int, list[int]] = {}
        for i, chunk in enumerate(chunks):
            if chunk.kv is None:  # the others attend through their KvState
                by_first.setdefault(chunk.pages[0], []).append(i)
        offsets = [0]
        for chunk in chunks:
            offsets.append(offsets[-1] + len(chunk.tokens))
        groups: list[_Group] = []
        lone_decoders: list[int] = []
        for members in by_first.values():
            # A chunk computing tokens inside the shared pages runs alone. Without it the
            # others may share more pages, inside which another computes (a spot check's
            # token, in a page its sequence's chunk reads): until none does.
            alone: list[int] = []
            shared = _common_pages([self._read(chunks[i]) for i in members])
            while len(members) > 1:
                inside = [i for i in members if chunks[i].start < shared * p]
                if not inside:
                    break
                alone += inside
                members = [i for i in members if i not in inside]
                if len(members) > 1:
                    shared = _common_pages([self._read(chunks[i]) for i in members])
            if len(members) <= 1:
                alone, members, shared = alone + members, [], 0
            for i in alone:
                if len(chunks[i].tokens) == 1:
                    lone_decoders.append(i)
                else:
                    member = self._member(chunks, offsets, i, 0)
                    groups.append(_Group(None, member.rows, [member], None))
            if members:
                several = [self._member(chunks, offsets, i, shared) for i in members
                           if len(chunks[i].tokens) > 1]  # fmt: skip
                decoders = self._decoders(
                    chunks, offsets, [i for i in members if len(chunks[i].tokens) == 1], shared
                )
                rows = [m.rows for m in several] + ([] if decoders is None else [decoders.rows])
                pages = torch.tensor(list(chunks[members[0]].pages[:shared]), device=self.device)
                groups.append(_Group(pages, torch.cat(rows), several, decoders))
        decoders = self._decoders(chunks, offsets, lone_decoders, 0)
        if decoders is not None:
            groups.append(_Group(None, decoders.rows, [], decoders))
        return groups

    def _decoders(
        self, chunks: Sequence[Chunk], offsets: list[int], indexes: list[int], shared: int
    ) -> _Decoders | None:
        """One-token chunks `indexes`, their own pages after `shared` padded into one
        batch (None when there are none)."""
        if not indexes:
            return None
        p = self.page_tokens
        own = [list(self._read(chunks[i])[shared:]) for i in indexes]
        width = max(len(pages) for pages in own)
        dev = self.device
        padded = [o + [o[0]] * (width - len(o)) for o in own]
        pages = torch.tensor(padded, dtype=torch.long, device=dev)  # (m, o)
        key_pos = torch.arange(shared * p, (shared + width) * p, device=dev)  # (o * P,)
        query_pos = torch.tensor([chunks[i].start for i in indexes], device=dev)  # (m,)
        mask = key_pos <= query_pos.unsqueeze(1)  # also off every padding slot: past its end
        rows = torch.tensor([offsets[i] for i in indexes], dtype=torch.long, device=dev)
        return _Decoders(rows, pages, mask)

    def _write_targets(self, chunk: Chunk) -> tuple[list[int], list[int]]:
        """(page, slot) of each of the chunk's tokens."""
        if chunk.kv is not None:
            return chunk.kv.write_targets(chunk.pages, chunk.start, chunk.end)
        p = self.page_tokens
        positions = range(chunk.start, chunk.end)
        return [chunk.pages[pos // p] for pos in positions], [pos % p for pos in positions]

    def _read(self, chunk: Chunk) -> Sequence[int]:
        """The pages a chunk's queries read: those holding [0, end)."""
        return chunk.pages[: -(-chunk.end // self.page_tokens)]

    def _rows(self, offsets: list[int], i: int) -> torch.Tensor:
        return torch.arange(offsets[i], offsets[i + 1], device=self.device)

    def _member(self, chunks: Sequence[Chunk], offsets: list[int], i: int, shared: int) -> _Member:
        """Chunk i's own part after `shared` pages: its pages and causal mask."""
        p, chunk = self.page_tokens, chunks[i]
        own = self._read(chunk)[shared:]
        key_pos = torch.arange(shared * p, (shared + len(own)) * p, device=self.device)
        query_pos = torch.arange(chunk.start, chunk.end, device=self.device).unsqueeze(1)
        mask = key_pos <= query_pos  # (q, o * P)
        pages = torch.tensor(list(own), dtype=torch.long, device=self.device)
        return _Member(self._rows(offsets, i), pages, mask)


def _capacity(chunk: Chunk, page_tokens: int) -> int:
    """Positions a chunk's pages cover: [0, capacity)."""
    if chunk.kv is None:
        return len(chunk.pages) * page_tokens
    return chunk.kv.tail_start + len(chunk.kv.tail_pages(chunk.pages)) * page_tokens


def _common_pages(page_lists: Sequence[Sequence[int]]) -> int:
    """How many first pages every list has in common."""
    first, n = page_lists[0], min(len(pages) for pages in page_lists)
    for i in range(n):
        if any(pages[i] != first[i] for pages in page_lists):
            return i
    return n

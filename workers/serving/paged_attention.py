"""Attention over KV pages: gathering pages into keys and values, and the cascade that
scores a group's queries against its shared pages once (`workers.serving.batch_runner`
explains the groups and draws the key layout).

Everything here runs on whatever device the page tensor and the queries are on (the same
one: the batch runner checks it) and builds no tensor on any other. Queries, keys and
values are in the model's dtype; the cascade's scores and softmax are taken in float32
whatever that dtype is, as SDPA's kernels take theirs: in bfloat16 the sum of a long
row of weights would carry a relative error of about 2^-9, enough to move a greedy token
that a plain forward keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.serving.batch_runner import _Group

# The dtype of the cascade's scores and softmax (see the module docstring).
SOFTMAX_DTYPE = torch.float32


def gather_pages(
    kv: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `pages` in page order.

    Args:
        kv: one layer's slice of every page, `(N, 2, KVH, P, hd)`.
        pages: `(n,)` long page ids, on `kv`'s device.
        dtype: the dtype to return them in.

    Returns:
        `(keys, values)`, `(KVH, n * P, hd)` each.
    """
    heads, head_dim = kv.shape[2], kv.shape[4]
    keys = kv[pages, 0].transpose(0, 1).reshape(heads, -1, head_dim)
    values = kv[pages, 1].transpose(0, 1).reshape(heads, -1, head_dim)
    return keys.to(dtype), values.to(dtype)


def gather_padded(
    kv: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each row of `pages` `(m, o)`: `(m, KVH, o * P, hd)` each."""
    m, o = pages.shape
    heads, page_tokens, head_dim = kv.shape[2], kv.shape[3], kv.shape[4]
    # (m, o, KVH, P, hd) -> (m, KVH, o, P, hd) -> (m, KVH, o * P, hd)
    keys = kv[pages, 0].permute(0, 2, 1, 3, 4).reshape(m, heads, o * page_tokens, head_dim)
    values = kv[pages, 1].permute(0, 2, 1, 3, 4).reshape(m, heads, o * page_tokens, head_dim)
    return keys.to(dtype), values.to(dtype)


def cascade(q: torch.Tensor, kv: torch.Tensor, group: _Group, scale: float) -> torch.Tensor:
    """Attention of a group's queries over its shared pages and each member's own pages,
    merged in one softmax.

    Args:
        q: `(H, q, hd)` the group's queries, members' rows first, then the decoders'.
        kv: one layer's slice of every page, `(N, 2, KVH, P, hd)`.
        group: the group (its `shared` pages are not None).
        scale: the scores' scale (1 / sqrt(hd) for Llama).

    Returns:
        `(H, q, hd)` in `q`'s dtype.
    """
    heads, q_len, head_dim = q.shape
    kv_heads = kv.shape[2]
    rep = heads // kv_heads
    acc = SOFTMAX_DTYPE
    shared_k, shared_v = gather_pages(kv, group.shared, acc)  # (KVH, s * P, hd)
    grouped = q.to(acc).view(kv_heads, rep * q_len, head_dim)  # query heads of one KV head
    # (KVH, rep * q, s * P) -> (KVH, rep, q, s * P): every query against the shared keys
    shared_scores = (grouped @ shared_k.transpose(1, 2) * scale).view(kv_heads, rep, q_len, -1)
    out = torch.empty(kv_heads, rep, q_len, head_dim, dtype=q.dtype, device=q.device)
    shared_v = shared_v.unsqueeze(1)  # (KVH, 1, s * P, hd)
    at = 0
    for member in group.members:
        n = len(member.rows)
        own_k, own_v = gather_pages(kv, member.pages, acc)  # (KVH, o * P, hd)
        mine = grouped.view(kv_heads, rep, q_len, head_dim)[:, :, at : at + n]
        own_scores = (mine.reshape(kv_heads, rep * n, head_dim) @ own_k.transpose(1, 2)) * scale
        own_scores = own_scores.view(kv_heads, rep, n, -1).masked_fill(~member.mask, -torch.inf)
        out[:, :, at : at + n] = _merged(
            shared_scores[:, :, at : at + n], shared_v, own_scores, own_v.unsqueeze(1)
        )
        at += n
    if group.decoders is not None:
        d = group.decoders
        m = len(d.rows)
        own_k, own_v = gather_padded(kv, d.pages, acc)  # (m, KVH, o * P, hd)
        # (KVH, rep, m, hd) x (m, KVH, o*P, hd) -> (KVH, rep, m, o*P): each its own keys
        mine = grouped.view(kv_heads, rep, q_len, head_dim)[:, :, at : at + m]
        own_scores = torch.einsum("krmd,mksd->krms", mine, own_k) * scale
        own_scores = own_scores.masked_fill(~d.mask[None, None], -torch.inf)
        # The own part's values: (KVH, rep, m, o*P) x (m, KVH, o*P, hd) per sequence.
        out[:, :, at : at + m] = _merged(
            shared_scores[:, :, at : at + m], shared_v, own_scores, own_v.permute(1, 0, 2, 3)
        )
    return out.view(heads, q_len, head_dim)


def _merged(
    shared_scores: torch.Tensor,
    shared_v: torch.Tensor,
    own_scores: torch.Tensor,
    own_v: torch.Tensor,
) -> torch.Tensor:
    """One softmax over two parts of the keys: scores `(KVH, rep, n, s)` and `(KVH, rep,
    n, o)`, values `(KVH, 1, s, hd)` and either `(KVH, 1, o, hd)` (one sequence's keys
    for all n queries) or `(KVH, n, o, hd)` (query i's own keys: a decode batch). All in
    the softmax dtype; the caller casts the result."""
    top = torch.maximum(shared_scores.amax(-1, keepdim=True), own_scores.amax(-1, keepdim=True))
    shared_w, own_w = (shared_scores - top).exp(), (own_scores - top).exp()
    total = shared_w.sum(-1, keepdim=True) + own_w.sum(-1, keepdim=True)
    if own_v.shape[1] == 1:
        own_part = own_w @ own_v
    else:  # query i against its own values only
        own_part = torch.einsum("krns,knsd->krnd", own_w, own_v)
    return (shared_w @ shared_v + own_part) / total

"""Reference for ragged, causal attention of new tokens over a paged KV cache (the target's verify step).

All requests are computed as one padded batch (in groups bounded by the score size), not one by one. The index work
is planned once per set of lengths (:func:`plan_verify_attention`) and reusable by every layer of a forward."""

from __future__ import annotations

import torch

from ._paged_attention import (
    AttentionPlan,
    GroupPlan,
    PagedRead,
    RaggedRows,
    mask_or_none,
    masked_gqa_attention,
    request_groups,
)


def plan_verify_attention(page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                          page_size: int, num_q_heads: int) -> AttentionPlan:
    """The index work of :func:`verify_attention_ref` for these lengths (arguments as there, plus the cache's
    ``page_size`` and the number of query heads, which sizes the request groups)."""
    cu = cu_seqlens_q.long()
    q_lens_t, kv_t = cu[1:] - cu[:-1], seq_lens.long()
    q_lens, kv_lens = q_lens_t.tolist(), kv_t.tolist()
    total = int(cu[-1]) if len(q_lens) else 0
    groups = []
    for g in request_groups(q_lens, kv_lens, num_q_heads):
        max_q, max_kv = max(q_lens[g]), max(kv_lens[g])
        if max_q == 0:
            continue
        if all(n == 1 for n in q_lens[g]) and all(n == max_kv for n in kv_lens[g]):
            allowed = None  # one new token per request, every request max_kv long: each sees every key
        else:
            kv = kv_t[g, None, None]
            q_pos = kv - q_lens_t[g, None, None] + torch.arange(max_q, device=cu.device)[None, :, None]  # [n, Q, 1]
            key = torch.arange(max_kv, device=cu.device)
            allowed = mask_or_none((key <= q_pos) & (key < kv))  # causal, and no key past the request's own length
        groups.append(GroupPlan(RaggedRows.of(cu[:-1][g], q_lens_t[g], q_lens[g], max_q, total),
                                PagedRead.of(page_table[g], kv_t[g], max_kv, page_size), allowed))
    return AttentionPlan(total, page_size, **AttentionPlan.inputs(q_lens, kv_lens, page_table), groups=tuple(groups))


def verify_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole paged KV.

    Args:
        q: ``[total_q, Hq, D]`` queries of the new tokens of all requests, flattened (request r owns rows
            ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` paged cache that already holds the new tokens' K/V.
        page_table: ``[R, max_pages]`` int page ids; token t of request r lives at
            ``(page_table[r, t // page_size], t % page_size)``.
        cu_seqlens_q: ``[R + 1]`` offsets of the new tokens.
        seq_lens: ``[R]`` total KV length of each request including its new tokens (>= its query length).
        sm_scale: softmax scale (usually ``D ** -0.5``).
        plan: :func:`plan_verify_attention` of these page table, offsets and lengths (``None``: made here).
    Returns:
        ``[total_q, Hq, D]`` in ``q.dtype``; new token i of request r (0-based) sits at absolute position
        ``seq_lens[r] - q_len_r + i`` and attends keys ``0..`` that position. Math in fp32.
    """
    if plan is None:
        plan = plan_verify_attention(page_table, cu_seqlens_q, seq_lens, k_cache.shape[1], q.shape[1])
    plan.check(q, k_cache)
    out = torch.empty_like(q)
    for g in plan.groups:
        o = masked_gqa_attention(g.queries.padded(q), g.cached.gather(k_cache), g.cached.gather(v_cache), g.allowed,
                                 sm_scale)
        g.queries.scatter(out, o)
    return out

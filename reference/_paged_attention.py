"""Shared pieces of the attention references: paged K/V gathered into padded per-request tensors, and one batched,
masked GQA attention over them.

The references run many requests at once (one padded batch instead of a Python loop over requests), in groups whose
score tensor stays under ``SCORE_BUDGET`` elements, so a long prefill does not allocate scores for every request
padded to the longest one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

SCORE_BUDGET = 1 << 24  # fp32 scores per request group: 64 MiB


def request_groups(q_lens: list[int], kv_lens: list[int], heads: int) -> Iterator[slice]:
    """Consecutive slices of the requests whose padded scores ``[n, heads, max q, max kv]`` fit ``SCORE_BUDGET``
    (a single request always forms a group, however large)."""
    start, n = 0, len(q_lens)
    while start < n:
        end, max_q, max_kv = start, 0, 0
        while end < n:
            q, kv = max(max_q, q_lens[end]), max(max_kv, kv_lens[end])
            if end > start and (end - start + 1) * heads * q * kv > SCORE_BUDGET:
                break
            end, max_q, max_kv = end + 1, q, kv
        yield slice(start, end)
        start = end


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, lens: torch.Tensor, length: int) -> torch.Tensor:
    """``cache [num_pages, page_size, Hkv, D]`` read at positions ``0..length-1`` of every request of ``page_table
    [n, max_pages]``: ``[n, length, Hkv, D]``. Positions at or past a request's own length ``lens [n]`` are zeros:
    neither the page table's unused entries nor the stale slots of a live cache are read (they may hold anything,
    and a masked NaN still poisons attention)."""
    page_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    outside = pos >= lens[:, None]
    slots = (page_table.long()[:, pos // page_size] * page_size + pos % page_size).masked_fill(outside, 0)
    rows = cache.reshape(-1, *cache.shape[2:]).index_select(0, slots.reshape(-1))  # one flat gather: the fast path
    return zero_rows(rows.view(*slots.shape, *cache.shape[2:]), outside)


def zero_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the entries ``x[i, j]`` (each a ``[Hkv, D]`` row) where ``rows [n, L]`` is True; ``x [n, L,
    Hkv, D]`` contiguous. Returns ``x``. (An index fill over the flattened rows: 8x faster than a masked fill.)"""
    x.view(rows.numel(), -1).index_fill_(0, rows.reshape(-1).nonzero().squeeze(1), 0)
    return x


def padded_rows(starts: torch.Tensor, lens: torch.Tensor, width: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ids ``[n, width]`` of flattened ragged rows (request i owns ``starts[i] .. starts[i] + lens[i] - 1``,
    padding clamped into ``0..total-1``) and their validity mask ``[n, width]``."""
    idx = torch.arange(width, device=starts.device)
    rows = (starts[:, None] + idx).clamp(max=max(total - 1, 0))
    return rows, idx < lens[:, None]


def masked_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor,
                         sm_scale: float) -> torch.Tensor:
    """``softmax(q k^T * sm_scale, masked -> -inf) v`` in float32 for padded requests.

    ``q [n, Q, Hq, D]``, ``k``/``v [n, K, Hkv, D]`` (query head h reads KV head ``h // (Hq / Hkv)``), ``masked
    [n, Q, K]`` True where a query must not see a key. Returns ``[n, Q, Hq, D]`` float32 (a view); a fully masked row
    holds no meaningful value. Keys and values must be finite even where masked (a masked NaN score, or a zero
    probability times a NaN value, is still NaN). torch's fused CPU attention does the math (1.5x faster than two
    einsums here).
    """
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=~masked[:, None],
        scale=sm_scale, enable_gqa=True)
    return out.transpose(1, 2)

"""Batch-invariant verify attention: each query row's output is the same bits however many rows share the call.

The default reference (:func:`~reference.verify_attention.verify_attention_ref`) runs torch's fused CPU attention,
whose blocking (and so its rounding) depends on the number of query rows and on the batch: the logits of a token
differ by about 1e-7 between a 1-token decode step and an 8-token verify forward. With bf16 GEMM inputs that becomes a
bf16 ulp now and then and flips near-ties, so greedy speculative output can drift from greedy AR output. This variant
fixes the arithmetic of every row instead:

* Queries sit in tiles of ``QUERY_TILE`` rows aligned at absolute positions (position ``p`` is always row
  ``p % QUERY_TILE`` of tile ``p // QUERY_TILE``), keys in blocks of ``KEY_BLOCK`` aligned at position 0.
* Every GEMM has one fixed shape, ``[G * QUERY_TILE, D] x [D, KEY_BLOCK]`` for the scores of a (tile, block) pair and
  ``[G * QUERY_TILE, KEY_BLOCK] x [KEY_BLOCK, D]`` for its values (``G`` = query heads per KV head), on operands in
  one canonical layout: a row's products never depend on the other rows or on how many pairs the call has.
* Softmax is two-pass: the row maximum (exact in any order), ``exp``, then per-block sums of the probabilities and of
  the value products, accumulated over blocks by a sequential scan (``cumsum``). A key past a row's position gets
  probability exactly 0, so blocks after the row's last visible key add exact zeros and a decode step, a verify block
  and a prefill give the row the same bits.

A decoded token still fills a 4-row tile, and the op count is higher: at the shipped target's shapes the attention
costs about 2.5x the fused path's, a target forward about 1.3x (``perf/test_verify_attention_bench.py``,
``perf/test_target_forward_bench.py``). Opt in with ``load_model(..., batch_invariant=True)``. The GEMMs around it
must be row-invariant too (this CPU's bf16 GEMMs are; see README, *Exactness at T = 0*).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._paged_attention import SCORE_BUDGET, PagedRead, PlannedCall, request_groups

QUERY_TILE = 4
KEY_BLOCK = 64
SEGMENT_TILES = 8


@dataclass(frozen=True)
class TiledGroupPlan:
    """One group of ``n`` query segments (``SEGMENT_TILES`` tiles at most, one request's each) in ``nq`` query tiles
    and ``nb`` key blocks each.

    ``rows [n * nq * QUERY_TILE]``: the flat query row of every tile row (padding rows repeat a real one);
    ``real [k]``: the tile rows that are real queries, in flat-row order; ``out_rows [k]``: their rows in the output;
    ``cached``: the read of keys ``0 .. nb * KEY_BLOCK - 1``; ``bias [n, nq, nb, QUERY_TILE, KEY_BLOCK]``: 0 where a
    row may see a key, -inf elsewhere (padding rows see key 0, so no row is empty)."""

    n: int
    nq: int
    nb: int
    rows: torch.Tensor
    real: torch.Tensor
    out_rows: torch.Tensor
    cached: PagedRead
    bias: torch.Tensor


@dataclass(frozen=True)
class BatchInvariantPlan(PlannedCall):
    """The index work of one batch-invariant attention call (every layer of a forward shares it)."""

    groups: tuple[TiledGroupPlan, ...]


def _segments(cu: list[int], q_lens: list[int], kv_lens: list[int]) -> list[tuple[int, int, int, int]]:
    """Each request's queries cut at tile boundaries into segments of at most ``SEGMENT_TILES`` tiles:
    ``(request, first flat query row, query count, keys it may see)`` (a segment sees keys up to its last query)."""
    out = []
    for r, (row, q_len, kv) in enumerate(zip(cu, q_lens, kv_lens)):
        pos, end = kv - q_len, kv
        while pos < end:
            stop = min(end, (pos // QUERY_TILE + SEGMENT_TILES) * QUERY_TILE)
            out.append((r, row, stop - pos, stop))
            row, pos = row + stop - pos, stop
    return out


def plan_batch_invariant_attention(page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                   page_size: int, num_q_heads: int) -> BatchInvariantPlan:
    """Plan :func:`batch_invariant_attention` (arguments as :func:`~reference.verify_attention.verify_attention_ref`
    plus the cache's page size and the number of query heads).

    Long query runs (a prefill) are cut into segments of ``SEGMENT_TILES`` tiles, and segments are grouped so that
    a group's scores stay under ``SCORE_BUDGET / 32`` elements: the GEMM operands repeat every key block for every
    tile of a segment, up to ``D / QUERY_TILE`` times the scores' size. A row's bits do not depend on either cut."""
    dev = page_table.device
    cu = cu_seqlens_q.long().tolist()
    kv_lens = seq_lens.long().tolist()
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    total = cu[-1] if q_lens else 0
    segs = _segments(cu[:-1], q_lens, kv_lens)
    tiles = [(kv - 1) // QUERY_TILE - (kv - n) // QUERY_TILE + 1 for _, _, n, kv in segs]
    padded_kv = [-(-kv // KEY_BLOCK) * KEY_BLOCK for *_, kv in segs]
    groups = []
    for g in request_groups([t * QUERY_TILE for t in tiles], padded_kv, num_q_heads, SCORE_BUDGET // 32):
        part = segs[g]
        n, nq, nb = len(part), max(tiles[g]), max(padded_kv[g]) // KEY_BLOCK
        req, row0, q_len, kv = (torch.tensor(col, device=dev) for col in zip(*part))
        start = kv - q_len  # absolute position of each segment's first query
        pos = (start // QUERY_TILE * QUERY_TILE)[:, None] + torch.arange(nq * QUERY_TILE, device=dev)  # [n, nq * QT]
        offset = pos - start[:, None]
        real = (offset >= 0) & (offset < q_len[:, None])
        rows = row0[:, None] + offset.clamp(min=0).minimum(q_len[:, None] - 1)
        key = torch.arange(nb * KEY_BLOCK, device=dev)
        visible = (key <= pos[:, :, None]) & (key < kv[:, None, None])
        visible |= ~real[:, :, None] & (key == 0)
        bias = torch.zeros(visible.shape, device=dev).masked_fill_(~visible, float("-inf"))
        bias = bias.view(n, nq, QUERY_TILE, nb, KEY_BLOCK).transpose(2, 3).contiguous()
        keep = real.reshape(-1).nonzero().squeeze(1)
        rows = rows.reshape(-1)
        groups.append(TiledGroupPlan(n, nq, nb, rows, keep, rows[keep],
                                     PagedRead.of(page_table[req], kv, nb * KEY_BLOCK, page_size), bias))
    return BatchInvariantPlan(total, page_size, **BatchInvariantPlan.inputs(q_lens, kv_lens, page_table),
                              groups=tuple(groups))


def _tiled_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: TiledGroupPlan,
                 sm_scale: float) -> torch.Tensor:
    """Attention of one group's tile rows: ``[n * nq * QUERY_TILE, Hq, D]`` float32 (padding rows included).

    GEMM batches run over (KV head, segment, tile, key block); operands are contiguous ``[batch, rows, D]`` queries,
    ``[batch, KEY_BLOCK, D]`` keys (used transposed) and values, whatever the sizes (with one tile per segment the
    gathered keys and values are those operands already)."""
    n, nq, nb, qt, bk = g.n, g.nq, g.nb, QUERY_TILE, KEY_BLOCK
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    grp = hq // hkv
    rows = grp * qt
    tiles = (q.index_select(0, g.rows).float() * sm_scale).view(n, nq, qt, hkv, grp, d).permute(3, 0, 1, 4, 2, 5)
    q_op = tiles[:, :, :, None].expand(hkv, n, nq, nb, grp, qt, d).reshape(-1, rows, d).contiguous()

    def blocks(cache: torch.Tensor) -> torch.Tensor:  # [hkv * n * nq * nb, bk, d], contiguous
        kv = g.cached.gather_heads_first(cache).float().view(hkv, n, 1, nb, bk, d)
        return kv.expand(hkv, n, nq, nb, bk, d).reshape(-1, bk, d).contiguous()

    scores = torch.bmm(q_op, blocks(k_cache).transpose(1, 2)).view(hkv, n, nq, nb, grp, qt, bk)
    scores.add_(g.bias[None, :, :, :, None])
    probs = scores.sub_(scores.amax(dim=(3, 6), keepdim=True)).exp_()
    denom = probs.sum(-1).cumsum(3)[:, :, :, -1]  # [hkv, n, nq, grp, qt]: per-block sums, summed block by block
    out = torch.bmm(probs.view(-1, rows, bk), blocks(v_cache)).view(hkv, n, nq, nb, grp, qt, d).cumsum(3)[:, :, :, -1]
    out = out / denom[..., None]
    return out.permute(1, 2, 4, 0, 3, 5).reshape(n * nq * qt, hq, d)


def batch_invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              plan: BatchInvariantPlan, sm_scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged KV (the contract of
    :func:`~reference.verify_attention.verify_attention_ref`), with per-row arithmetic that depends only on the row's
    own query, keys and values. ``q [total_q, Hq, D]``; returns ``[total_q, Hq, D]`` in ``q.dtype`` (math in fp32)."""
    plan.check(q, k_cache)
    out = torch.empty_like(q)
    for g in plan.groups:
        tile_out = _tiled_group(q, k_cache, v_cache, g, sm_scale)
        out.index_copy_(0, g.out_rows, tile_out.index_select(0, g.real).to(out.dtype))
    return out

"""Triton building blocks of the sampling semantics shared by every op that samples a vocabulary row.

The semantics (documented in :mod:`dspark_kernels.ops.rejection_sample`, reference in
:mod:`dspark_kernels.reference._sampling`):

* a row is first turned into ``scaled = logits.float() / T`` in a float32 workspace row ``[V]`` (with its max and
  min), as the sequential head does for filtered rows;
* :func:`filter_row` then rewrites that workspace row in place into the filtered probabilities (top-k by bisection
  over sortable float keys, softmax, top-p by bisection over float bit patterns, renormalisation);
* :func:`cdf_scan_step` is one vocab tile of the inverse-CDF draw (smallest ``i`` with ``w[i] > 0`` and
  ``cumsum(w)[i] > u * sum(w)``, else the last positive index); :func:`inverse_cdf_row` draws from a stored row.
"""

from __future__ import annotations

import triton
import triton.language as tl

_ONE_BITS = tl.constexpr(0x3F800000)  # float32 bit pattern of 1.0, the largest exp(scaled - max)


@triton.jit
def _sortable_key(x):
    """Map float32 to int32 so that signed integer order equals float order (-0.0 maps to the key of +0.0)."""
    b = x.to(tl.int32, bitcast=True)
    key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _count_keys_ge(row_ptr, V, thr, BLOCK_V: tl.constexpr):
    """Number of entries of the float32 row whose sortable key is >= ``thr``."""
    offs = tl.arange(0, BLOCK_V)
    count = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < V, other=0.0)
        hit = (_sortable_key(x).to(tl.int64) >= thr) & (idx < V)
        count += tl.sum(hit.to(tl.int64), 0)
    return count


@triton.jit
def _sum_bits_ge(row_ptr, V, thr, BLOCK_V: tl.constexpr):
    """Sum of the non-negative float32 row's entries whose bit pattern is >= ``thr``."""
    offs = tl.arange(0, BLOCK_V)
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        e = tl.load(row_ptr + idx, mask=idx < V, other=0.0)
        total += tl.sum(tl.where(e.to(tl.int32, bitcast=True).to(tl.int64) >= thr, e, 0.0), 0)
    return total


@triton.jit
def _top_k_key(row_ptr, V, k, lo, hi, BLOCK_V: tl.constexpr):
    """Bisection for the largest key t with ``count(key >= t) >= k``, i.e. the key of the k-th largest entry.
    ``lo``/``hi`` are the keys of the row's min/max; about 32 counting passes."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        ok = _count_keys_ge(row_ptr, V, mid, BLOCK_V) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _top_p_bits(row_ptr, V, need, BLOCK_V: tl.constexpr):
    """Bisection over float bit patterns in ``[0, bits(1.0)]`` for the largest t with ``sum(e[e >= t]) >= need``."""
    lo = tl.zeros((), dtype=tl.int64)
    hi = lo + _ONE_BITS
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        ok = _sum_bits_ge(row_ptr, V, mid, BLOCK_V) >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def filter_row(ws_row, V, best, least, top_k_ptr, top_p_ptr, req,
               HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK_V: tl.constexpr):
    """Rewrite the float32 workspace row ``ws_row [V]`` from scaled logits (max ``best``, min ``least``) into the
    filtered probabilities of request ``req`` (``top_k[req]``: 0 = off; ``top_p[req]``: 1 = off).

    The row holds, in turn, ``e = exp(scaled - max)`` on the top-k set, then the final probabilities.
    """
    offs = tl.arange(0, BLOCK_V)
    keep_key = tl.full((), -2147483648, tl.int64)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + req).to(tl.int64)
        if (k > 0) & (k < V):
            keep_key = _top_k_key(ws_row, V, k, _sortable_key(least), _sortable_key(best), BLOCK_V)
    z = tl.zeros((), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        valid = idx < V
        x = tl.load(ws_row + idx, mask=valid, other=0.0)
        e = tl.where(valid & (_sortable_key(x).to(tl.int64) >= keep_key), tl.exp(x - best), 0.0)
        tl.store(ws_row + idx, e, mask=valid)
        z += tl.sum(e, 0)
    keep_bits = tl.zeros((), dtype=tl.int64)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + req).to(tl.float32)
        if p < 1.0:
            keep_bits = _top_p_bits(ws_row, V, p * z, BLOCK_V)
            z = _sum_bits_ge(ws_row, V, keep_bits, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        valid = idx < V
        e = tl.load(ws_row + idx, mask=valid, other=0.0)
        kept = e.to(tl.int32, bitcast=True).to(tl.int64) >= keep_bits
        tl.store(ws_row + idx, tl.where(kept, e, 0.0) / z, mask=valid)


@triton.jit
def cdf_scan_step(w, idx, valid, V, target, running, found, last):
    """One vocab tile ``w [BLOCK_V]`` (columns ``idx``) of an inverse-CDF scan against ``target = u * sum(w)``.

    Carries the running mass, the first hit ``found`` (``V`` while none, int64) and the last positive-weight index
    ``last`` (-1 while none); the draw is ``found`` if ``found < V`` else ``last``.
    """
    positive = valid & (w > 0.0)
    hit = positive & (running + tl.cumsum(w, 0) > target)
    found = tl.minimum(found, tl.min(tl.where(hit, idx, V), 0).to(tl.int64))
    last = tl.maximum(last, tl.max(tl.where(positive, idx, -1), 0).to(tl.int64))
    return running + tl.sum(w, 0), found, last


@triton.jit
def inverse_cdf_row(row_ptr, V, u, BLOCK_V: tl.constexpr):
    """Inverse-CDF draw (int64) from the non-negative float32 row ``row_ptr [V]`` with uniform ``u``: a pass for the
    total mass, then the tile-wise scan of :func:`cdf_scan_step`."""
    offs = tl.arange(0, BLOCK_V)
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        total += tl.sum(tl.load(row_ptr + idx, mask=idx < V, other=0.0), 0)
    target = u * total
    running = tl.zeros((), dtype=tl.float32)
    found = tl.zeros((), dtype=tl.int64) + V
    last = tl.zeros((), dtype=tl.int64) - 1
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        valid = idx < V
        w = tl.load(row_ptr + idx, mask=valid, other=0.0)
        running, found, last = cdf_scan_step(w, idx, valid, V, target, running, found, last)
    return tl.where(found < V, found, last)

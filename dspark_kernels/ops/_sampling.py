"""Triton building block of the inverse-CDF draw shared by every op that samples a vocabulary row.

The semantics are documented in :mod:`dspark_kernels.ops.rejection_sample` (reference in
:mod:`dspark_kernels.reference._sampling`): a draw with weights ``w`` and uniform ``u`` returns the smallest ``i`` with
``w[i] > 0`` and ``cumsum(w)[i] > u * sum(w)``, else the last positive index. The filters (temperature, top-k, top-p)
and the vocab-parallel row passes live in :mod:`.rejection_sample` and :mod:`._radix_select`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._radix_select import bits_key, ordered_key


@triton.jit
def kept_weights(x, m, keep_key, keep_bits):
    """``exp(x - m)`` of a row's scaled values ``x`` (row max ``m``) where they pass the row's top-k / top-p cuts
    (``keep_key`` on :func:`~._radix_select.ordered_key` of ``x``, ``keep_bits`` on the bits of ``e``; 0 = keep
    all), 0 elsewhere: the unnormalised filtered distribution."""
    e = tl.exp(x - m)
    return tl.where((ordered_key(x) >= keep_key) & (bits_key(e) >= keep_bits), e, 0.0)


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

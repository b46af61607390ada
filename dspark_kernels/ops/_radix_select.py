"""Triton building blocks of a radix select over the 32-bit keys of vocabulary rows, parallel over vocab chunks.

A select finds, per row, the largest threshold key ``t`` whose weight at or above it reaches a need: with weight 1
per entry and need ``k`` it is the key of the k-th largest entry (top-k); with the entries' probabilities as weights
and need ``top_p * mass`` it is the top-p cut. Keys are non-negative int64 below ``2**32`` (:func:`ordered_key` maps
float32 values onto them in order).

It descends ``LEVELS`` levels of ``DIGIT_BITS``-bit digits, most significant first. At level ``l`` every
(row, chunk) program histograms the weights of its chunk's entries whose key agrees with the level's prefix above
the digit, by digit, into a float32 ``[rows, chunks, BINS]`` buffer (:func:`chunk_histogram`); the next level's
programs reduce that buffer in a fixed order and choose the digit (:func:`select_digit`), so the result is
deterministic. Counts are exact in float32 below ``2**24`` entries per row.
"""

from __future__ import annotations

import triton
import triton.language as tl

DIGIT_BITS = tl.constexpr(4)
BINS = tl.constexpr(16)
LEVELS = 8  # 8 x 4 bits = the 32-bit key
_KEY_BITS = tl.constexpr(32)


@triton.jit
def ordered_key(x):
    """float32 -> int64 in ``[0, 2**32)`` whose order is the float order (-0.0 gets the key of +0.0)."""
    b = x.to(tl.int32, bitcast=True)
    signed = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    signed = tl.where(x == 0.0, 0, signed)
    return signed.to(tl.int64) + 2147483648


@triton.jit
def bits_key(e):
    """Non-negative float32 -> int64: its bit pattern, in the order of the values."""
    return e.to(tl.int32, bitcast=True).to(tl.int64)


@triton.jit
def _digit(keys, valid, prefix, level):
    """Level ``level``'s digit of each key, and whether the key is ``valid`` and agrees with ``prefix`` above it."""
    above = _KEY_BITS - DIGIT_BITS * level  # bits at and above this position are fixed by the prefix
    digit = (keys >> (above - DIGIT_BITS)) & (BINS - 1)
    return digit, valid & ((keys >> above) == (prefix >> above))


@triton.jit
def chunk_histogram(keys, weights, valid, prefix, level):
    """``[BINS]`` float32: the ``weights`` of the ``valid`` entries whose key agrees with ``prefix`` above level
    ``level``'s digit, summed by that digit. ``keys``/``weights``/``valid``: one vocab tile ``[BLOCK_V]``."""
    digit, hit = _digit(keys, valid, prefix, level)
    bins = tl.arange(0, BINS)
    return tl.sum(tl.where(hit[:, None] & (digit[:, None] == bins[None, :]), weights[:, None], 0.0), 0)


@triton.jit
def chunk_count(keys, valid, prefix, level):
    """:func:`chunk_histogram` with weight 1 per entry (the top-k select), through ``tl.histogram``: ``[BINS]``
    float32 counts."""
    digit, hit = _digit(keys, valid, prefix, level)
    return tl.histogram(digit.to(tl.int32), BINS, mask=hit).to(tl.float32)


@triton.jit
def select_digit(hist_row_ptr, n_chunks, prefix, above, need, level, CHUNKS_P2: tl.constexpr):
    """Close level ``level - 1``: reduce its histograms ``hist_row_ptr [n_chunks, BINS]`` (one row's) over the
    chunks and choose the largest digit ``d`` with ``above + weight(digit >= d) >= need`` (0 when none does).

    ``above`` is the weight of the entries whose key is above the prefix's range. Returns the prefix with ``d``
    set, the new ``above``, and the weight at or above the new prefix (the kept mass once the key is complete).
    """
    c = tl.arange(0, CHUNKS_P2)
    bins = tl.arange(0, BINS)
    h = tl.load(hist_row_ptr + c[:, None] * BINS + bins[None, :], mask=c[:, None] < n_chunks, other=0.0)
    b = tl.sum(h, 0)
    suffix = tl.sum(b, 0) - tl.cumsum(b, 0) + b  # weight of the digits >= d
    d = tl.max(tl.where(above + suffix >= need, bins, 0), 0)
    at_or_above = above + tl.sum(tl.where(bins == d, suffix, 0.0), 0)
    new_above = at_or_above - tl.sum(tl.where(bins == d, b, 0.0), 0)
    shift = _KEY_BITS - DIGIT_BITS * level
    return prefix | (d.to(tl.int64) << shift), new_above, at_or_above

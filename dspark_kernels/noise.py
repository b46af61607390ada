"""Counter-based, seedable noise for the stochastic ops.

Every stochastic op takes its randomness as tensors so that the Triton kernel and the PyTorch reference consume the
same numbers and agree bit for bit. This module makes those tensors reproducibly from per-request ``seeds`` and
``offsets`` (e.g. the decode step), with a stateless integer hash built from torch ops: no host sync, no generator
state, identical on CPU and CUDA, and safe to capture in a CUDA graph (seeds/offsets are tensors).

The hash is a 32-bit multiply-xorshift finaliser (in the style of murmur3's ``fmix32``) applied to
``seed`` (both 32-bit halves of it), ``offset``, ``stream`` and the element index; results are uniform on the
2^24-point grid of (0, 1).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, shape: tuple[int, ...], stream: int = 0) -> torch.Tensor:
    """Uniform(0, 1) noise, one independent block of ``shape`` per request.

    Args:
        seeds: ``[R]`` integer seeds, one per request.
        offsets: ``[R]`` integer counters (e.g. how many rounds the request has run), so each round differs.
        shape: per-request block shape, e.g. ``(gamma,)`` or ``(gamma + 1, V)``.
        stream: distinguishes independent uses within one round (accept uniforms vs sampling noise).
    Returns:
        float32 tensor ``[R, *shape]`` with values strictly inside (0, 1).
    """
    if seeds.shape != offsets.shape or seeds.dim() != 1:
        raise ValueError(
            f"seeds and offsets must be 1-D and equal in shape, got {tuple(seeds.shape)} and {tuple(offsets.shape)}"
        )
    n = 1
    for s in shape:
        n *= int(s)
    idx = torch.arange(n, device=seeds.device, dtype=torch.int64)
    seeds = seeds.to(torch.int64)[:, None]
    # all 64 bits of a seed count: the high word's mix is 0 for seeds below 2**32 (fmix32(0) = 0), so their streams
    # are those of the 32-bit hash, and s and s + 2**32 differ
    s = _fmix32(seeds ^ 0x9E3779B9) ^ _fmix32(seeds >> 32)
    h = _fmix32(s ^ (offsets.to(torch.int64)[:, None] * 0x27D4EB2F + stream * 0x165667B1))
    h = _fmix32(h ^ idx[None, :])
    h = _fmix32(h + idx[None, :] * 0x9E3779B1)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return u.reshape(seeds.shape[0], *shape)

"""Reference sampling filters and draw shared by every op that samples a vocabulary row (rejection sampling, the
sequential head): temperature, top-k and top-p keep masks, filtered probabilities, and the inverse-CDF draw.

The semantics are documented in :mod:`dspark_kernels.ops.rejection_sample`; the Triton twins live in
:mod:`dspark_kernels.ops._sampling`.
"""

from __future__ import annotations

import torch

__all__ = ["inverse_cdf_ref", "target_probs_ref", "top_k_keep", "top_p_keep"]


def top_k_keep(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``[rows, V]`` mask of tokens whose value is >= the row's k-th largest (k = 0 or k >= V keeps all)."""
    v = scaled.shape[1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    rows = ((top_k > 0) & (top_k < v)).nonzero().squeeze(1)
    if rows.numel():
        sub = scaled[rows]
        kth = sub.sort(dim=1, descending=True).values.gather(1, (top_k[rows] - 1)[:, None])
        keep[rows] = sub >= kth
    return keep


def top_p_keep(e: torch.Tensor, z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[rows, V]`` mask ``e >= t*`` with ``t*`` the largest ``t`` such that ``sum(e[e >= t]) >= top_p * z``."""
    keep = torch.ones_like(e, dtype=torch.bool)
    rows = (top_p < 1).nonzero().squeeze(1)
    if rows.numel():
        sub = e[rows]
        desc = sub.sort(dim=1, descending=True).values
        need = (top_p[rows] * z[rows])[:, None]
        first = (desc.cumsum(dim=1) < need).sum(dim=1, keepdim=True).clamp(max=e.shape[1] - 1)
        keep[rows] = sub >= desc.gather(1, first)
    return keep


def target_probs_ref(
    target_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Filtered target distributions ``[rows, V]`` float32 from logits ``[rows, V]`` and per-row parameters ``[rows]``.

    Rows with temperature 0 are computed at temperature 1 (their probabilities are unused: greedy rows use argmax).
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = target_logits.float() / t[:, None]
    keep = top_k_keep(scaled, top_k.long()) if top_k is not None else torch.ones_like(scaled, dtype=torch.bool)
    m = scaled.max(dim=1, keepdim=True).values
    e = torch.where(keep, torch.exp(scaled - m), torch.zeros_like(scaled))
    if top_p is not None:
        e = torch.where(top_p_keep(e, e.sum(dim=1), top_p.float()), e, torch.zeros_like(e))
    return e / e.sum(dim=1, keepdim=True)


def inverse_cdf_ref(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative weights ``w [rows, V]``: smallest ``i`` with ``w[i] > 0`` and
    ``cumsum(w)[i] > u * sum(w)``; if none (rounding), the last index with positive weight. Returns int64 ``[rows]``."""
    idx = torch.arange(w.shape[1], device=w.device)
    pos = w > 0
    hit = (w.cumsum(dim=1) > (u * w.sum(dim=1))[:, None]) & pos
    last = torch.where(pos, idx, -1).max(dim=1).values
    return torch.where(hit.any(dim=1), hit.int().argmax(dim=1), last)

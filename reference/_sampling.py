"""Reference sampling filters and draw shared by every op that samples a vocabulary row (rejection sampling, the
sequential head): temperature, top-k and top-p keep masks, filtered probabilities, and the inverse-CDF draw.

The semantics are documented in :mod:`dspark_kernels.ops.rejection_sample`; the Triton twins live in
:mod:`dspark_kernels.ops._sampling`. These functions are also the CPU execution path, so they skip the passes over
``[rows, V]`` that cannot change the result: a filter no row asks for, and the inverse-CDF fallback when every row has
a hit (the results are those of the full formulas, bit for bit; ``tests/test_sampling_ref.py`` checks it).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["argmax_rows", "first_true", "inverse_cdf_ref", "target_probs_ref", "top_k_filters", "top_k_keep",
           "top_p_filters", "top_p_keep"]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [rows, V]`` -> ``[rows]`` int64 on the same device: each row's lowest-index maximum, exactly
    ``logits.argmax(dim=1)`` (a NaN counts as the maximum, the first one wins, as in torch).

    A float32 CPU tensor takes numpy's argmax, which follows the same rules: torch's CPU argmax costs about 12 us per
    8192-wide row with one thread, numpy's about 0.5 us, so a verify round's argmax over 8 rows fell from about 50 to 5
    us (the greedy decode step's and the greedy verify's hot spot). Other dtypes and devices use torch's."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=1)
    return torch.from_numpy(logits.detach().numpy().argmax(axis=1).astype(np.int64, copy=False))


def top_k_filters(top_k: torch.Tensor, v: int) -> torch.Tensor:
    """``[rows]`` bool: the rows whose top-k drops tokens of a ``V``-token row (k = 0 or k >= V keeps all)."""
    return (top_k > 0) & (top_k < v)


def top_p_filters(top_p: torch.Tensor) -> torch.Tensor:
    """``[rows]`` bool: the rows whose top-p may drop tokens (p = 1 keeps all)."""
    return top_p < 1


def top_k_keep(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor | None:
    """``[rows, V]`` mask of tokens whose value is >= the row's k-th largest (k = 0 or k >= V keeps all); ``None``
    when no row filters (every row keeps all)."""
    rows = top_k_filters(top_k, scaled.shape[1]).nonzero().squeeze(1)
    if not rows.numel():
        return None
    keep = torch.ones_like(scaled, dtype=torch.bool)
    sub = scaled[rows]
    kth = sub.sort(dim=1, descending=True).values.gather(1, (top_k[rows] - 1)[:, None])
    keep[rows] = sub >= kth
    return keep


def top_p_keep(e: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """``[rows, V]`` mask ``e >= t*`` with ``t*`` the largest ``t`` such that ``sum(e[e >= t]) >= top_p * sum(e)``
    (per row); ``None`` when no row has ``top_p < 1`` (every row keeps all)."""
    rows = top_p_filters(top_p).nonzero().squeeze(1)
    if not rows.numel():
        return None
    keep = torch.ones_like(e, dtype=torch.bool)
    sub = e[rows]
    desc = sub.sort(dim=1, descending=True).values
    need = (top_p[rows] * sub.sum(dim=1))[:, None]
    first = (desc.cumsum(dim=1) < need).sum(dim=1, keepdim=True).clamp(max=e.shape[1] - 1)
    keep[rows] = sub >= desc.gather(1, first)
    return keep


def target_probs_ref(
    target_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Filtered target distributions ``[rows, V]`` float32 from logits ``[rows, V]`` and per-row parameters ``[rows]``.

    Rows with temperature 0 are computed at temperature 1 (their probabilities are unused: greedy rows use argmax).
    The steps: ``scaled = logits / t``; ``e = exp(scaled - max(scaled))``, zero outside the top-k keep mask; zero
    outside the top-p keep mask of ``e``; ``e / sum(e)``. (``target_logits`` is not modified.)
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = target_logits.float() / t[:, None]  # a new tensor: the steps below work in place on it
    keep = top_k_keep(scaled, top_k.long()) if top_k is not None else None
    m = scaled.amax(dim=1, keepdim=True)  # the values of max(dim=1), without its slow index pass on a CPU
    e = scaled.sub_(m).exp_()
    if keep is not None:
        e = e.masked_fill_(~keep, 0.0)
    keep = top_p_keep(e, top_p.float()) if top_p is not None else None
    if keep is not None:
        e = e.masked_fill_(~keep, 0.0)
    return e.div_(e.sum(dim=1, keepdim=True))


def first_true(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask [rows, V]`` bool -> (``[rows]`` bool: whether the row holds a True, ``[rows]`` int64: the index of its
    first True, 0 when none), exactly ``mask.max(dim=1)``. On a CPU through numpy's argmax, which stops at the first
    True (torch's bool max over 8 rows of 8192 costs about 24 us here, numpy's 2)."""
    if mask.device.type != "cpu":
        return mask.max(dim=1)
    m = mask.numpy()
    first = m.argmax(axis=1)
    return torch.from_numpy(m[np.arange(m.shape[0]), first]), torch.from_numpy(first.astype(np.int64, copy=False))


def inverse_cdf_ref(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative weights ``w [rows, V]``: smallest ``i`` with ``w[i] > 0`` and
    ``cumsum(w)[i] > u * sum(w)``; if none (rounding), the last index with positive weight. Returns int64 ``[rows]``."""
    pos = w > 0
    hit = (w.cumsum(dim=1) > (u * w.sum(dim=1))[:, None]).logical_and_(pos)
    found, first = first_true(hit)
    if bool(found.all()):
        return first
    idx = torch.arange(w.shape[1], device=w.device)
    last = torch.where(pos, idx, -1).max(dim=1).values
    return torch.where(found, first, last)

"""Per-request sampling parameters of a batch and the next token of each row of logits, shared by plain generation
(:func:`dspark_kernels.models.generate`) and the speculative loops (:mod:`dspark_kernels.engine`).

* :func:`check_sampling`: one request's temperature / top-k / top-p, or a clear error (:func:`as_int` and
  :func:`as_real` convert without rounding a float into an int or taking a bool for a number);
* :class:`Sampling`: the parameters, seeds and noise offsets of ``R`` requests as device tensors ``[R]``;
* :class:`PromptSampling`: the parameters and seeds of a decode call's prompts (scalars or one per prompt, checked),
  from which each step's :class:`Sampling` of the live prompts is made;
* :func:`next_tokens`: one token per logits row with no drafts (a prefill's, a plain decode step's): the lowest-index
  argmax when every request is greedy, else :func:`~dspark_kernels.ops.rejection_sample` with zero drafts and the
  requests' counter-based noise, so a request's draw at step ``t`` depends only on its seed and ``t``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .ops import rejection_sample
from .ops.rejection_sample import rejection_noise
from .reference._sampling import argmax_rows

__all__ = ["PromptSampling", "Sampling", "as_int", "as_real", "check_sampling", "next_tokens", "per_request"]


INT32_MAX = 2**31 - 1


def as_int(name: str, value: object, low: int = 0, high: int = 2**63 - 1) -> int:
    """``value`` as an int in ``[low, high]``: an integer (Python or numpy, not a bool), never a float rounded off."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not low <= int(value) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {int(value)}")
    return int(value)


def as_real(name: str, value: object) -> float:
    """``value`` as a float: a real number (Python or numpy, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """``ValueError`` unless ``temperature`` is finite and ``>= 0``, ``0 <= top_k <= 2**31 - 1`` and
    ``0 < top_p <= 1``; ``TypeError`` for a bool, a non-number or a fractional ``top_k``."""
    temperature, top_p = as_real("temperature", temperature), as_real("top_p", top_p)
    as_int("top_k", top_k, 0, INT32_MAX)
    if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1):
        raise ValueError(f"need a finite temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {temperature}, {top_k}, "
                         f"{top_p}")
    if temperature > 0 and float(np.float32(temperature)) == 0:
        raise ValueError(f"temperature {temperature} rounds to 0 in float32 (it would decode greedily); use 0 for "
                         f"greedy or a temperature >= 1.4e-45")


@dataclass
class Sampling:
    """Sampling parameters of the R requests of one round: ``temperature``/``top_p [R]`` float32, ``top_k [R]``
    int32, ``seed``/``offset [R]`` int64 (offset = the request's round counter), on the target's device.
    ``greedy``: every request has temperature 0 (no uniforms and no draft probabilities needed)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor
    greedy: bool

    @classmethod
    def of(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float], seed: Sequence[int],
           offset: Sequence[int], device: torch.device) -> Sampling:
        return cls(torch.tensor(temperature, dtype=torch.float32, device=device),
                   torch.tensor(top_k, dtype=torch.int32, device=device),
                   torch.tensor(top_p, dtype=torch.float32, device=device),
                   torch.tensor(seed, dtype=torch.int64, device=device),
                   torch.tensor(offset, dtype=torch.int64, device=device),
                   all(t == 0 for t in temperature))


def per_request(name: str, value, n: int, cast) -> list:
    """``value`` as a list of ``n`` entries converted by ``cast(name, entry)`` (:func:`as_int`, :func:`as_real`):
    a scalar repeated, or one entry per prompt (checked)."""
    if isinstance(value, torch.Tensor):  # a 0-d or 1-d tensor of values, read on the host
        if value.dim() > 1:
            raise ValueError(f"{name} must be a scalar or one value per prompt, got a tensor of shape "
                             f"{tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, numbers.Number):
        return [cast(name, value)] * n
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a number or one number per prompt, got {type(value).__name__}")
    vals = [cast(name, v) for v in value]
    if len(vals) != n:
        raise ValueError(f"{name} must be a scalar or have one entry per prompt ({n}), got {len(vals)}")
    return vals


class PromptSampling:
    """Sampling parameters of the ``n`` prompts of one decode call: ``temperature``, ``top_k``, ``top_p`` and
    ``seeds``, each a scalar or one value per prompt (checked by :func:`check_sampling`); ``seeds=None`` draws them
    from torch's global RNG. ``greedy``: every prompt has temperature 0."""

    def __init__(self, temperature: float | Sequence[float], top_k: int | Sequence[int], top_p: float | Sequence[float],
                 seeds: Sequence[int] | None, n: int) -> None:
        self.temperature = per_request("temperature", temperature, n, as_real)
        self.top_k = per_request("top_k", top_k, n, as_int)
        self.top_p = per_request("top_p", top_p, n, as_real)
        for t, k, p in zip(self.temperature, self.top_k, self.top_p):
            check_sampling(t, k, p)
        self.seeds = torch.randint(0, INT32_MAX, (n,)).tolist() if seeds is None else per_request("seeds", seeds, n,
                                                                                                   as_int)
        self.greedy = all(t == 0 for t in self.temperature)

    def of(self, prompts: Sequence[int], offsets: Sequence[int], device: torch.device) -> Sampling:
        """The :class:`Sampling` of the prompts with these indices, with their noise ``offsets``."""
        return Sampling.of([self.temperature[i] for i in prompts], [self.top_k[i] for i in prompts],
                           [self.top_p[i] for i in prompts], [self.seeds[i] for i in prompts], offsets, device)


def next_tokens(logits: torch.Tensor, sampling: Sampling, impl: str | None = None) -> list[int]:
    """One token per row of ``logits [R, V]`` with no drafts to verify (a prefill's or a plain step's): the
    lowest-index argmax when every request is greedy, else :func:`rejection_sample` with zero drafts and the
    requests' noise of round ``sampling.offset``."""
    if sampling.greedy:
        return argmax_rows(logits).tolist()
    dev, r = logits.device, logits.shape[0]
    zero_cu = torch.zeros(r + 1, dtype=torch.int32, device=dev)
    acc_u, smp_u = rejection_noise(sampling.seed, sampling.offset, zero_cu, 0, max_spec_len=0)
    res = rejection_sample(torch.zeros(0, dtype=torch.int64, device=dev), zero_cu, None, logits, sampling.temperature,
                           sampling.top_k, sampling.top_p, acc_u, smp_u, max_spec_len=0, impl=impl,
                           check_inputs=False)
    return res.output_token_ids[:, 0].tolist()

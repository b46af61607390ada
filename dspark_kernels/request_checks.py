"""Checks of what a decode call is asked to do, shared by plain generation (:func:`dspark_kernels.models.generate`),
the speculative loop and the batched engine (:mod:`dspark_kernels.engine`): prompts, stop tokens and the logits each
step samples from. Every failure names the argument and what was expected.

* :func:`check_decode_args`: ``max_new_tokens`` and the KV-cache page size;
* :func:`check_prompts`: copies of the prompts as lists of token ids, each non-empty, every id an int in
  ``[0, vocab_size)``, and prompt + new tokens within the model's positions;
* :func:`stop_tokens`: an EOS argument (``None``, one id or several) as a set of ids in the vocabulary;
* :func:`check_requests`: both of them against a model's config;
* :func:`check_step_logits`: the rows a step samples from have a finite maximum (a NaN or +inf logit, or a row of
  -inf, would otherwise become a token silently).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .models.config import ModelConfig
from .ops._validate import is_int
from .sampling import as_int

__all__ = ["check_decode_args", "check_prompts", "check_requests", "check_step_logits", "stop_tokens"]


def _token_id(name: str, t: object, vocab_size: int) -> int:
    value = as_int(name, t, -2**63)
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be a token id in [0, {vocab_size}), got {value}")
    return value


def check_model(model: object, name: str) -> None:
    """``model`` must be a loaded target (:func:`dspark_kernels.models.load_model`), not a path or name."""
    from .models.transformer import CausalLM

    if not isinstance(model, CausalLM):
        raise TypeError(f"{name} must be a loaded model (dspark_kernels.models.load_model(...)), got "
                        f"{type(model).__name__}")


def check_decode_args(max_new_tokens: object, page_size: object) -> None:
    """A decode call's ``max_new_tokens`` (an int >= 0, not a bool) and KV-cache ``page_size`` (an int >= 1)."""
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")


UNSET_MAX_POSITIONS = 131072


def check_requests(config: ModelConfig, prompts: Iterable[Sequence[int]], max_new_tokens: int,
                   eos_token_id: object) -> tuple[list[list[int]], frozenset[int]]:
    """:func:`check_prompts` and :func:`stop_tokens` against a model's config (its vocabulary and positions). A config
    without ``max_position_embeddings`` is bounded at :data:`UNSET_MAX_POSITIONS` positions per request, so a huge
    ``max_new_tokens`` is refused before the decode loops allocate its KV cache up front."""
    return (check_prompts(prompts, config.vocab_size, max_new_tokens, config.max_position_embeddings),
            stop_tokens(eos_token_id, config.vocab_size))


def check_prompts(prompts: Iterable[Sequence[int]], vocab_size: int, max_new_tokens: int,
                  max_positions: int | None) -> list[list[int]]:
    """Copies of ``prompts`` as lists of ints (the caller's lists are not touched). Each prompt is a non-empty
    sequence of int token ids in ``[0, vocab_size)`` (not strings, floats or bools), and ``len(prompt) +
    max_new_tokens`` fits ``max_positions`` (the model's ``max_position_embeddings``; ``None``: no limit)."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Iterable):
            raise TypeError(f"prompt {i} must be a sequence of int token ids, got {type(p).__name__}")
        ids = [_token_id(f"prompt {i} token {j}", t, vocab_size) for j, t in enumerate(p)]
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt must hold at least one token")
        if max_positions is not None and len(ids) + max_new_tokens > max_positions:
            raise ValueError(f"prompt {i} ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"max_position_embeddings ({max_positions})")
        if max_positions is None and len(ids) + max_new_tokens > UNSET_MAX_POSITIONS:
            raise ValueError(f"prompt {i} ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"{UNSET_MAX_POSITIONS} positions, the bound for a model whose config sets no "
                             f"max_position_embeddings (its KV cache is allocated up front)")
        out.append(ids)
    return out


def stop_tokens(eos_token_id: object, vocab_size: int) -> frozenset[int]:
    """``eos_token_id`` (``None``, one int id, or an iterable of them, e.g. a config's ``eos_token_ids``) as the set
    of ids that end a request; each must be in ``[0, vocab_size)``."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, numbers.Integral) and not isinstance(eos_token_id, bool):
        return frozenset([_token_id("eos_token_id", eos_token_id, vocab_size)])
    if isinstance(eos_token_id, (str, bytes, bool)) or not isinstance(eos_token_id, Iterable):
        raise TypeError(f"eos_token_id must be None, an int token id or a collection of them, got {eos_token_id!r}")
    return frozenset(_token_id("eos_token_id entry", t, vocab_size) for t in eos_token_id)


def check_step_logits(logits: torch.Tensor, request_ids: Sequence, rows_per_request: Sequence[int] | None = None,
                      temperature: torch.Tensor | None = None) -> None:
    """Raise unless every row of ``logits [rows, V]`` has a finite maximum: one NaN or +inf logit, or a row of -inf,
    means the model's forward broke (its weights or its inputs), and a token drawn from it would be meaningless.
    -inf entries beside a finite maximum (masked tokens) are allowed. Rows belong to ``request_ids`` in order, one
    each or ``rows_per_request[r]`` each (a verify forward); the error names the request. One reduction over the
    rows, read on the host like the tokens each step reads anyway (through numpy for float32 CPU rows: 5-9 us per
    step against torch's 11-19 us at 1-16 rows of 8192).

    ``temperature [R]`` (float32, one per request; 0 = greedy): also raise ``ValueError`` where a sampled row's
    largest ``|logit|`` divided by its temperature overflows float32, the sampling ops' first step (their own check of
    it is off in the decode loops): a tiny positive temperature would otherwise draw from NaN probabilities."""
    cpu32 = logits.device.type == "cpu" and logits.dtype == torch.float32
    if cpu32:
        peak = logits.detach().numpy().max(axis=1, initial=-np.inf)
        ok = bool(np.isfinite(peak).all())
    else:
        peak_t = logits.detach().amax(dim=1)
        ok = bool(torch.isfinite(peak_t).all())
        peak = peak_t.float().cpu().numpy()
    owners = None
    if not ok:
        row = int(np.flatnonzero(~np.isfinite(peak))[0])
        owners = [rid for rid, n in zip(request_ids, rows_per_request or [1] * len(request_ids)) for _ in range(n)]
        raise FloatingPointError(f"the logits of request {owners[row]} are not finite (row maximum "
                                 f"{float(peak[row])}): the model produced NaN or Inf; check its weights and inputs")
    if temperature is None:
        return
    t = np.repeat(temperature.detach().float().cpu().numpy(), rows_per_request or 1)
    if not (t > 0).any():
        return
    low = logits.detach().numpy().min(axis=1) if cpu32 else logits.detach().amin(dim=1).float().cpu().numpy()
    scale = np.maximum(peak, -low).astype(np.float32)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        bad = (t > 0) & ~np.isfinite(scale / np.where(t > 0, t, 1).astype(np.float32))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        owners = [rid for rid, n in zip(request_ids, rows_per_request or [1] * len(request_ids)) for _ in range(n)]
        raise ValueError(f"temperature {float(t[row]):.3g} of request {owners[row]} is too small for its logits "
                         f"(largest |logit| {float(scale[row]):.3g}): logits / temperature overflows float32; use a "
                         f"larger temperature, or 0 for greedy")

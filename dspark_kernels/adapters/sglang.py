"""A dense block-drafter layout for confidence-scheduled verification, as SGLang-style DSpark workers keep it.

Such a worker keeps every request's draft block dense: ``draft_tokens [bs, gamma]`` and confidences ``[bs, gamma]``,
turns them into one verify length per request and builds the ragged verify window from those. Upstream SGLang has no
DSpark scheduler; a public fork's ``schedule_verify_lens_topk`` takes survival probabilities, counts the anchor in
its lengths and spends its budget beyond a minimum length. These adapters take confidence LOGITS (calibrated here by
the per-position temperatures and biases), count DRAFTS in the lengths (the anchor is always verified, so add 1 for a
length that counts it), and spend ``budget`` on the draft slots beyond ``min_verify_len`` (which every request
verifies) up to ``max_len``. They run our ragged ops (:mod:`dspark_kernels.ops.survival`) on the dense layout with
offsets ``arange(bs + 1) * width`` (no host sync when ``check_inputs=False`` and ``budget`` is a ``[1]`` device
tensor; an int budget is copied to the device each call, which a CUDA graph would freeze), and
:func:`pack_verified_drafts` packs the admitted drafts into the flattened ``[N]`` + ``cu_num_draft_tokens [bs + 1]``
layout that verification takes.
"""

from __future__ import annotations

import torch

from ..ops import prefix_survival, select_verify_lengths_alg1, select_verify_lengths_topk
from ..ops._validate import INDEX_DTYPES, check_range, check_shape, check_tensor, is_int


def _dense_offsets(conf: torch.Tensor) -> torch.Tensor:
    """Offsets ``[bs + 1]`` int32 of dense rows ``[bs, width]`` flattened: ``arange(bs + 1) * width``."""
    if conf.dim() != 2:
        raise ValueError(f"confidence_logits must be [bs, gamma], got shape {tuple(conf.shape)}")
    bs, gamma = conf.shape
    return torch.arange(bs + 1, dtype=torch.int32, device=conf.device) * gamma


def _window(gamma: int, min_verify_len: int, max_len: int | None) -> int:
    """``max_len`` (default gamma) after checking ``0 <= min_verify_len <= max_len <= gamma``."""
    hi = gamma if max_len is None else max_len
    if not (is_int(min_verify_len) and is_int(hi) and 0 <= min_verify_len <= hi <= gamma):
        raise ValueError(f"need ints 0 <= min_verify_len <= max_len <= gamma ({gamma}), got {min_verify_len}, "
                         f"{max_len}")
    return hi


def schedule_verify_lens_topk(
    confidence_logits: torch.Tensor,
    budget: int | torch.Tensor,
    min_verify_len: int = 0,
    max_len: int | None = None,
    position_temperatures: torch.Tensor | None = None,
    position_biases: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Verify lengths ``[bs]`` int32 (drafts, not counting the anchor) from dense confidence logits ``[bs, gamma]``.

    Every request verifies its first ``min_verify_len`` drafts; ``budget`` more draft slots go to the global top
    slots by calibrated prefix survival among positions ``min_verify_len .. max_len - 1`` (``max_len`` defaults to
    gamma; ties: lower position, then lower request). The total is ``bs * min_verify_len + min(budget, slots)``:
    the budget is never exceeded. ``budget`` may be a ``[1]`` device tensor."""
    cu = _dense_offsets(confidence_logits)
    bs, gamma = confidence_logits.shape
    hi = _window(gamma, min_verify_len, max_len)
    a = prefix_survival(confidence_logits.reshape(-1), cu, position_temperatures, position_biases, impl=impl,
                        check_inputs=check_inputs)
    window = a.view(bs, gamma)[:, min_verify_len:hi]  # the slots the budget may admit, each request's in order
    extra = select_verify_lengths_topk(window.reshape(-1), _dense_offsets(window), budget, impl=impl,
                                       check_inputs=check_inputs)
    return extra + min_verify_len


def schedule_verify_lens_alg1(
    confidence_logits: torch.Tensor,
    sps_table: torch.Tensor,
    position_temperatures: torch.Tensor | None = None,
    position_biases: torch.Tensor | None = None,
    *,
    lookahead: int = 1,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Verify lengths ``[bs]`` int32 by DSpark Algorithm 1 against the engine's SPS table ``[Bmax + 1]`` (steps/s at
    a verify batch of B tokens), from dense confidence logits ``[bs, gamma]``. ``lookahead > 1``: the step-aware
    stop (``select_verify_lengths_alg1``), for a table with steps (``bs * gamma`` crosses them all); where the
    table's step time is convex from B = bs on (``engine.policies.step_time_convex``, checked once per table) lookahead
    1 gives the same lengths with one outlook term a candidate."""
    cu = _dense_offsets(confidence_logits)
    a = prefix_survival(confidence_logits.reshape(-1), cu, position_temperatures, position_biases, impl=impl,
                        check_inputs=check_inputs)
    return select_verify_lengths_alg1(a, cu, sps_table, lookahead=lookahead, impl=impl, check_inputs=check_inputs)


def pack_verified_drafts(
    draft_tokens: torch.Tensor, verify_lens: torch.Tensor, draft_probs: torch.Tensor | None = None, *,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dense drafts ``[bs, gamma]`` (and probs ``[bs, gamma, V]``) -> the first ``verify_lens[b]`` of each request,
    flattened: ``(draft_token_ids [N], cu_num_draft_tokens [bs + 1] int32, draft_probs [N, V] | None)``.

    N is data-dependent, so the gather is this step's one host synchronisation (an engine fixes N by bucketing its
    verify batch); ``check_inputs`` (default) checks shapes, integer lengths in ``0..gamma`` and devices first.
    """
    if check_inputs:
        check_tensor("draft_tokens", draft_tokens, ndim=2, dtypes=INDEX_DTYPES)
        bs, gamma = draft_tokens.shape
        check_tensor("verify_lens", verify_lens, ndim=1, dtypes=INDEX_DTYPES, device=draft_tokens.device)
        check_shape("verify_lens", verify_lens, (bs,))
        check_range("verify_lens", verify_lens, (verify_lens >= 0) & (verify_lens <= gamma), f"in 0..gamma = {gamma}")
        if draft_probs is not None:
            check_tensor("draft_probs", draft_probs, ndim=3, dtypes=(torch.float32,), device=draft_tokens.device)
            check_shape("draft_probs", draft_probs, (bs, gamma, None))
    gamma = draft_tokens.shape[1]
    lens = verify_lens.to(torch.int64)
    keep = torch.arange(gamma, device=draft_tokens.device)[None, :] < lens[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=lens.device), lens.cumsum(0)]).to(torch.int32)
    probs = None if draft_probs is None else draft_probs[keep]
    return draft_tokens[keep], cu, probs

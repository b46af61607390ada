"""SGLang's block-drafter layout for confidence-scheduled verification (its DSpark scheduler and verify window).

SGLang's DSpark worker keeps every request's draft block dense: ``draft_tokens [bs, gamma]``, confidences
``[bs, gamma]``, and its ``schedule_verify_lens_topk`` turns cumulative confidences into one verify length per
request, clamped to ``[min_verify_len, max_len]``, before building the ragged verify window. These adapters take that
dense layout, run our ragged ops (:mod:`dspark_kernels.ops.survival`) on it with offsets ``arange(bs + 1) * gamma``
(no host sync), and pack the admitted drafts into the flattened ``[N]`` + ``cu_num_draft_tokens [bs + 1]`` layout
that verification takes.
"""

from __future__ import annotations

import torch

from ..ops import prefix_survival, select_verify_lengths_alg1, select_verify_lengths_topk


def _dense_offsets(conf: torch.Tensor) -> torch.Tensor:
    if conf.dim() != 2:
        raise ValueError(f"confidence_logits must be [bs, gamma], got shape {tuple(conf.shape)}")
    bs, gamma = conf.shape
    return torch.arange(bs + 1, dtype=torch.int32, device=conf.device) * gamma


def _clamp(lens: torch.Tensor, gamma: int, min_verify_len: int, max_len: int | None) -> torch.Tensor:
    hi = gamma if max_len is None else max_len
    if not 0 <= min_verify_len <= hi <= gamma:
        raise ValueError(f"need 0 <= min_verify_len <= max_len <= gamma ({gamma}), got {min_verify_len}, {max_len}")
    return lens.clamp(min_verify_len, hi)


def schedule_verify_lens_topk(
    confidence_logits: torch.Tensor,
    budget: int | torch.Tensor,
    min_verify_len: int = 0,
    max_len: int | None = None,
    position_temperatures: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Verify lengths ``[bs]`` int32 from dense confidence logits ``[bs, gamma]``: the global top-``budget`` draft
    slots by calibrated prefix survival (ties: lower position, then lower request), then clamped to
    ``[min_verify_len, max_len]`` (``max_len`` defaults to gamma). ``budget`` may be a ``[1]`` device tensor."""
    cu = _dense_offsets(confidence_logits)
    a = prefix_survival(confidence_logits.reshape(-1), cu, position_temperatures, impl=impl,
                        check_inputs=check_inputs)
    lens = select_verify_lengths_topk(a, cu, budget, impl=impl, check_inputs=check_inputs)
    return _clamp(lens, confidence_logits.shape[1], min_verify_len, max_len)


def schedule_verify_lens_alg1(
    confidence_logits: torch.Tensor,
    sps_table: torch.Tensor,
    position_temperatures: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Verify lengths ``[bs]`` int32 by DSpark Algorithm 1 against the engine's SPS table ``[Bmax + 1]`` (steps/s at
    a verify batch of B tokens), from dense confidence logits ``[bs, gamma]``."""
    cu = _dense_offsets(confidence_logits)
    a = prefix_survival(confidence_logits.reshape(-1), cu, position_temperatures, impl=impl,
                        check_inputs=check_inputs)
    return select_verify_lengths_alg1(a, cu, sps_table, impl=impl, check_inputs=check_inputs)


def pack_verified_drafts(
    draft_tokens: torch.Tensor, verify_lens: torch.Tensor, draft_probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dense drafts ``[bs, gamma]`` (and probs ``[bs, gamma, V]``) -> the first ``verify_lens[b]`` of each request,
    flattened: ``(draft_token_ids [N], cu_num_draft_tokens [bs + 1] int32, draft_probs [N, V] | None)``.

    N is data-dependent (the one size an engine fixes by bucketing its verify batch); everything else stays on the
    device.
    """
    if draft_tokens.dim() != 2 or verify_lens.shape != draft_tokens.shape[:1]:
        raise ValueError(f"need draft_tokens [bs, gamma] and verify_lens [bs], got {tuple(draft_tokens.shape)} and "
                         f"{tuple(verify_lens.shape)}")
    gamma = draft_tokens.shape[1]
    lens = verify_lens.to(torch.int64)
    keep = torch.arange(gamma, device=draft_tokens.device)[None, :] < lens[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=lens.device), lens.cumsum(0)]).to(torch.int32)
    probs = None if draft_probs is None else draft_probs[keep]
    return draft_tokens[keep], cu, probs

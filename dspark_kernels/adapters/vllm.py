"""vLLM v1 layout for lossless verification: what ``RejectionSampler`` receives from the GPU model runner.

vLLM's ``SpecDecodeMetadata`` (B requests, N drafts in all, S = ``max_spec_len``):
    draft_token_ids      [N] int32          drafts of every request, flattened in request order
    cu_num_draft_tokens  [B] int32          INCLUSIVE cumulative draft counts (no leading zero): request b owns
                                            ``draft_token_ids[cu[b-1]:cu[b]]`` (``cu[-1] = N``)
    logits_indices       [N + B]            per request, its draft positions then its bonus position; the runner's
                                            ``logits = lm_head(hidden[logits_indices])`` is ``[N + B, V]`` in this order
Our :func:`dspark_kernels.ops.rejection_sample` uses the same ragged order with offsets ``[B + 1]`` (leading zero)
and samples the bonus token itself from the bonus rows, so the adapter only converts the offsets, makes the uniforms
from per-request ``seeds``/``offsets`` tensors and returns vLLM's int32 output with ``-1`` placeholders.
"""

from __future__ import annotations

import torch

from ..ops import rejection_sample
from ..ops.rejection_sample import rejection_noise

PLACEHOLDER_TOKEN_ID = -1


def offsets_from_vllm_cu(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's inclusive ``cu_num_draft_tokens [B]`` -> our offsets ``[B + 1]`` int32 (a zero prepended, same device)."""
    if cu_num_draft_tokens.dim() != 1:
        raise ValueError(f"cu_num_draft_tokens must be 1-D [B], got shape {tuple(cu_num_draft_tokens.shape)}")
    zero = torch.zeros(1, dtype=torch.int32, device=cu_num_draft_tokens.device)
    return torch.cat([zero, cu_num_draft_tokens.to(torch.int32)])


def rejection_sample_vllm(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    impl: str | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify vLLM-layout drafts; returns ``(output_token_ids [B, S + 1] int32, num_accepted [B] int32)``.

    Args:
        draft_token_ids: ``[N]`` drafts, flattened in request order.
        cu_num_draft_tokens: ``[B]`` vLLM's inclusive cumulative draft counts.
        max_spec_len: S, the longest draft of the batch (a Python int from the scheduler, as in vLLM).
        draft_probs: ``[N, V]`` float32 drafter distributions, or None for deterministic drafts (n-gram, greedy).
        logits: ``[N + B, V]`` target logits gathered at vLLM's ``logits_indices`` (drafts then bonus per request).
        temperature, top_k, top_p: ``[B]`` per-request sampling parameters (temperature 0 = greedy).
        seeds, offsets: ``[B]`` int64 per-request seed and step counter; the uniforms are derived from them on the
            device (:func:`dspark_kernels.ops.rejection_sample.rejection_noise`), so no generator state is involved.
    Output rows hold the accepted drafts, then the correction or bonus token, then ``-1``, as vLLM's sampler returns.
    """
    cu = offsets_from_vllm_cu(cu_num_draft_tokens)
    # uniforms are always made (greedy rows ignore them), so the call has no data-dependent branch
    accept_u, sample_u = rejection_noise(seeds, offsets, cu, draft_token_ids.shape[0], max_spec_len=max_spec_len)
    res = rejection_sample(draft_token_ids, cu, draft_probs, logits, temperature, top_k, top_p, accept_u, sample_u,
                           max_spec_len=max_spec_len, impl=impl, check_inputs=check_inputs)
    return res.output_token_ids.to(torch.int32), res.num_accepted

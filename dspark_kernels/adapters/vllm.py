"""vLLM v1 layout for lossless verification: the tensors vLLM's GPU model runner builds for a speculative step.

vLLM's ``SpecDecodeMetadata`` (B requests, N drafts in all, S = ``max_spec_len``):
    draft_token_ids      [N] int32          drafts of every request, flattened in request order
    cu_num_draft_tokens  [B] int32          INCLUSIVE cumulative draft counts (no leading zero): request b owns
                                            ``draft_token_ids[cu[b-1]:cu[b]]`` (``cu[-1] = N``)
    logits_indices       [N + B]            per request, its draft positions then its bonus position; the runner's
                                            ``logits = lm_head(hidden[logits_indices])`` is ``[N + B, V]`` in this order
Our :func:`dspark_kernels.ops.rejection_sample` uses the same ragged order with offsets ``[B + 1]`` (leading zero)
and samples the bonus token itself from the bonus rows, so :func:`rejection_sample_vllm` replaces both vLLM's
``Sampler`` call for the bonus tokens and its ``RejectionSampler`` (which takes the N draft rows plus the bonus tokens
already sampled): pass the ``[N + B, V]`` logits after the engine's penalties and logits processors. It converts the
offsets, maps vLLM's greedy marker (temperature -1, or no temperature tensor for an all-greedy batch) to our 0, makes
the uniforms from per-request ``seeds``/``offsets`` tensors and returns vLLM's int32 output with ``-1`` placeholders
(``PLACEHOLDER_TOKEN_ID``).
"""

from __future__ import annotations

import torch

from ..ops import rejection_sample
from ..ops._validate import INDEX_DTYPES, check_draft_offsets, check_shape, check_tensor
from ..ops.rejection_sample import rejection_noise

PLACEHOLDER_TOKEN_ID = -1


def offsets_from_vllm_cu(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's inclusive ``cu_num_draft_tokens [B]`` -> our offsets ``[B + 1]`` int32 (a zero prepended, same device)."""
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=INDEX_DTYPES)
    zero = torch.zeros(1, dtype=torch.int32, device=cu_num_draft_tokens.device)
    return torch.cat([zero, cu_num_draft_tokens.to(torch.int32)])


def rejection_sample_vllm(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
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
        temperature: ``[B]`` float32, 0 or negative (vLLM's -1) = greedy; ``None`` = every request greedy (vLLM
            passes no temperature tensor for an all-greedy batch).
        top_k, top_p: ``[B]`` per-request filters or ``None``.
        seeds, offsets: ``[B]`` int64 per-request seed and step counter; the uniforms are derived from them on the
            device (:func:`dspark_kernels.ops.rejection_sample.rejection_noise`), so no generator state is involved.
    Output rows hold the accepted drafts, then the correction or bonus token, then ``-1``, as vLLM's sampler returns.
    ``check_inputs`` (default) validates everything, the offsets and the noise's inputs first; ``False`` makes no host
    sync.
    """
    if check_inputs and isinstance(seeds, torch.Tensor) and isinstance(cu_num_draft_tokens, torch.Tensor) \
            and cu_num_draft_tokens.dim() == 1 and seeds.dim() == 1 \
            and cu_num_draft_tokens.shape[0] == seeds.shape[0] + 1 and int(cu_num_draft_tokens[0]) == 0:
        raise ValueError(f"cu_num_draft_tokens must hold one inclusive count per request ({seeds.shape[0]} requests, "
                         f"as in seeds), got {cu_num_draft_tokens.shape[0]} entries (vLLM's layout has no leading "
                         f"zero)")
    cu = offsets_from_vllm_cu(cu_num_draft_tokens)
    b = cu.shape[0] - 1
    if check_inputs:  # the noise below reads the offsets and seeds: check them before it is made
        check_draft_offsets(draft_token_ids, cu, max_spec_len, cu.device)
        for name, t in (("seeds", seeds), ("offsets", offsets)):
            check_tensor(name, t, ndim=1, dtypes=(torch.int64,), device=cu.device)
            check_shape(name, t, (b,))
    if temperature is None:
        temperature = torch.zeros(b, dtype=torch.float32, device=cu.device)
    elif check_inputs:
        check_tensor("temperature", temperature, ndim=1, dtypes=(torch.float32,), device=cu.device)
    # vLLM marks greedy requests with a negative temperature (its GREEDY_TEMPERATURE, -1); ours is 0
    temperature = torch.where(temperature < 0, torch.zeros_like(temperature), temperature)
    # uniforms are always made (greedy rows ignore them), so the call has no data-dependent branch
    accept_u, sample_u = rejection_noise(seeds, offsets, cu, draft_token_ids.shape[0], max_spec_len=max_spec_len)
    res = rejection_sample(draft_token_ids, cu, draft_probs, logits, temperature, top_k, top_p, accept_u, sample_u,
                           max_spec_len=max_spec_len, impl=impl, check_inputs=check_inputs)
    return res.output_token_ids.to(torch.int32), res.num_accepted

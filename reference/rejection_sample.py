"""Reference for lossless speculative sampling (the rejection/verification step), ragged over requests.

Vectorised over requests and drafts (no Python loop over requests), so the statistical tests can push millions of
requests through it. The semantics are documented in :mod:`dspark_kernels.ops.rejection_sample`; this module uses the
same formulas as the Triton kernels so that integer outputs agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._sampling import argmax_rows, inverse_cdf_ref, target_probs_ref

RESIDUAL_EPS = 1e-8
HOST_ROWS = 256  # on the CPU, an all-greedy batch of at most this many target rows is verified by a Python scan


class RejectionResult(NamedTuple):
    """``output_token_ids`` ``[R, max_spec_len + 1]`` int64, -1 after the emitted tokens;
    ``num_accepted`` ``[R]`` int32, accepted drafts per request (the emitted count is ``num_accepted + 1``)."""

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor


def _ragged_maps(cu: torch.Tensor, num_drafts: int) -> tuple[torch.Tensor, ...]:
    """Index maps of the ragged layout (no host sync).

    Returns ``lens [R]``, ``row_req [N + R]`` (request of each target row), ``draft_req [N]`` (request of each draft),
    ``draft_pos [N]`` (position of each draft inside its request) and ``draft_row [N]`` (target row of each draft).
    """
    r = cu.numel() - 1
    req = torch.arange(r, device=cu.device)
    lens = cu[1:] - cu[:-1]
    row_req = torch.repeat_interleave(req, lens + 1, output_size=num_drafts + r)
    draft_req = torch.repeat_interleave(req, lens, output_size=num_drafts)
    draft_idx = torch.arange(num_drafts, device=cu.device)
    return lens, row_req, draft_req, draft_idx - cu[draft_req], draft_idx + draft_req


def _correction_weights(
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    x: torch.Tensor,
    rejected: torch.Tensor,
    final_row: torch.Tensor,
    rej_draft: torch.Tensor,
) -> torch.Tensor:
    """Weights ``[R, V]`` of the last emitted token: the residual ``max(0, p_t - p_d)`` where a draft was rejected
    (unless its mass is <= ``RESIDUAL_EPS``), else ``p_t`` of the request's final row."""
    pt = probs[final_row]
    if x.numel() == 0:
        return pt
    rej_draft = rej_draft.clamp(max=x.numel() - 1)
    if draft_probs is None:
        pd = torch.nn.functional.one_hot(x[rej_draft], pt.shape[1]).to(pt.dtype)
    else:
        pd = draft_probs[rej_draft].float()
    resid = (pt - pd).clamp(min=0)
    use_resid = rejected & (resid.sum(dim=1) > RESIDUAL_EPS)
    return torch.where(use_resid[:, None], resid, pt)


def _bump_counters(counter: torch.Tensor | None, counts: torch.Tensor, max_spec_len: int) -> None:
    """``counter[j] += #requests with counts > j`` (in place)."""
    if counter is not None:
        pos = torch.arange(max_spec_len, device=counts.device)
        counter += (counts[:, None] > pos).sum(dim=0).to(counter.dtype)


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    accept_uniforms: torch.Tensor | None,
    sample_uniforms: torch.Tensor | None,
    *,
    max_spec_len: int,
    accept_counter: torch.Tensor | None = None,
    draft_counter: torch.Tensor | None = None,
) -> RejectionResult:
    """Verify the drafts of every request against the target and emit accepted drafts plus one correction/bonus token.

    Shapes as in :func:`dspark_kernels.ops.rejection_sample`; inputs are assumed valid. Only the counters are written.
    An all-greedy batch (no uniforms) of CPU tensors with at most ``HOST_ROWS`` target rows takes
    :func:`greedy_host` (the same result; a decode round's handful of rows costs about forty small tensor ops here).
    """
    n = draft_token_ids.numel()
    r = cu_num_draft_tokens.numel() - 1
    dev = target_logits.device
    # no uniforms at all means every request is greedy (the op's contract): the target probabilities are not needed
    all_greedy = accept_uniforms is None and sample_uniforms is None
    if all_greedy and dev.type == "cpu" and n + r <= HOST_ROWS:
        return greedy_host(draft_token_ids, cu_num_draft_tokens, target_logits, max_spec_len=max_spec_len,
                           accept_counter=accept_counter, draft_counter=draft_counter)
    cu = cu_num_draft_tokens.long()
    lens, row_req, draft_req, draft_pos, draft_row = _ragged_maps(cu, n)
    greedy = temperature == 0
    probs = None if all_greedy else target_probs_ref(
        target_logits,
        temperature[row_req],
        top_k[row_req] if top_k is not None else None,
        top_p[row_req] if top_p is not None else None,
    )
    # the greedy rows' tokens (an all-stochastic batch needs none)
    argmax = argmax_rows(target_logits) if all_greedy or bool(greedy.any()) else None

    x = draft_token_ids.long()
    if accept_uniforms is not None:
        pd_x = draft_probs.gather(1, x[:, None]).squeeze(1) if draft_probs is not None else 1.0
        stochastic_ok = accept_uniforms * pd_x < probs[draft_row, x]
    else:
        stochastic_ok = torch.zeros_like(x, dtype=torch.bool)
    ok = stochastic_ok if argmax is None else torch.where(greedy[draft_req], x == argmax[draft_row], stochastic_ok)
    ok_padded = torch.zeros(r, max_spec_len, dtype=torch.bool, device=dev)
    ok_padded[draft_req, draft_pos] = ok
    num_acc = ok_padded.long().cumprod(dim=1).sum(dim=1)

    final_row = cu[:-1] + torch.arange(r, device=dev) + num_acc
    rejected = num_acc < lens
    if all_greedy:
        last_token = argmax[final_row]
    else:
        w = _correction_weights(probs, draft_probs, x, rejected, final_row, cu[:-1] + num_acc)
        u = sample_uniforms[final_row] if sample_uniforms is not None else torch.zeros(r, device=dev)
        last_token = inverse_cdf_ref(w, u)
        if argmax is not None:
            last_token = torch.where(greedy, argmax[final_row], last_token)

    drafts_padded = torch.full((r, max_spec_len + 1), -1, dtype=torch.int64, device=dev)
    drafts_padded[draft_req, draft_pos] = x
    pos = torch.arange(max_spec_len + 1, device=dev)
    out = torch.where(pos < num_acc[:, None], drafts_padded, torch.full_like(drafts_padded, -1))
    out.scatter_(1, num_acc[:, None], last_token[:, None])

    _bump_counters(draft_counter, lens, max_spec_len)
    _bump_counters(accept_counter, num_acc, max_spec_len)
    return RejectionResult(out, num_acc.to(torch.int32))


def greedy_host(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, target_logits: torch.Tensor, *,
                max_spec_len: int, accept_counter: torch.Tensor | None = None,
                draft_counter: torch.Tensor | None = None) -> RejectionResult:
    """Greedy verification of every request (shapes as in :func:`rejection_sample_ref`) as a scan over host lists.

    One argmax over the target rows (lowest index on ties, the tensor path's), then, per request, the accepted
    drafts are the longest prefix equal to the target's tokens and the next target token is emitted. The outputs
    and counters equal the tensor path's (tested bit for bit); for a few rows it is several times cheaper.
    """
    target = argmax_rows(target_logits).tolist()
    drafts = draft_token_ids.tolist()
    bounds = cu_num_draft_tokens.tolist()
    r = len(bounds) - 1
    out = [[-1] * (max_spec_len + 1) for _ in range(r)]
    accepted, lens = [0] * r, [0] * r
    for i in range(r):
        start, end = bounds[i], bounds[i + 1]
        row = start + i  # the target row of the request's first draft
        a = 0
        while start + a < end and drafts[start + a] == target[row + a]:
            a += 1
        out[i][:a] = drafts[start:start + a]
        out[i][a] = target[row + a]
        accepted[i], lens[i] = a, end - start
    dev = target_logits.device
    _bump_counters(draft_counter, torch.tensor(lens, device=dev), max_spec_len)
    _bump_counters(accept_counter, torch.tensor(accepted, device=dev), max_spec_len)
    return RejectionResult(torch.tensor(out, dtype=torch.int64, device=dev).view(r, max_spec_len + 1),
                           torch.tensor(accepted, dtype=torch.int32, device=dev))

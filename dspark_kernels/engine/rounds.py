"""Round mechanics shared by the fixed-batch loop (:mod:`.speculative`) and the continuous-batching engine
(:mod:`.engine`).

* :func:`prefill`: one ragged target forward over new prompts; returns each request's first token (noise round 0);
* :class:`PendingContext`: committed tokens and their features per request, waiting for the request's next drafting
  round (which takes them into the drafter's context in the same pass);
* :func:`draft`: the drafter's ``gamma`` proposals with counter-based uniforms (:func:`no_drafts`: none);
* :func:`verify_round`: one ragged verify of ``[anchor, d_1 .. d_{l_r}]`` per request (``l_r`` in 0..gamma), lossless
  rejection sampling, rollback of the rejected drafts in the target cache; returns the kept tokens and their features
  for the drafter's context (:func:`plain_round` when no request verifies a draft: a plain decode step);
* :func:`finish_reason`: the length cap and EOS truncation of a request's emitted tokens.

The batch's sampling parameters (:class:`~dspark_kernels.sampling.Sampling`) and the token of a row without drafts
(:func:`~dspark_kernels.sampling.next_tokens`) come from :mod:`dspark_kernels.sampling`, shared with plain generation.

Randomness is counter-based: round ``t`` of a request with seed ``s`` draws from ``(s, t)`` only, so a request's
noise does not depend on what it is batched with; its output does not either (given its own verify lengths and each
round's draft width, which a block drafter's two-way block attention depends on) up to the last-bit differences of
batched GEMMs, which can move a T > 0 draw that falls at a boundary.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..drafters import DraftContext, Drafter, DraftOutput
from ..models import CausalLM
from ..noise import uniform_noise
from ..ops import rejection_sample
from ..ops._validate import is_int
from ..ops.rejection_sample import rejection_noise
from ..request_checks import check_step_logits
from ..sampling import Sampling, next_tokens

DRAFT_NOISE_STREAM = 7


def features_of(hidden: dict, layers: Sequence[int]) -> torch.Tensor:
    """The drafter's input features ``[T, m * hidden]``: the target's hidden states of ``layers``, concatenated."""
    return torch.cat([hidden[layer] for layer in layers], dim=-1)


def prefill(target: CausalLM, drafter: Drafter, tcache, dstate, rids: Sequence, prompts: Sequence[Sequence[int]],
            sampling: Sampling, impl: str | None = None,
            defer: Callable[[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], None] | None = None) -> list[int]:
    """Run every prompt through the target in one ragged forward (its cache gets them), give the drafter their
    features, and sample each request's first token from its last logits row (noise round ``sampling.offset``).

    ``defer``: instead of extending the drafter's context now, hand it ``(token_ids [T], features [T, m * hidden],
    cu [R + 1])`` (as ``RoundOutput.kept``) for a later ``drafter.extend``."""
    dev = target.device
    layers = tuple(drafter.feature_layers)
    lens = torch.tensor([len(p) for p in prompts])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(dev, torch.int32)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev)
    fwd = target(ids, cu, list(rids), tcache, logits_indices=(cu[1:] - 1).long(), hidden_layers=layers, impl=impl)
    check_step_logits(fwd.logits, rids, temperature=sampling.temperature)
    kept = (ids, features_of(fwd.hidden_states, layers), cu)
    if defer is None:
        drafter.extend(dstate, list(rids), *kept)
    else:
        defer(kept)
    return next_tokens(fwd.logits, sampling, impl)


class PendingContext:
    """Committed tokens with their target features, per request, not yet given to the drafter.

    A prefill or a verify round hands its kept tokens here (:meth:`add`); the request's next drafting round takes
    them (:meth:`take`) as the ``context`` of :meth:`Drafter.draft`, which puts them into the drafter's context in the
    same pass as the draft. Chunks of a request stay in commit order; a request that is not drafted keeps
    accumulating them, so a round without drafting costs the drafter nothing.

    A round's tensors are kept whole, with each request's row range noted on the host: :meth:`add` does no tensor
    work (a closed draft gate then pays nothing per step here), and :meth:`take` slices only what it hands over,
    nothing at all when it takes exactly one whole round in that round's order (a batch that drafts every round).
    """

    def __init__(self) -> None:
        self._chunks: dict = {}  # rid -> [(round's kept, its rids, first row, end row)] in commit order

    def add(self, rids: Sequence, kept: DraftContext) -> None:
        """Append ``kept = (token_ids [T], features [T, m * hidden], cu [R + 1])``, aligned with ``rids``."""
        bounds, order = kept[2].tolist(), tuple(rids)
        for j, rid in enumerate(order):
            if bounds[j + 1] > bounds[j]:
                self._chunks.setdefault(rid, []).append((kept, order, bounds[j], bounds[j + 1]))

    def take(self, rids: Sequence, device: torch.device) -> DraftContext | None:
        """Remove and return the pending tokens of ``rids`` as one context aligned with ``rids`` (a request with none
        gets an empty chunk); ``None`` when none of them has any."""
        chunks = [self._chunks.pop(rid, []) for rid in rids]
        if not any(chunks):
            return None
        whole = self._whole_round(chunks, tuple(rids))
        if whole is not None:
            return whole
        lens = [sum(end - first for _, _, first, end in chunk) for chunk in chunks]
        cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(device, torch.int32)
        pieces = [(kept[0][first:end], kept[1][first:end]) for chunk in chunks for kept, _, first, end in chunk]
        return torch.cat([t for t, _ in pieces]), torch.cat([f for _, f in pieces]), cu

    @staticmethod
    def _whole_round(chunks: list, rids: tuple) -> DraftContext | None:
        """The round's own ``kept`` when ``chunks`` (aligned with ``rids``) are one chunk per request, all of one round
        added for exactly ``rids`` in this order, and every request had rows in it (its offsets then align with
        ``rids``); else ``None``."""
        if any(len(chunk) != 1 for chunk in chunks):
            return None
        kept, order = chunks[0][0][0], chunks[0][0][1]
        return kept if order == rids and all(chunk[0][0] is kept for chunk in chunks) else None

    def longest(self, rids: Sequence) -> int:
        """The most pending tokens any of ``rids`` holds (host metadata only: no device read)."""
        return max((sum(end - first for _, _, first, end in self._chunks.get(rid, ())) for rid in rids), default=0)

    def drop(self, rid) -> None:
        """Forget a finished request's pending tokens."""
        self._chunks.pop(rid, None)


def draft(drafter: Drafter, dstate, rids: Sequence, anchors: torch.Tensor, gamma: int, sampling: Sampling,
          impl: str | None = None, context: DraftContext | None = None) -> DraftOutput:
    """``gamma`` drafts after each anchor ``[R]``; one uniform per draft from ``(seed, offset)`` (stream 7);
    ``context``: the requests' pending committed tokens (:class:`PendingContext`), taken in by the same call."""
    uniforms = None if sampling.greedy else uniform_noise(sampling.seed, sampling.offset, (gamma,),
                                                          stream=DRAFT_NOISE_STREAM).reshape(-1)
    return drafter.draft(dstate, list(rids), anchors, gamma, sampling.temperature, sampling.top_k, sampling.top_p,
                         uniforms, impl=impl, context=context)


def no_drafts(r: int, gamma: int, device: torch.device) -> DraftOutput:
    """The :class:`DraftOutput` of a round in which none of the ``r`` requests drafts (a plain decode step: every
    verify length 0); ``gamma`` is the round's draft-slot width (>= 1)."""
    return DraftOutput(torch.zeros(r * gamma, dtype=torch.int64, device=device), None, None)


@dataclass
class RoundOutput:
    """``num_accepted [R]`` int32 on the device; ``accepted``: the same on the host; ``emitted[r]``: the accepted
    drafts then the correction/bonus token (``accepted[r] + 1`` tokens); ``kept``: what the drafter's context grows by
    (the anchor and the accepted drafts of each request with the target's features), for
    :meth:`PendingContext.add`."""

    num_accepted: torch.Tensor
    accepted: list[int]
    emitted: list[list[int]]
    kept: DraftContext


def verify_round(target: CausalLM, drafter: Drafter, tcache, rids: Sequence, anchors: torch.Tensor,
                 drafted: DraftOutput, verify_lens: torch.Tensor, gamma: int, sampling: Sampling,
                 accept_counter: torch.Tensor | None = None, impl: str | None = None) -> RoundOutput:
    """Verify ``[anchor_r, d_r1 .. d_r{l_r}]`` of every request in one ragged target forward.

    ``anchors [R]`` int64, ``drafted.tokens [R * gamma]``, ``verify_lens [R]`` int (0..gamma) on the device. Only the
    verified drafts (and their ``draft_probs`` rows) reach :func:`rejection_sample`; the optional per-position
    ``accept_counter [gamma]`` int64 (drafts accepted at each position) is accumulated in place. Afterwards the target
    cache holds the anchor and the accepted drafts of each request; the same tokens with their features are returned
    in ``RoundOutput.kept`` for the drafter's context (the next drafting round takes them in).
    """
    dev = anchors.device
    r = len(rids)
    lens = verify_lens.tolist()
    if len(lens) != r or not all(is_int(l_r) and 0 <= l_r <= gamma for l_r in lens):
        raise ValueError(f"verify_lens must hold {r} ints in 0..{gamma} (the drafted width), got {lens}")
    if not any(lens):
        return plain_round(target, drafter, tcache, rids, anchors, sampling, impl)
    # index work on the host (the lengths are there already): a row of [anchor, d_1 .. d_gamma] per request,
    # flattened; which rows are verified is a slice when every request verifies all gamma drafts
    block = torch.cat([anchors[:, None], drafted.tokens.view(r, gamma)], dim=1).view(-1)
    cu_d = list(accumulate(lens, initial=0))
    if all(l_r == gamma for l_r in lens):
        tokens, draft_rows = block, None
    else:
        tokens = block[torch.tensor([i * (gamma + 1) + j for i, l_r in enumerate(lens) for j in range(l_r + 1)],
                                    device=dev)]
        draft_rows = torch.tensor([i * gamma + j for i, l_r in enumerate(lens) for j in range(l_r)], device=dev)
    drafts = drafted.tokens if draft_rows is None else drafted.tokens[draft_rows]
    cu_v = torch.tensor([c + i for i, c in enumerate(cu_d)], dtype=torch.int32, device=dev)
    cu_d_t = torch.tensor(cu_d, dtype=torch.int32, device=dev)
    layers = tuple(drafter.feature_layers)
    fwd = target(tokens, cu_v, list(rids), tcache, hidden_layers=layers, impl=impl, check_inputs=False)
    check_step_logits(fwd.logits, rids, [n + 1 for n in lens], sampling.temperature)
    probs = None
    acc_u = smp_u = None
    if not sampling.greedy:
        if drafted.draft_probs is not None:
            probs = drafted.draft_probs.view(r * gamma, -1)
            probs = probs if draft_rows is None else probs[draft_rows]
        acc_u, smp_u = rejection_noise(sampling.seed, sampling.offset, cu_d_t, cu_d[-1], max_spec_len=gamma)
    res = rejection_sample(drafts, cu_d_t, probs, fwd.logits, sampling.temperature, sampling.top_k,
                           sampling.top_p, acc_u, smp_u, max_spec_len=gamma, accept_counter=accept_counter,
                           impl=impl, check_inputs=False)
    accepted = res.num_accepted.tolist()
    emitted = res.output_token_ids.tolist()
    for rid, l_r, a in zip(rids, lens, accepted):
        tcache.rollback(rid, l_r - a)
    feats = features_of(fwd.hidden_states, layers)
    keep_cu = list(accumulate((a + 1 for a in accepted), initial=0))
    if r == 1:  # the first a + 1 rows: views
        kept_tokens, kept_feats = tokens[: keep_cu[1]], feats[: keep_cu[1]]
    else:
        keep = torch.tensor([cu_d[i] + i + j for i, a in enumerate(accepted) for j in range(a + 1)], device=dev)
        kept_tokens, kept_feats = tokens[keep], feats[keep]
    kept = (kept_tokens, kept_feats, torch.tensor(keep_cu, dtype=torch.int32, device=dev))
    return RoundOutput(res.num_accepted, accepted, [e[: a + 1] for e, a in zip(emitted, accepted)], kept)


def plain_round(target: CausalLM, drafter: Drafter, tcache, rids: Sequence, anchors: torch.Tensor,
                sampling: Sampling, impl: str | None = None) -> RoundOutput:
    """A round in which no request verifies a draft (a plain decode step): one target forward over the anchors
    ``[R]``, each request's token drawn from its row exactly as :func:`verify_round` draws it after zero accepted
    drafts (the argmax when every request is greedy, else the same rejection-sampling noise). It skips the draft
    bookkeeping: nothing to mask, roll back or gather (every anchor is kept, with its features)."""
    dev = anchors.device
    r = len(rids)
    layers = tuple(drafter.feature_layers)
    cu = torch.arange(r + 1, dtype=torch.int32, device=dev)
    fwd = target(anchors, cu, list(rids), tcache, hidden_layers=layers, impl=impl, check_inputs=False)
    check_step_logits(fwd.logits, rids, temperature=sampling.temperature)
    tokens = next_tokens(fwd.logits, sampling, impl)
    kept = (anchors, features_of(fwd.hidden_states, layers), cu)
    return RoundOutput(torch.zeros(r, dtype=torch.int32, device=dev), [0] * r, [[t] for t in tokens], kept)


def finish_reason(tokens: list[int], max_new_tokens: int, eos: int | Collection[int] | None) -> str | None:
    """Truncate ``tokens`` in place at the length cap and after the first stop token (``eos``: one id, a collection
    of ids such as :func:`~dspark_kernels.request_checks.stop_tokens` gives, or ``None``; an id may be a numpy
    integer); return "eos", "length" or None (still running)."""
    del tokens[max_new_tokens:]
    stops = () if eos is None else (eos,) if isinstance(eos, numbers.Integral) else eos
    stop = next((i for i, t in enumerate(tokens) if t in stops), None) if stops else None
    if stop is not None:
        del tokens[stop + 1:]
        return "eos"
    return "length" if len(tokens) >= max_new_tokens else None

"""Draft -> verify -> accept decoding at batch size 1..N (any drafter), with a fixed draft length or an adaptive one.

Without ``draft_length`` every request drafts and verifies ``gamma`` tokens each round. With an
:class:`~.draft_length.AdaptiveDraftLength`, each request drafts ``l_r`` in ``0..gamma`` tokens a round, chosen from its
own past acceptances and the device's round costs; the round drafts ``max(l_r)`` slots for every live request (one
backbone pass) and verifies ``l_r`` of each; when every ``l_r`` is 0 the round is a plain decode step without a draft.

Round structure for every live request (anchor ``x0`` = its last emitted token, not yet seen by the target):
1. the drafter proposes ``gamma`` tokens (with draft probabilities and, when it has one, confidence logits);
2. the target runs one ragged forward over ``[x0, d_1 .. d_gamma]`` of every request, returning logits at every
   position and the hidden states the drafter needs;
3. :func:`dspark_kernels.ops.rejection_sample` accepts a prefix and emits a correction or bonus token (lossless);
4. the target's cache drops the rejected drafts; the features of ``x0`` and the accepted drafts wait for the next
   round's draft, which takes them into the drafter's context in the same pass; the emitted token becomes the next
   anchor.

The first token of each request comes from the prefill's logits (as in plain generation), so at temperature 0 the
output is token-for-token the target's greedy output. Per-request randomness is counter-based: round ``t`` of a request
with seed ``s`` uses ``(s, t)`` for the drafter's and the verifier's uniforms, so the noise does not depend on
batching. The arithmetic may: batched GEMMs on a CPU are not row-invariant, so logits differ in the last bits with the
batch, and at T > 0 a draw that falls within such a difference of a boundary can pick another token (greedy output is
the target's greedy output either way; ``load_model(..., batch_invariant=True)`` makes the attention, not the GEMMs,
independent of the batch).

Metrics kept on the device, read once at the end: a histogram of rounds by verified and accepted drafts (``tau`` =
mean accepted + 1, conditional acceptance by position).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..drafters import Drafter, check_drafter_target, check_gamma
from ..models import CausalLM
from ..request_checks import check_decode_args, check_model, check_requests
from ..sampling import PromptSampling, Sampling
from .draft_length import AdaptiveDraftLength
from .rounds import PendingContext, draft, finish_reason, no_drafts, prefill, verify_round

__all__ = ["SpecResult", "speculative_generate"]


@dataclass
class SpecResult:
    """Per-request new tokens and finish reasons, plus round statistics.

    ``round_hist[l][a]``: rounds that verified ``l`` drafts and accepted ``a`` of them (``l = 0``: a plain step of
    an adaptive draft length); ``accept_hist[a]``: rounds that accepted exactly ``a`` drafts; ``tau``: mean accepted
    length per round (accepted drafts + the correction/bonus token); ``acceptance_by_position[j]``: P(draft j+1
    accepted | drafts 1..j accepted and draft j+1 verified); ``rounds``: rounds summed over requests; ``steps``: target
    forwards (prefill included). The round statistics are the verifier's verdicts: a request's last round may keep
    fewer tokens than it accepted when ``max_new_tokens`` or an EOS cuts it (``tokens`` holds what was emitted).
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    elapsed_s: float
    steps: int
    rounds: int
    round_hist: list[list[int]]
    gamma: int
    draft_s: float = 0.0
    verify_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def accept_hist(self) -> list[int]:
        return [sum(row[a] for row in self.round_hist) for a in range(self.gamma + 1)]

    @property
    def tau(self) -> float:
        hist = self.accept_hist
        total = sum(hist)
        return sum((a + 1) * n for a, n in enumerate(hist)) / total if total else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        out = []
        for j in range(self.gamma):
            reached = sum(n for l_r, row in enumerate(self.round_hist) if l_r > j for n in row[j:])
            accepted = sum(n for row in self.round_hist for n in row[j + 1:])
            out.append(accepted / reached if reached else float("nan"))
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speculative_generate(
    target: CausalLM,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    gamma: int,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seeds: Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    page_size: int = 16,
    impl: str | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    record_traces: bool = False,
    draft_length: AdaptiveDraftLength | None = None,
) -> SpecResult:
    """Speculative decoding of every prompt (see module docstring); same arguments as ``models.generate`` plus the
    drafter, the verify length ``gamma`` and ``on_tokens(prompt_index, new_tokens)``, called as tokens are final
    (for streaming). ``record_traces`` keeps, per round and request, the drafter's confidence logits and the number
    of accepted drafts (``extra["confidence_logits"] [rounds, gamma]``, ``extra["accepted"] [rounds]``,
    ``extra["trace_request"] [rounds]``): the data for calibration and for replaying scheduling policies (fixed
    draft length only). ``draft_length``: an :class:`~.draft_length.AdaptiveDraftLength` (``gamma`` is then the most
    a request drafts in a round); it is reset for this call."""
    check_model(target, "target")
    if not callable(getattr(drafter, "draft", None)):
        raise TypeError(f"drafter must be a drafter (dspark_kernels.drafters.load_drafter(...), or NullDrafter() for "
                        f"plain decoding), got {type(drafter).__name__}")
    check_decode_args(max_new_tokens, page_size)
    check_gamma(drafter, gamma)
    check_drafter_target(drafter, target)
    if draft_length is not None and not isinstance(draft_length, AdaptiveDraftLength):
        raise TypeError(f"draft_length must be an AdaptiveDraftLength or None, got {type(draft_length).__name__}")
    if draft_length is not None and record_traces:
        raise ValueError("record_traces needs a fixed draft length (draft_length=None): traces are [rounds, gamma]")
    prompts, eos = check_requests(target.config, prompts, max_new_tokens, eos_token_id)
    n, dev = len(prompts), target.device
    params = PromptSampling(temperature, top_k, top_p, seeds, n)

    def sampling(live: list[int]) -> Sampling:
        return params.of(live, [rounds[i] for i in live], dev)

    out: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    hist = torch.zeros((gamma + 1) * (gamma + 1), dtype=torch.int64, device=dev)  # [verified, accepted] flattened
    t0 = time.perf_counter()
    if n == 0 or max_new_tokens == 0:
        return SpecResult(out, reasons, 0.0, 0, 0, hist.view(gamma + 1, -1).tolist(), gamma)
    if draft_length is not None:
        draft_length.start(n)

    budget = [len(p) + max_new_tokens + gamma + 1 for p in prompts]
    tcache = target.new_cache(sum(-(-b // page_size) for b in budget), page_size)
    dstate = drafter.new_state(sum(-(-b // page_size) for b in budget), page_size)
    for i in range(n):
        tcache.add_request(i)
        drafter.add_request(dstate, i)

    # prefill: every prompt at once; its last logits give the first token (the first anchor), noise round 0
    live = list(range(n))
    rounds = [0] * n
    anchors: dict[int, int] = {}
    pending = PendingContext()
    first = prefill(target, drafter, tcache, dstate, live, prompts, sampling(live), impl,
                    defer=lambda kept: pending.add(live, kept))
    for i, tok in zip(live, first):
        out[i].append(tok)
        anchors[i] = tok
        rounds[i] = 1
    steps, n_rounds, draft_s, verify_s = 1, 0, 0.0, 0.0
    live = _stream(live, [0] * n, out, on_tokens, _still_live(live, out, reasons, eos, max_new_tokens,
                                                               tcache, drafter, dstate, pending))
    traces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    while live:
        r = len(live)
        before = [len(out[i]) for i in range(n)] if on_tokens else []
        samp = sampling(live)
        anchor_t = torch.tensor([anchors[i] for i in live], dtype=torch.int64, device=dev)
        lens = [gamma] * r if draft_length is None else [draft_length.choose(i, gamma) for i in live]
        width = max(lens)
        td = time.perf_counter()
        if width > 0:
            drafted = draft(drafter, dstate, live, anchor_t, width, samp, impl, context=pending.take(live, dev))
        else:  # nobody drafts: a plain decode step
            drafted, width = no_drafts(r, 1, dev), 1
        _sync(dev)
        tv = time.perf_counter()
        draft_s += tv - td
        lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
        rnd = verify_round(target, drafter, tcache, live, anchor_t, drafted, lens_t, width, samp, impl=impl)
        pending.add(live, rnd.kept)
        hist.index_add_(0, lens_t * (gamma + 1) + rnd.num_accepted.long(), torch.ones(r, dtype=torch.int64,
                                                                                       device=dev))
        if record_traces and drafted.confidence_logits is not None:
            traces.append((drafted.confidence_logits.view(r, gamma), rnd.num_accepted, torch.tensor(live)))
        steps += 1
        n_rounds += r
        for i, tokens, l_r, a_r in zip(live, rnd.emitted, lens, rnd.accepted):
            out[i].extend(tokens)
            anchors[i] = tokens[-1]
            rounds[i] += 1
            if draft_length is not None:
                draft_length.observe(i, l_r, a_r)
        _sync(dev)
        verify_s += time.perf_counter() - tv
        live = _stream(live, before, out, on_tokens,
                       _still_live(live, out, reasons, eos, max_new_tokens, tcache, drafter, dstate, pending))

    _sync(dev)
    extra = {}
    if traces:
        extra = {"confidence_logits": torch.cat([t[0] for t in traces]).float().cpu(),
                 "accepted": torch.cat([t[1] for t in traces]).long().cpu(),
                 "trace_request": torch.cat([t[2] for t in traces])}
    return SpecResult(out, reasons, time.perf_counter() - t0, steps, n_rounds, hist.view(gamma + 1, -1).tolist(), gamma,
                      draft_s=draft_s, verify_s=verify_s, extra=extra)


def _stream(round_live, before, out, on_tokens, next_live):
    """Report the tokens each request of the round gained (after EOS/length truncation); return ``next_live``."""
    if on_tokens is not None:
        for i in round_live:
            if len(out[i]) > before[i]:
                on_tokens(i, out[i][before[i]:])
    return next_live


def _still_live(live, out, reasons, eos, max_new, tcache, drafter, dstate, pending) -> list[int]:
    """Apply the length cap and EOS (an emitted EOS ends the request, later tokens dropped); free finished ones."""
    still = []
    for i in live:
        reason = finish_reason(out[i], max_new, eos)
        if reason is None:
            still.append(i)
        else:
            reasons[i] = reason
            tcache.free(i)
            drafter.free(dstate, i)
            pending.drop(i)
    return still

"""Adaptive draft length for the fixed-batch speculative loop: how many tokens to draft for each request this round.

A round that drafts ``k`` tokens costs more than a plain decode step, and what it buys depends on how well the drafter
is doing on *this* text: a drafter that copies a memorised file gets whole blocks accepted, one facing a repetition
loop it never saw in training gets almost nothing. A fixed ``gamma`` is too short for the first and a loss for the
second. Following the cost model of Leviathan et al. (2023, section 3.5), with an acceptance rate that is re-estimated
as the text changes:

* cost, in plain decode steps: ``cost(0) = 1`` (no draft: a plain step) and ``cost(k) = 1 + fixed + per_token * k``
  (:class:`RoundCosts`, measured on the live device by :func:`measure_round_costs`);
* gain: with per-draft acceptance rate ``alpha``, a round that verifies ``k`` drafts emits
  ``E[tau](k) = 1 + alpha + ... + alpha^k`` tokens on average;
* each round every request drafts the ``k`` in ``0..gamma`` with the most tokens per cost, ``E[tau](k) / cost(k)``.

``alpha`` is a running estimate per request: decayed counts of accepted drafts and of rejections (``alpha = accepted /
(accepted + rejections)``), which start at the prior and are updated by every drafted round. A request whose estimate
says plain steps are best stops drafting, but a plain step observes nothing, so it probes: after ``wait`` plain steps it
drafts one round at the length the prior would choose (where the prior itself would not draft, at the length that would
pay most if every draft were accepted; only where not even that pays does a request never draft). If the estimate after
the probe still says not to draft, the wait doubles (``probe_wait``, 2x, 4x, ... up to ``max_probe_wait``); once
drafting pays again the wait starts over. On text the drafter cannot follow, probing costs one drafted round every
``max_probe_wait`` steps in the long run.

The choice depends only on the request's own past acceptances (never on the tokens being verified), so rejection
sampling stays lossless, and at temperature 0 the output is still the target's greedy output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..drafters import Drafter
from ..drafters.block_drafter import MAX_GAMMA
from ..models import CausalLM
from ..sampling import Sampling
from .rounds import PendingContext, draft, no_drafts, prefill, verify_round

__all__ = ["DRAFT_LENGTH_MODES", "AdaptiveDraftLength", "RoundCosts", "cli_gamma", "measure_round_costs"]

DRAFT_LENGTH_MODES = {"adaptive": 15, "fixed": 7}  # mode -> default gamma (the most drafted, or every round's)


def cli_gamma(gamma: int | None, mode: str) -> int:
    """A command line's ``--gamma`` for ``--draft-length mode``: its default when ``None``; ``ValueError`` unless it is
    in ``1..MAX_GAMMA`` (from 2 adaptive: :func:`measure_round_costs` fits two lengths)."""
    if mode not in DRAFT_LENGTH_MODES:
        raise ValueError(f"--draft-length must be one of {sorted(DRAFT_LENGTH_MODES)}, got {mode!r}")
    gamma = DRAFT_LENGTH_MODES[mode] if gamma is None else gamma
    low = 2 if mode == "adaptive" else 1
    if not low <= gamma <= MAX_GAMMA:
        raise ValueError(f"--gamma must be in {low}..{MAX_GAMMA} with --draft-length {mode}, got {gamma}")
    return gamma


@dataclass(frozen=True)
class RoundCosts:
    """Time of a round that drafts and verifies ``k >= 1`` tokens, in plain decode steps:
    ``1 + fixed + per_token * k`` (a plain step costs 1)."""

    fixed: float
    per_token: float

    def __post_init__(self) -> None:
        for name in ("fixed", "per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"RoundCosts.{name} must be a finite number >= 0, got {value!r}")

    def of(self, k: int) -> float:
        """Cost of a round with ``k`` drafts (``k = 0``: a plain step)."""
        return 1.0 if k == 0 else 1.0 + self.fixed + self.per_token * k


class AdaptiveDraftLength:
    """Per-request draft length from a running acceptance-rate estimate and :class:`RoundCosts` (module docstring).

    Args:
        costs: the device's round costs (:func:`measure_round_costs`).
        decay: weight of the past per drafted round, in ``(0, 1)``; smaller forgets faster.
        prior_alpha: acceptance rate assumed before any round, in ``(0, 1)``; probes draft the length it implies.
        prior_weight: how many rounds' worth of evidence the prior counts for (``> 0``).
        probe_wait, max_probe_wait: plain steps before the first probe, and the most the doubling wait reaches
            (``1 <= probe_wait <= max_probe_wait``).

    :meth:`start` resets it for a decode of ``n`` requests; :meth:`choose` and :meth:`observe` are called once per
    request and round, in that order, by the loop (:func:`~dspark_kernels.engine.speculative.speculative_generate`).
    """

    def __init__(self, costs: RoundCosts, decay: float = 0.9, prior_alpha: float = 0.75, prior_weight: float = 4.0,
                 probe_wait: int = 4, max_probe_wait: int = 64) -> None:
        if not isinstance(costs, RoundCosts):
            raise TypeError(f"costs must be a RoundCosts, got {type(costs).__name__}")
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not 0 < prior_alpha < 1:
            raise ValueError(f"prior_alpha must be in (0, 1), got {prior_alpha!r}")
        if not (prior_weight > 0 and math.isfinite(prior_weight)):
            raise ValueError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        if not (isinstance(probe_wait, int) and isinstance(max_probe_wait, int) and 1 <= probe_wait <= max_probe_wait):
            raise ValueError(f"need ints 1 <= probe_wait <= max_probe_wait, got {probe_wait!r}, {max_probe_wait!r}")
        self.costs, self.decay, self.prior_alpha = costs, decay, prior_alpha
        self.prior = (prior_alpha * prior_weight, (1 - prior_alpha) * prior_weight)
        self.probe_wait, self.max_probe_wait = probe_wait, max_probe_wait
        self._accepted: list[float] = []
        self._rejected: list[float] = []
        self._wait: list[int] = []  # plain steps left before the next probe
        self._backoff: list[int] = []  # the wait set after the next unsuccessful probe
        self._probing: list[bool] = []
        self._gamma = 0

    def start(self, n: int) -> None:
        """Forget everything; ``n`` requests, each at the prior."""
        self._accepted = [self.prior[0]] * n
        self._rejected = [self.prior[1]] * n
        self._wait = [self.probe_wait] * n
        self._backoff = [self.probe_wait] * n
        self._probing = [False] * n

    def alpha(self, i: int) -> float:
        """Request ``i``'s current acceptance-rate estimate."""
        if not 0 <= i < len(self._accepted):
            raise IndexError(f"request {i} is not among the {len(self._accepted)} of the last start(n): call start "
                             "first")
        return self._accepted[i] / (self._accepted[i] + self._rejected[i])

    def best_length(self, alpha: float, gamma: int) -> int:
        """The ``k`` in ``0..gamma`` with the most expected tokens per cost at acceptance rate ``alpha`` (ties: the
        shorter)."""
        best_k, best_rate = 0, 1.0 / self.costs.of(0)
        tau, term = 1.0, 1.0
        for k in range(1, gamma + 1):
            term *= alpha
            tau += term
            rate = tau / self.costs.of(k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def choose(self, i: int, gamma: int) -> int:
        """Draft length in ``0..gamma`` for request ``i`` this round: the best length for its estimate, or, while
        that is 0, a probe once its wait is over: the prior's length, or the best length at acceptance 1 where the
        prior's is 0."""
        self._gamma = gamma
        k = self.best_length(self.alpha(i), gamma)
        self._probing[i] = k == 0 and self._wait[i] == 0
        if not self._probing[i]:
            return k
        return self.best_length(self.prior_alpha, gamma) or self.best_length(1.0, gamma)

    def observe(self, i: int, verified: int, accepted: int) -> None:
        """Request ``i``'s round (the one :meth:`choose` was last asked for) verified ``verified`` drafts and
        accepted the first ``accepted`` of them (``0 <= accepted <= verified``)."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"need 0 <= accepted <= verified, got accepted={accepted!r}, verified={verified!r}")
        if verified == 0:
            self._wait[i] = max(self._wait[i] - 1, 0)
            return
        d = self.decay
        self._accepted[i] = d * self._accepted[i] + accepted
        self._rejected[i] = d * self._rejected[i] + (1.0 if accepted < verified else 0.0)
        pays = self.best_length(self.alpha(i), self._gamma) > 0
        if self._probing[i]:  # a probe: drafting pays again (the next stop waits the least), or wait twice as long
            self._backoff[i] = self.probe_wait if pays else min(2 * self._backoff[i], self.max_probe_wait)
        if not pays:
            self._wait[i] = self._backoff[i]


def measure_round_costs(target: CausalLM, drafter: Drafter, prompt: Sequence[int], gamma: int,
                        repeats: int = 16) -> RoundCosts:
    """Time greedy rounds at batch 1 on ``prompt`` and fit :class:`RoundCosts` through them.

    Three decodes from the prompt, each with its own caches: plain decode steps, rounds of 1 draft and rounds of
    ``gamma`` drafts. Every round verifies all its drafts and keeps what the target accepts, so the next draft takes in
    a realistic context chunk. The three take turns, one round each, so a slow spell of the machine hits all three
    alike; each is timed by its fastest of ``repeats`` rounds after two warm-up rounds. ``prompt`` plus
    ``(repeats + 2) * (gamma + 1)`` tokens must fit the target's positions."""
    if not isinstance(gamma, int) or gamma < 2:
        raise ValueError(f"gamma must be an int >= 2 (two draft lengths are fitted), got {gamma!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    warmup = 2
    decodes = [_TimedDecode(target, drafter, list(prompt), k, warmup + repeats) for k in (0, 1, gamma)]
    seconds: list[list[float]] = [[] for _ in decodes]
    for _ in range(warmup + repeats):
        for decode, times in zip(decodes, seconds):
            times.append(decode.round())
    plain, one, full = (min(times[warmup:]) for times in seconds)
    per_token = max(full - one, 0.0) / (gamma - 1)
    return RoundCosts(fixed=max(one - per_token - plain, 0.0) / plain, per_token=per_token / plain)


class _TimedDecode:
    """A greedy batch-1 decode of ``prompt`` in rounds of ``k`` drafts (0: plain steps), with room for ``rounds``
    rounds; :meth:`round` runs the next one and returns its seconds; ``tokens`` holds the decoded tokens."""

    def __init__(self, target: CausalLM, drafter: Drafter, prompt: list[int], k: int, rounds: int) -> None:
        dev, page = target.device, 16
        pages = -(-(len(prompt) + rounds * (k + 1) + k + 1) // page)
        self.target, self.drafter, self.k, self.dev = target, drafter, k, dev
        self.tcache, self.dstate = target.new_cache(pages, page), drafter.new_state(pages, page)
        self.tcache.add_request(0)
        drafter.add_request(self.dstate, 0)
        self.samp = Sampling.of([0.0], [0], [1.0], [0], [0], dev)
        self.pending = PendingContext()
        self.anchor = prefill(target, drafter, self.tcache, self.dstate, [0], [prompt], self.samp,
                              defer=lambda kept: self.pending.add([0], kept))[0]
        self.tokens = [self.anchor]
        self.lens = torch.tensor([k], dtype=torch.int64, device=dev)

    def round(self) -> float:
        anchors = torch.tensor([self.anchor], dtype=torch.int64, device=self.dev)
        t0 = time.perf_counter()
        if self.k == 0:
            drafted = no_drafts(1, 1, self.dev)
        else:
            drafted = draft(self.drafter, self.dstate, [0], anchors, self.k, self.samp,
                            context=self.pending.take([0], self.dev))
        rnd = verify_round(self.target, self.drafter, self.tcache, [0], anchors, drafted, self.lens, max(self.k, 1),
                           self.samp)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        seconds = time.perf_counter() - t0
        self.pending.add([0], rnd.kept)
        self.tokens += rnd.emitted[0]
        self.anchor = self.tokens[-1]
        return seconds

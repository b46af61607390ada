"""Verify-length policies (perf-protocol §6, B0-B8): how many of its ``gamma`` drafts each live request verifies.

Every policy is used in two steps per round::

    lens = policy.choose(conf_logits, live, step)   # conf_logits [R, gamma] float32 or None -> lens [R] int64
    policy.observe(accepted, lens)                  # accepted [R]: drafts accepted this round (stateful policies)

after a one-time ``policy.bind(sps_profile, gamma, max_batch, draft_profile, narrow_draft_profile)`` that gives it
the SPS table (``SPSProfile.as_table`` up to ``max_batch * (gamma + 1)`` tokens: the target's verify steps/s by token
count B) and, optionally, the drafter's rounds/s by request count R at the full ``gamma`` slots (``draft_profile``, up
to ``max_batch`` requests) and at one slot (``narrow_draft_profile``). With a draft profile, a round of R requests
drafting ``w`` slots and verifying B tokens is modelled to take ``1 / SPS(B) + D(R, w)`` seconds
(:meth:`Policy.step_table`): the draft round grows with the batch like the verify forward does, and with the width.
``D(R, w)`` is linear in ``w`` between the two profiles' ``1 / DPS_1(R)`` and ``1 / DPS_gamma(R)``
(``1 / DPS_gamma(R)`` at every width without the narrow profile). Without a draft profile the draft round is taken as
free (a GPU, where it is a few percent of a step) or as already inside ``sps_profile``. ``live`` are the requests'
ids, ``step`` the engine's round counter. Lengths stay on the confidences' device.

Before drafting, the engine asks ``policy.drafts(live, step)``; when it says no, the round is a plain decode step (no
draft, verify length 0). ``none`` never drafts. When it drafts, ``policy.draft_width(live, step)`` says how many slots
(1..gamma) the drafter fills for every live request, and ``choose`` gets ``conf_logits [R, width]``: a fixed-k policy
drafts its ``k`` (what a fixed-k engine does; a sequential draft head pays for every slot), SmartSpec its batch ``k``,
and the DSpark policies a width planned at the running mean of their calibrated survival (the first round drafts
``gamma`` unless a prior gives the mean): the production variant and ``dspark_step`` the common drafting length that
the cost model rates best (:func:`best_common_length`), Algorithm 1 the width at which its own scan, run on live
requests that all have the mean survival, expects the most tokens/s (:func:`algorithm1_at_mean`; its early stop may
refuse the first token past a step of a staircase profile, which a common length would not see), within which it
shares the verify budget out per request. Each round's choice reads its drafted width's cost (the slots are drafted by
then); the width is where the draft's cost is decided (a draft slot of one request costs 0.19 ms on this repository's
CPU, a verified token 0.05 ms). The width depends on earlier rounds only. The threshold rule drafts ``gamma``: it stays
a per-request policy. The gated DSpark policies (``dspark+gate``, ``dspark_step+gate``, ``dspark_prod+gate``) draft only
when drafting is expected to pay: the round's rate with the draft round of the live requests included against the
target's plain rate, with the expected accepted length from the running mean of the calibrated survival of earlier
drafted rounds at the width they plan (:func:`drafting_gain` > 1; for Algorithm 1 the rate where its scan stops). That
mean starts from a prior when one is given (``prior_survival``: the drafter's held-out mean survival from its
calibration), else from the first round, which then drafts to measure it.
While the gate is closed it still probes (drafts) after ``GATE_PROBE`` steps to refresh the mean, doubling the wait
after each unprofitable probe up to ``GATE_PROBE_MAX``, and waiting ``GATE_PROBE_MAX`` at once while not even the best
outcome of the next probe could open it (every drafted position surviving, folded into the mean at the weight the
next round gets: a probe costs a losing round and the backlog's intake, and one that cannot change the decision is
not worth them); the first measurement (the prior, or the first round) counts as a probe. An engine built with a clock
(``Engine(..., clock=time.perf_counter)``) also reports every round's wall time (``policy.observe_round``); once it
has timed both a drafted round and a plain step at the live request count (running means), the gate compares their
measured times with the expected tokens from the running mean survival instead of the modelled rates, because the
profiles leave out the engine's own work around a round (sampling, bookkeeping, a drafter whose caches the target
forward evicted). The engine keeps the committed tokens for the drafter's context until the next drafting round takes
them in, so a closed gate costs no drafter work at all. On a GPU the draft round is a few percent of a step and the
gate stays open; where drafting costs about a decode step (this repository's CPU) it is what keeps speculation from
falling below plain decoding.

Lossless policies only look at information available before the draft they decide on is verified: confidences
``c_j`` depend on the drafts before ``j`` only, Algorithm 1 stops at the first non-improving slot (the step-aware
stop at the first whose outlook, read from its own survival and the slots ranked before it, does not improve), the
production capacity comes from confidences two rounds old, SmartSpec/EMA state and the draft gate come from earlier
rounds.
``oracle`` reads the realised accepted count (``choose(..., realised=...)``): it is for the replay simulator only.

Names (:func:`make_policy`): ``none``, ``mtp1``, ``fixed<k>`` (k in 1, 3, 5, 7, 15, capped at gamma),
``threshold<t>`` (e.g. ``threshold0.5``), ``smartspec``, ``dspark``, ``dspark_step`` (Algorithm 1 with the
step-aware stop), ``dspark_prod``, ``dspark+gate``, ``dspark_step+gate``, ``dspark_prod+gate`` (the live engine, or
a replay given draft-round profiles), ``oracle`` (replay only).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..ops.survival import (
    capacity_unconstrained,
    prefix_survival,
    select_verify_lengths_alg1,
    select_verify_lengths_topk,
)

if TYPE_CHECKING:  # annotations only: importing the package must not import sps (its CLI runs as __main__)
    from .sps import SPSProfile

__all__ = ["DSpark", "DSparkProd", "DSparkStep", "FixedK", "Oracle", "Policy", "PolicyError", "SmartSpec", "Threshold",
           "algorithm1_at_mean", "best_common_length", "drafting_gain", "make_policy", "step_time_convex",
           "GATED_POLICY_NAMES", "POLICY_NAMES"]

FIXED_KS = (1, 3, 5, 7, 15)
POLICY_NAMES = ("none", "mtp1", *(f"fixed{k}" for k in FIXED_KS), "threshold0.5", "smartspec", "dspark",
                "dspark_step", "dspark_prod", "oracle")
GATED_POLICY_NAMES = ("dspark+gate", "dspark_step+gate", "dspark_prod+gate")
CONVEX_RTOL = 1e-6  # a float32 rate carries ~6e-8 relative rounding, so the second differences of an affine step time
# read back from one sit within a few 1e-7 of it, below zero as often as above


def step_time_convex(rates: torch.Tensor, start: int) -> bool:
    """Whether the step time ``1 / rates[B]`` (``rates [Bmax + 1]``, rounds/s by verified tokens B, index B) is
    convex in B over ``start..Bmax``: every second difference ``t(B - 1) - 2 t(B) + t(B + 1) >= -CONVEX_RTOL t(B)``,
    so a float32 table of an affine or convex cost (the modelled roofline, a constant draft round added) passes and a
    staircase or a fitted profile's flat runs do not. On such a table the step-aware stop is Algorithm 1 (see
    ``ops.survival``), which :class:`DSparkStep` then runs: one outlook term a candidate instead of a window."""
    t = 1.0 / rates[start:].double()
    if t.numel() < 3:
        return True
    return bool((t[:-2] - 2 * t[1:-1] + t[2:] >= -CONVEX_RTOL * t[1:-1]).all())


def best_common_length(mean_survival: Sequence[float], r: int, rate: Callable[[int], Sequence[float]],
                       min_length: int = 0) -> tuple[int, float]:
    """The common verify length ``k`` (``min_length``..len(mean_survival)) of ``r`` requests with the most expected
    tokens/s, and that rate: ``r * (1 + sum_{j <= k} a_j) * rate(k)[r (1 + k)]``, where ``rate(k)`` is the table of
    rounds/s by verified tokens (a 1-D tensor or a list) for a round that drafted ``k`` slots (``k = 0``: a plain
    step). Lengths whose ``r (1 + k)`` tokens pass the table's end are left out; ``(min_length, 0.0)`` when every
    length is."""
    expected, best = 1.0, (min_length, 0.0)
    for k in range(len(mean_survival) + 1):
        expected += float(mean_survival[k - 1]) if k else 0.0
        table = rate(k)
        if r * (1 + k) > len(table) - 1:
            break
        tokens_per_s = r * expected * float(table[r * (1 + k)])
        if k >= min_length and tokens_per_s > best[1]:
            best = (k, tokens_per_s)
    return best


def drafting_gain(mean_survival: Sequence[float], r: int, rate: Callable[[int], Sequence[float]]) -> float:
    """How much faster drafting is expected to be than a plain decode step for ``r`` requests (> 1: it pays): the best
    rate of :func:`best_common_length` over drafting lengths ``k >= 1``, over the plain step's ``r * rate(0)[r]``."""
    return best_common_length(mean_survival, r, rate, min_length=1)[1] / (r * float(rate(0)[r]))


def algorithm1_at_mean(mean_survival: Sequence[float], r: int, rates: Sequence[float]) -> tuple[float, float]:
    """Algorithm 1's scan for ``r`` requests whose drafts all have the prefix survival ``mean_survival [w]``: the
    expected tokens of the round (``r`` plus the admitted survivals) where it stops, and its tokens/s there
    (``tokens * rates[B]``, ``rates`` the rounds/s by verified tokens B). Equal requests' candidates rank position by
    position, so the scan admits whole positions and then part of one; like the op it stops at the first candidate
    that does not raise the rate, at a zero survival, or where B passes the table. On a staircase profile (a bf16
    GEMM's 16-row tiles) that can be the first candidate past a step, however much the step's other rows would pay:
    the common length of :func:`best_common_length` does not see that stop."""
    b, tokens = r, float(r)
    best = tokens * float(rates[b])
    for a in mean_survival:
        for _ in range(r):
            if a <= 0 or b + 1 > len(rates) - 1:
                return tokens, best
            rate = (tokens + a) * float(rates[b + 1])
            if rate <= best:
                return tokens, best
            b, tokens, best = b + 1, tokens + a, rate
    return tokens, best


class PolicyError(ValueError):
    """A policy used outside its contract (a width outside the block, a drafter without the confidence head it
    needs): raised by the engine's step, not taken for a fault that fails the round's requests."""


class Policy:
    """Base class: binding to the SPS profile, input checks, and the no-op ``observe``."""

    name = "policy"
    needs_confidence = False
    replay_only = False
    draft_table: torch.Tensor | None = None

    def bind(self, profile: SPSProfile, gamma: int, max_batch: int, draft_profile: SPSProfile | None = None,
             narrow_draft_profile: SPSProfile | None = None) -> None:
        """Take the SPS table ``[Bmax + 1]`` for up to ``max_batch * (gamma + 1)`` tokens and, when given, the draft
        tables ``[max_batch + 1]`` of ``draft_profile`` (rounds/s by request count at ``gamma`` slots) and
        ``narrow_draft_profile`` (the same at one slot; only with ``draft_profile``); ``ValueError`` when a profile
        does not reach ``max_batch`` (tokens for the SPS profile, one per request; requests for the draft ones)."""
        if not isinstance(gamma, int) or gamma < 1 or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"gamma and max_batch must be ints >= 1, got {gamma!r}, {max_batch!r}")
        if narrow_draft_profile is not None and draft_profile is None:
            raise ValueError("narrow_draft_profile (draft rounds at one slot) needs draft_profile (at gamma slots) "
                             "to interpolate between")
        tables = [(p, p.as_table(max_batch * (gamma + 1) if p is profile else max_batch), unit)
                  for p, unit in ((profile, "tokens"), (draft_profile, "requests"), (narrow_draft_profile, "requests"))
                  if p is not None]
        for p, table, unit in tables:
            if table.numel() - 1 < max_batch:
                raise ValueError(f"SPS profile {p.device}/{p.model} is measured up to B = {table.numel() - 1} {unit},"
                                 f" fewer than the {max_batch} requests of a full batch")
        self.sps_table, self.gamma = tables[0][1], gamma
        self.draft_table = tables[1][1] if draft_profile is not None else None
        self.narrow_draft_table = tables[2][1] if narrow_draft_profile is not None else None
        self._step_tables: dict[tuple[int, int], torch.Tensor] = {}
        self._step_lists: dict[tuple[int, int], list[float]] = {}
        self._convex: dict[tuple[int, int], bool] = {}

    def draft_seconds(self, r: int, width: int) -> float:
        """Modelled seconds of a draft round of ``r`` requests at ``width`` slots (``D(r, w)``, module docstring; 0
        at width 0, and at every width without a draft profile)."""
        if self.draft_table is None or width == 0:
            return 0.0
        full = 1.0 / float(self.draft_table[r])
        if self.narrow_draft_table is None or self.gamma == 1:
            return full
        narrow = 1.0 / float(self.narrow_draft_table[r])
        return narrow + (width - 1) / (self.gamma - 1) * (full - narrow)

    def step_table(self, r: int, width: int | None = None) -> torch.Tensor:
        """Rounds/s of ``r`` requests by verified tokens B (index B) when the round drafted ``width`` slots (None:
        gamma; 0: a plain step): ``1 / (1 / SPS(B) + D(r, width))``; the SPS table itself without a draft profile."""
        width = self.gamma if width is None else width
        if self.draft_table is None or width == 0:
            return self.sps_table
        table = self._step_tables.get((r, width))
        if table is None:
            table = self._step_tables[r, width] = 1.0 / (1.0 / self.sps_table + self.draft_seconds(r, width))
        return table

    def step_rates(self, r: int, width: int | None = None) -> list[float]:
        """:meth:`step_table` as a list of floats, kept per ``(r, width)``: the scans that read a few entries of it
        every round (:func:`best_common_length`) index a list in well under a microsecond, a tensor in a few."""
        key = (r, self.gamma if width is None else width)
        rates = self._step_lists.get(key)
        if rates is None:
            rates = self._step_lists[key] = self.step_table(r, width).tolist()
        return rates

    def convex_step_time(self, r: int, width: int) -> bool:
        """:func:`step_time_convex` of :meth:`step_table` from B = ``r`` on, kept per ``(r, width)``."""
        convex = self._convex.get((r, width))
        if convex is None:
            convex = self._convex[r, width] = step_time_convex(self.step_table(r, width), r)
        return convex

    def drafts(self, live: Sequence, step: int) -> bool:
        """Whether the engine should draft this round (False: a plain decode step). Default: always."""
        return True

    def draft_width(self, live: Sequence, step: int) -> int:
        """How many draft slots (1..gamma) every live request gets this round (asked after :meth:`drafts` said yes).
        Default: gamma."""
        return self.gamma

    def _confidence(self, conf_logits: torch.Tensor | None, r: int) -> torch.Tensor:
        if conf_logits is None:
            raise PolicyError(f"policy {self.name!r} needs a drafter with a confidence head (got no confidences)")
        if conf_logits.dim() != 2 or conf_logits.shape[0] != r or not 1 <= conf_logits.shape[1] <= self.gamma:
            raise ValueError(f"conf_logits must be [R, width] with R = {r} and width in 1..gamma = {self.gamma}, got "
                             f"{list(conf_logits.shape)}")
        if not bool(torch.isfinite(conf_logits).all()):
            raise ValueError(f"policy {self.name!r}: confidence logits contain NaN or inf")
        return conf_logits.float()

    def choose(self, conf_logits: torch.Tensor | None, live: Sequence, step: int,
               realised: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, accepted: torch.Tensor, verify_lens: torch.Tensor) -> None:
        """Feed back the round's accepted drafts ``[R]`` for the verify lengths ``[R]`` (no-op by default)."""

    def observe_round(self, r: int, drafted: bool, seconds: float) -> None:
        """Feed back a round's wall time with ``r`` live requests, drafted or a plain step (from an engine with a
        clock; no-op by default)."""

    def foresee(self, realised: torch.Tensor) -> None:
        """Replay only, before :meth:`drafts`: the round's realised accepted drafts ``[R]`` at full width. Only the
        oracle reads them (no-op by default)."""


def _device(conf_logits: torch.Tensor | None) -> torch.device:
    return conf_logits.device if conf_logits is not None else torch.device("cpu")


class FixedK(Policy):
    """B0/B1: the same ``k`` (capped at gamma) for every request; ``none`` is k = 0, ``mtp1`` k = 1."""

    def __init__(self, k: int, name: str | None = None) -> None:
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an int >= 0, got {k!r}")
        self.k, self.name = k, name or f"fixed{k}"

    def choose(self, conf_logits, live, step, realised=None):
        return torch.full((len(live),), min(self.k, self.gamma), dtype=torch.int64, device=_device(conf_logits))

    def drafts(self, live, step):
        return self.k > 0

    def draft_width(self, live, step):
        return min(self.k, self.gamma)


def _calibrated(conf: torch.Tensor, temperatures: torch.Tensor | None, biases: torch.Tensor | None
                ) -> torch.Tensor:
    """Per-position confidences ``c [R, gamma] = sigmoid(logit / T[j] + b[j])`` (T = 1, b = 0 where None)."""
    width = conf.shape[1]
    if temperatures is not None:
        conf = conf / temperatures.to(conf.device)[:width]
    if biases is not None:
        conf = conf + biases.to(conf.device)[:width]
    return torch.sigmoid(conf)


def _survival(conf: torch.Tensor, temperatures: torch.Tensor | None, biases: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened calibrated prefix survival ``[R * gamma]`` and its offsets ``cu [R + 1]``."""
    r, gamma = conf.shape
    cu = torch.arange(0, (r + 1) * gamma, gamma, dtype=torch.int32, device=conf.device)
    temps = None if temperatures is None else temperatures.to(conf.device)
    bias = None if biases is None else biases.to(conf.device)
    return prefix_survival(conf.reshape(-1), cu, temps, bias, check_inputs=False), cu


class _Confident(Policy):
    """A policy that reads the calibrated confidences (``temperatures [>= gamma]`` and ``biases [>= gamma]`` of
    ``train.calibration``, None = 1 and 0: uncalibrated); ``gate=True`` adds the draft gate (module docstring),
    which needs the engine's ``draft_profile``."""

    needs_confidence = True
    GATE_EMA = 0.1  # weight of the newest drafted round in the running mean survival (without a prior, the plain
    # mean of the rounds until this weight is reached)
    GATE_PROBE = 8  # once closed, the gate still drafts (probes) after this many steps ...
    GATE_PROBE_MAX = 256  # ... doubling the wait after each probe that finds drafting still unprofitable, up to this
    # (at once while the next probe's best outcome would leave the gate closed)
    GATE_TIME_EMA = 0.2  # weight of the newest round in the measured seconds of drafted rounds and of plain steps

    def __init__(self, temperatures: torch.Tensor | None = None, gate: bool = False,
                 prior_survival: Sequence[float] | None = None, biases: torch.Tensor | None = None) -> None:
        if temperatures is not None:
            temperatures = torch.as_tensor(temperatures, dtype=torch.float32)
            if temperatures.dim() != 1 or not bool(torch.isfinite(temperatures).all() & (temperatures > 0).all()):
                raise ValueError(f"temperatures must be a 1-D tensor of positive finite values, got {temperatures}")
        if biases is not None:
            biases = torch.as_tensor(biases, dtype=torch.float32)
            if biases.dim() != 1 or not bool(torch.isfinite(biases).all()):
                raise ValueError(f"biases must be a 1-D tensor of finite values, got {biases}")
        if prior_survival is not None:
            prior_survival = [float(a) for a in prior_survival]
            if not all(0 <= a <= 1 for a in prior_survival):
                raise ValueError(f"prior_survival must hold probabilities in [0, 1], got {prior_survival}")
        self.temperatures, self.biases, self.gate = temperatures, biases, gate
        if gate:
            self.name += "+gate"
        # the running mean survival per position, which the width rule and the gate read (a host copy: the gate reads
        # it every step); a prior (the drafter's held-out mean) stands in for it until the first drafted round
        self._mean_survival: list[float] | None = prior_survival
        self._has_prior = prior_survival is not None
        self._drafted_rounds = 0
        self._last_drafted = 0
        self._probe_wait: int | None = None  # steps from the last drafted round to the next probe (None: not yet set)
        self._probed = False  # the last drafted round was a probe whose outcome has not set the next wait yet
        self._seconds: dict[tuple[int, bool], float] = {}  # measured seconds per round by (live requests, drafted)
        self._plans: dict[int, tuple[int, float, float]] = {}  # :meth:`_plan` by live request count, current mean

    def bind(self, profile, gamma, max_batch, draft_profile=None, narrow_draft_profile=None):
        super().bind(profile, gamma, max_batch, draft_profile, narrow_draft_profile)
        for name, values in (("temperatures", self.temperatures), ("biases", self.biases)):
            if values is not None and values.numel() < gamma:
                raise ValueError(f"{values.numel()} calibration {name} for gamma = {gamma}")
        if self._mean_survival is not None:
            if len(self._mean_survival) < gamma:
                raise ValueError(f"{len(self._mean_survival)} prior survival values for gamma = {gamma}")
            self._mean_survival = self._mean_survival[:gamma]  # a measured mean has gamma positions too
        if self.gate and draft_profile is None:
            raise ValueError(f"policy {self.name!r} needs the drafter's draft-round profile "
                             "(Engine(draft_profile=...)) to know what a draft round costs")
        self._seconds, self._plans = {}, {}

    def draft_width(self, live, step):
        """The drafting length (1..gamma) of :meth:`_plan` for the live requests at the running mean survival;
        ``gamma`` while there is no mean (no prior, no round)."""
        return self.gamma if self._mean_survival is None else self._width_for(len(live))

    def _plan(self, r: int, mean_survival: Sequence[float]) -> tuple[int, float, float]:
        """What a drafting round of ``r`` live requests is expected to do when every request's drafts survive as
        ``mean_survival``: its draft width (1..gamma), the tokens a request emits, and the modelled gain over a plain
        step. Here the common length :func:`best_common_length` rates best (the production variant verifies about
        as many tokens as that length's rate pays for) and :func:`drafting_gain`."""
        rate = lambda k: self.step_rates(r, k)  # noqa: E731
        k = best_common_length(mean_survival, r, rate, min_length=1)[0]
        return k, 1.0 + sum(mean_survival[:k]), drafting_gain(mean_survival, r, rate)

    def _current_plan(self, r: int) -> tuple[int, float, float]:
        """:meth:`_plan` at the running mean survival (kept until the mean moves)."""
        plan = self._plans.get(r)
        if plan is None:
            plan = self._plans[r] = self._plan(r, self._mean_survival)
        return plan

    def _width_for(self, r: int) -> int:
        """:meth:`draft_width` for ``r`` live requests."""
        return self._current_plan(r)[0]

    def observe_round(self, r, drafted, seconds):
        if not self.gate or seconds <= 0:
            return
        old = self._seconds.get((r, drafted))
        self._seconds[r, drafted] = seconds if old is None else (1 - self.GATE_TIME_EMA) * old + \
            self.GATE_TIME_EMA * seconds

    def gain(self, r: int) -> float:
        """Expected tokens/s of drafting over a plain step's with ``r`` live requests at the running mean survival
        (:meth:`_gain_at`)."""
        return self._gain_at(r, self._mean_survival)

    def _gain_at(self, r: int, mean_survival: Sequence[float]) -> float:
        """:meth:`gain` at ``mean_survival``. Once both a drafted round and a plain step of ``r`` requests have been
        timed (:meth:`observe_round`): ``E[tokens] * t_plain / t_drafted``, with the tokens a request is expected to
        emit from :meth:`_plan` (a round's time varies little, its emitted tokens a lot: a few unlucky rounds must
        not close the gate); until then the plan's modelled gain."""
        plan = self._current_plan(r) if mean_survival is self._mean_survival else self._plan(r, mean_survival)
        drafted, plain = self._seconds.get((r, True)), self._seconds.get((r, False))
        if drafted is not None and plain is not None:
            return plan[1] * plain / drafted
        return plan[2]

    def _best_gain_after_probe(self, r: int) -> float:
        """:meth:`gain` with the next drafted round's best outcome folded in: survival 1 at every position, at the
        weight :meth:`_remember` would give it."""
        w = self._next_weight()
        return self._gain_at(r, [(1 - w) * a + w for a in self._mean_survival])

    def drafts(self, live, step):
        if not self.gate or self._mean_survival is None:
            return True
        r = len(live)
        if self.gain(r) > 1:
            self._probe_wait, self._probed = self.GATE_PROBE, False
            return True
        if self._probe_wait is None:  # the first drafted round, or else the prior, counts as the first probe
            if not self._drafted_rounds:
                self._last_drafted = step
            self._probe_wait = self._next_wait(r)
            return False
        if self._probed:  # the first decision after a probe sets the next wait from what it measured
            self._probe_wait, self._probed = self._next_wait(r), False
        if step - self._last_drafted >= self._probe_wait:
            self._probed = True
            return True
        return False

    def _next_wait(self, r: int) -> int:
        """The wait after a probe (or the prior) found drafting unprofitable for ``r`` live requests: the longest at
        once while not even the next probe's best outcome would open the gate, else double the last wait (the first
        wait is ``GATE_PROBE``)."""
        if self._best_gain_after_probe(r) <= 1:
            return self.GATE_PROBE_MAX
        return self.GATE_PROBE if self._probe_wait is None else min(2 * self._probe_wait, self.GATE_PROBE_MAX)

    def _round_inputs(self, conf_logits: torch.Tensor | None, live: Sequence, step: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's calibrated prefix survival ``a [R * width]``, its offsets ``cu [R + 1]`` and the step table
        of ``R`` live requests at the drafted width on ``a``'s device; the running mean takes ``a`` in."""
        conf = self._confidence(conf_logits, len(live))
        a, cu = _survival(conf, self.temperatures, self.biases)
        self._remember(a, len(live), conf.shape[1], step)
        return a, cu, self.step_table(len(live), conf.shape[1]).to(a.device)

    def _remember(self, a: torch.Tensor, r: int, width: int, step: int) -> None:
        """Fold this drafted round's survival ``a [R * width]`` into the running mean of its first ``width``
        positions (later positions keep their earlier mean): weight ``GATE_EMA`` from the first round when a prior
        (the held-out mean over thousands of rounds) started it, else the plain mean of the rounds until then."""
        mean = a.view(r, width).mean(dim=0).tolist()  # one read per drafted round, not per step
        w = self._next_weight()
        self._drafted_rounds += 1
        old = self._mean_survival or mean + [0.0] * (self.gamma - width)
        self._mean_survival = [(1 - w) * o + w * m for o, m in zip(old, mean)] + old[width:]
        self._plans = {}
        self._last_drafted = step

    def _next_weight(self) -> float:
        """The weight the next drafted round gets in the running mean survival (:meth:`_remember`)."""
        return self.GATE_EMA if self._has_prior else max(1.0 / (self._drafted_rounds + 1), self.GATE_EMA)


class Threshold(_Confident):
    """B4-style static rule: verify up to (not including) the first position whose calibrated ``c_j < t``."""

    def __init__(self, t: float, temperatures: torch.Tensor | None = None, biases: torch.Tensor | None = None
                 ) -> None:
        super().__init__(temperatures, biases=biases)
        if not 0 <= t <= 1:
            raise ValueError(f"threshold must lie in [0, 1], got {t}")
        self.t, self.name = t, f"threshold{t:g}"

    def draft_width(self, live, step):
        return self.gamma  # a per-request rule: any request may verify all gamma drafts

    def choose(self, conf_logits, live, step, realised=None):
        c = _calibrated(self._confidence(conf_logits, len(live)), self.temperatures, self.biases)
        return (c >= self.t).long().cumprod(dim=1).sum(dim=1)


class DSpark(_Confident):
    """B7: Algorithm 1 (greedy with early stop) on the calibrated prefix survival and the SPS table."""

    name = "dspark"

    def _plan(self, r, mean_survival):
        """The width whose Algorithm 1 scan (:func:`algorithm1_at_mean`) expects the most tokens/s, so that the
        width rule and the gate plan for what :meth:`choose` will verify (ties: the narrower width)."""
        plain = r * float(self.step_rates(r, 0)[r])
        best = (1, 1.0, 0.0)
        for w in range(1, len(mean_survival) + 1):
            tokens, rate = algorithm1_at_mean(mean_survival[:w], r, self.step_rates(r, w))
            if rate > best[2]:
                best = (w, tokens / r, rate)
        return best[0], best[1], best[2] / plain

    def choose(self, conf_logits, live, step, realised=None):
        a, cu, table = self._round_inputs(conf_logits, live, step)
        return select_verify_lengths_alg1(a, cu, table, check_inputs=False).long()


class DSparkStep(_Confident):
    """B7s: Algorithm 1 with the step-aware stop (``select_verify_lengths_alg1(..., lookahead=N)``): a candidate
    that does not raise Theta is still admitted while the next candidates, were they as good as it, would lift
    Theta above the best point so far. On a staircase SPS profile (a bf16 GEMM's 16-row tiles) it crosses a step
    the round's drafts can pay for, where Algorithm 1 stops at the step's first row; on a profile whose step time is
    convex in B it is Algorithm 1. Its width and gate plan with the common length (:func:`best_common_length`), the
    point its scan reaches on equal requests once it crosses the steps. Where the round's step time is convex from
    B = R on (:meth:`Policy.convex_step_time`, checked once per request count and width) it calls Algorithm 1
    itself (lookahead 1), whose first-drop kernel reads one term a candidate."""

    name = "dspark_step"

    def choose(self, conf_logits, live, step, realised=None):
        a, cu, table = self._round_inputs(conf_logits, live, step)
        lookahead = 1 if self.convex_step_time(len(live), conf_logits.shape[1]) else table.numel()
        return select_verify_lengths_alg1(a, cu, table, lookahead=lookahead, check_inputs=False).long()


class DSparkProd(_Confident):
    """B7p: capacity K from the survivals of two rounds ago (global search, no early stop), then the live top-K.

    Until two earlier rounds exist (engine start-up) the round uses Algorithm 1 instead, which is lossless on its
    own. The stale batch may hold other requests than the live one: K is a number of draft slots, fixed before the
    live drafts exist, which is all losslessness needs (see ``ops.survival.capacity_unconstrained``).
    """

    name = "dspark_prod"
    STALENESS = 2

    def __init__(self, temperatures: torch.Tensor | None = None, gate: bool = False,
                 prior_survival: Sequence[float] | None = None, biases: torch.Tensor | None = None) -> None:
        super().__init__(temperatures, gate, prior_survival, biases)
        self._history: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=self.STALENESS)

    def choose(self, conf_logits, live, step, realised=None):
        a, cu, table = self._round_inputs(conf_logits, live, step)
        if len(self._history) < self.STALENESS:
            lens = select_verify_lengths_alg1(a, cu, table, check_inputs=False)
        else:
            stale_a, stale_cu = self._history[0]
            k = capacity_unconstrained(stale_a, stale_cu, table, check_inputs=False)
            lens = select_verify_lengths_topk(a, cu, k, check_inputs=False)
        self._history.append((a, cu))
        return lens.long()


class SmartSpec(Policy):
    """B3: one k for the whole batch, ``argmax_k R * tau(alpha, k) * SPS(R (1 + k))`` with the i.i.d. closed form
    ``tau = (1 - alpha^(k+1)) / (1 - alpha)`` (with a draft profile, the rate of a round drafting k slots,
    :meth:`Policy.step_table`; k = 0 is a plain step); k enumerated upward from 0 and stopped at the first drop,
    G(0) x 1.1; re-decided every ``period`` rounds. ``alpha`` is an EMA (weight ``ema``) of the realised per-token
    acceptance ``accepted / accept tests`` (a request verifying l drafts and accepting a ran ``a + [a < l]`` tests)."""

    name = "smartspec"

    def __init__(self, alpha0: float = 0.7, ema: float = 0.1, period: int = 20, prior: float = 1.1) -> None:
        self.alpha, self.ema, self.period, self.prior = alpha0, ema, period, prior
        self._k: int | None = None
        self._step: int | None = None  # the step k was last updated for
        self._alpha_dev: torch.Tensor | None = None

    def _decide(self, r: int) -> int:
        best_k, best = 0, self.prior * r * float(self.sps_table[r])  # k = 0: a plain step
        for k in range(1, self.gamma + 1):
            table = self.step_table(r, k)  # a round that drafts k slots
            if r * (1 + k) > table.numel() - 1:
                break
            tau = float(k + 1) if self.alpha >= 1 else (1 - self.alpha ** (k + 1)) / (1 - self.alpha)
            g = r * tau * float(table[r * (1 + k)])
            if g <= best:
                break
            best_k, best = k, g
        return best_k

    def _update(self, live: Sequence, step: int) -> None:
        """Re-decide ``k`` at the first call of every ``period``-th step (and at the first step)."""
        if self._step == step:
            return
        self._step = step
        if self._k is None or step % self.period == 0:
            if self._alpha_dev is not None:
                self.alpha = float(self._alpha_dev)
            self._k = self._decide(len(live))

    def drafts(self, live, step):
        """The batch's ``k`` is decided before the draft (the live engine asks here first): ``k = 0`` is a plain
        step, otherwise ``k`` slots are drafted."""
        self._update(live, step)
        return self._k > 0

    def draft_width(self, live, step):
        return self._k

    def choose(self, conf_logits, live, step, realised=None):
        self._update(live, step)  # the replay asks here only
        return torch.full((len(live),), self._k, dtype=torch.int64, device=_device(conf_logits))

    def observe(self, accepted, verify_lens):
        acc = accepted.double()
        tests = acc + (accepted < verify_lens.to(accepted.device)).double()
        total = tests.sum()
        rate = torch.where(total > 0, acc.sum() / total.clamp(min=1), torch.tensor(self.alpha, dtype=torch.float64))
        prev = self._alpha_dev if self._alpha_dev is not None else torch.tensor(self.alpha, dtype=torch.float64)
        prev = prev.to(rate.device)
        self._alpha_dev = torch.where(total > 0, (1 - self.ema) * prev + self.ema * rate, prev)


class Oracle(Policy):
    """B8 (replay only): verify exactly the realised accepted drafts (``realised [R]``, the full-gamma outcome).

    With a draft profile the oracle also plans each round's draft knowing its outcome (:meth:`foresee`): among a plain
    step and the widths ``w = 1 ..`` the longest accepted run, it takes the one with the most ``tokens - rate x
    seconds`` at its running system rate (tokens a round ``R + sum_r min(a_r, w)``, seconds ``1 / SPS(tokens) +
    D(R, w)``), the per-round step of maximising the run's tokens/s (Dinkelbach)."""

    name = "oracle"
    replay_only = True

    def bind(self, profile, gamma, max_batch, draft_profile=None, narrow_draft_profile=None):
        super().bind(profile, gamma, max_batch, draft_profile, narrow_draft_profile)
        self._width, self._tokens, self._seconds = gamma, 0, 0.0

    def foresee(self, realised):
        r = realised.numel()
        rate = self._tokens / self._seconds if self._seconds > 0 else r * float(self.sps_table[r])
        best = -math.inf
        for w in range(min(int(realised.max()), self.gamma) + 1 if r else 1):
            tokens = r + int(realised.clamp(max=w).sum())
            gain = tokens - rate * (1.0 / float(self.sps_table[tokens]) + self.draft_seconds(r, w))
            if gain > best:
                best, self._width = gain, w

    def drafts(self, live, step):
        return self._width > 0

    def draft_width(self, live, step):
        return self._width

    def choose(self, conf_logits, live, step, realised=None):
        if realised is None:
            raise ValueError("the oracle policy needs the realised accepted counts: it runs in replay only")
        return realised.long().clamp(max=self.gamma)

    def observe(self, accepted, verify_lens):
        self._tokens += accepted.numel() + int(accepted.sum())

    def observe_round(self, r, drafted, seconds):
        self._seconds += seconds


def make_policy(name: str, temperatures: torch.Tensor | None = None,
                prior_survival: Sequence[float] | None = None, biases: torch.Tensor | None = None) -> Policy:
    """A policy by name (see the module docstring); ``temperatures`` and ``biases``: the confidence calibration
    of the confidence policies (``train.calibration.load_temperatures`` / ``load_biases``);
    ``prior_survival [>= gamma]``: the drafter's held-out mean calibrated survival per position
    (``train.calibration.load_mean_survival``), the draft gate's starting point (DSpark policies only; without it
    the gate drafts its first round to measure). ``train.calibration.load_calibration(path, gamma).policy_args()``
    gives all three from a drafter's ``calibration.json``."""
    if name == "none":
        return FixedK(0, "none")
    if name == "mtp1":
        return FixedK(1, "mtp1")
    if name.startswith("fixed") and name[5:].isdigit():
        return FixedK(int(name[5:]))
    if name.startswith("threshold"):
        try:
            t = float(name[9:])
        except ValueError:
            raise ValueError(f"threshold policy needs a value, e.g. 'threshold0.5', got {name!r}") from None
        return Threshold(t, temperatures, biases)
    simple = {"smartspec": SmartSpec, "oracle": Oracle}
    if name in simple:
        return simple[name]()
    base, gated = name.removesuffix("+gate"), name.endswith("+gate")
    if base == "dspark":
        return DSpark(temperatures, gate=gated, prior_survival=prior_survival, biases=biases)
    if base == "dspark_step":
        return DSparkStep(temperatures, gate=gated, prior_survival=prior_survival, biases=biases)
    if base == "dspark_prod":
        return DSparkProd(temperatures, gate=gated, prior_survival=prior_survival, biases=biases)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES + GATED_POLICY_NAMES)}")

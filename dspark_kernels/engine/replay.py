"""Policy replay: simulate verify-length policies on recorded traces against an SPS profile, without the model.

Traces come from :func:`speculative_generate(..., record_traces=True)` (full-gamma verification): per request and
round the confidence logits ``[gamma]`` and the accepted drafts ``a``. Verifying only ``l`` drafts of that round
would have accepted ``min(a, l)`` (same drafts, same uniforms), then emitted one correction/bonus token.

Closed loop at concurrency C: C slots each run a request drawn (seeded, with replacement) from the traces; its token
budget is the trace's emitted tokens, and simulated step s of the slot replays the slot's trace round ``s mod
rounds`` (a shorter verify emits fewer tokens, so a request can need more rounds than were recorded; the rounds are
reused in order: an approximation, since the real continuation would differ). Per step the policy chooses ``l_r``
for the live slots, the step takes ``1 / SPS(B)`` seconds with ``B = sum_r (1 + l_r)`` (a B beyond the profile's last
size Bmax is extrapolated compute-bound, ``t(Bmax) * B / Bmax``), and each request emits ``min(a_r, l_r) + 1`` tokens. A
finished request is replaced at once; the run stops when ``num_requests`` requests have finished. Prefill time is not
modelled.

Draft time: without a draft profile drafting is free and every round drafts ``gamma`` slots. With the drafter's
draft-round profiles (``draft_profile`` at ``gamma`` slots, optionally ``narrow_draft_profile`` at one: the engine's
``D(R, w)``, :meth:`Policy.draft_seconds`) each step runs as the engine's round does: the policy says whether it drafts
(:meth:`Policy.drafts`; else a plain step of ``R`` tokens, nothing verified) and at which width ``w``
(:meth:`Policy.draft_width`; ``choose`` gets the first ``w`` confidences, and a request accepts ``min(a_r, w)``), and
the step takes ``1 / SPS(B) + D(R, w)``. Every policy is then told the modelled seconds of its rounds
(:meth:`Policy.observe_round`), as an engine with a clock tells it the measured ones, so the gated policies run too. The
oracle sees each round's realised counts before it drafts (:meth:`Policy.foresee`) and picks a plain step or the
draft width that pays best for that outcome (:class:`~.policies.Oracle`), then verifies exactly the accepted drafts:
the bound of the schedules of this drafter's rounds. A narrower draft is taken to accept as the full-width one did
(the traces record full-width rounds): an approximation for a block drafter, whose slots attend to each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .policies import Policy, PolicyError, make_policy

if TYPE_CHECKING:  # annotations only: importing the package must not import sps (its CLI runs as __main__)
    from .sps import SPSProfile

__all__ = ["Traces", "simulate", "sweep"]


@dataclass
class Traces:
    """Concatenated per-request traces: ``conf [N, gamma]`` float32, ``accepted [N]`` int64; request i owns rows
    ``start[i] : start[i] + rounds[i]`` (``[T]`` int64 each)."""

    conf: torch.Tensor
    accepted: torch.Tensor
    start: torch.Tensor
    rounds: torch.Tensor

    @classmethod
    def from_result(cls, extra: dict) -> Traces:
        """From ``SpecResult.extra`` of a ``record_traces=True`` run (rounds grouped by request, in order)."""
        if "confidence_logits" not in extra:
            raise ValueError("no traces recorded: run speculative_generate(record_traces=True) with a drafter that "
                             "has a confidence head")
        req = extra["trace_request"].long()
        order = torch.sort(req, stable=True).indices
        counts = torch.bincount(req)
        counts = counts[counts > 0]
        start = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)[:-1]])
        return cls(extra["confidence_logits"][order].float(), extra["accepted"][order].long(), start, counts)

    @property
    def gamma(self) -> int:
        return self.conf.shape[1]

    def tokens(self) -> torch.Tensor:
        """Emitted tokens of each recorded request ``[T]`` (full-gamma verification; excludes the prefill token)."""
        per_round = self.accepted + 1
        return torch.stack([per_round[s: s + n].sum() for s, n in zip(self.start.tolist(), self.rounds.tolist())])


def _step_time(table: torch.Tensor, batch: int) -> float:
    """``1 / SPS(B)``; past the profiled ``Bmax``, compute-bound scaling ``t(Bmax) * B / Bmax``."""
    bmax = table.numel() - 1
    if batch <= bmax:
        return 1.0 / float(table[batch])
    return batch / (bmax * float(table[bmax]))


def simulate(policy: Policy, traces: Traces, profile: SPSProfile, concurrency: int, num_requests: int | None = None,
             seed: int = 0, draft_profile: SPSProfile | None = None,
             narrow_draft_profile: SPSProfile | None = None) -> dict:
    """One closed-loop point (see the module docstring; the draft profiles charge the draft rounds). Returns
    ``policy``, ``concurrency``, ``per_user_tps_median``/``_p10`` (tokens / simulated seconds of each finished request),
    ``system_tps``, ``tau`` (tokens per request-round), ``verified_tokens``/``rejected_tokens`` (drafts per
    request-round), ``waste`` (rejected / verified), ``drafted_rounds`` (the share of steps that drafted), ``steps`` and
    ``requests``."""
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    num_requests = max(3 * concurrency, 32) if num_requests is None else num_requests
    gamma = traces.gamma
    policy.bind(profile, gamma, concurrency, draft_profile, narrow_draft_profile)
    table = profile.as_table(concurrency * (gamma + 1))
    budgets = traces.tokens()
    rng = np.random.default_rng(seed)
    n_traces = traces.rounds.numel()

    slot_trace = torch.as_tensor(rng.integers(0, n_traces, concurrency))
    slot_step = torch.zeros(concurrency, dtype=torch.int64)
    slot_tokens = torch.zeros(concurrency, dtype=torch.int64)
    slot_t0 = np.zeros(concurrency)
    slot_id = torch.arange(concurrency)
    next_id, now, step, drafted_steps = concurrency, 0.0, 0, 0
    speeds: list[float] = []
    tokens_total = rounds_total = verified_total = accepted_total = 0
    while len(speeds) < num_requests:
        rows = traces.start[slot_trace] + slot_step % traces.rounds[slot_trace]
        realised, live = traces.accepted[rows], slot_id.tolist()
        if draft_profile is None:  # free drafting: every round drafts gamma slots
            drafting, width = True, gamma
        else:
            policy.foresee(realised)
            drafting = policy.drafts(live, step)
            width = policy.draft_width(live, step) if drafting else 0
            if drafting and not 1 <= width <= gamma:
                raise PolicyError(f"policy {policy.name!r} asked for draft width {width!r}, outside 1..{gamma}")
        if drafting:
            realised = realised.clamp(max=width)
            lens = policy.choose(traces.conf[rows, :width], live, step, realised=realised).long().cpu()
            if lens.shape != (concurrency,) or bool((lens < 0).any() | (lens > width).any()):
                raise PolicyError(f"policy {policy.name!r} chose verify lengths {lens.tolist()} for {concurrency} "
                                  f"requests drafted at width {width}")
        else:
            lens = torch.zeros(concurrency, dtype=torch.int64)
        acc = torch.minimum(realised, lens)
        policy.observe(acc, lens)
        seconds = _step_time(table, int((lens + 1).sum())) + policy.draft_seconds(concurrency, width)
        if draft_profile is not None:
            policy.observe_round(concurrency, drafting, seconds)
        now += seconds
        step += 1
        drafted_steps += drafting
        slot_tokens += acc + 1
        slot_step += 1
        tokens_total += int((acc + 1).sum())
        rounds_total += concurrency
        verified_total += int(lens.sum())
        accepted_total += int(acc.sum())
        for s in torch.nonzero(slot_tokens >= budgets[slot_trace]).flatten().tolist():
            speeds.append(int(budgets[slot_trace[s]]) / (now - slot_t0[s]))
            slot_trace[s] = int(rng.integers(0, n_traces))
            slot_step[s] = slot_tokens[s] = 0
            slot_t0[s] = now
            slot_id[s] = next_id
            next_id += 1
    return {
        "policy": policy.name, "concurrency": concurrency,
        "per_user_tps_median": float(np.median(speeds)), "per_user_tps_p10": float(np.percentile(speeds, 10)),
        "system_tps": tokens_total / now, "tau": tokens_total / rounds_total,
        "verified_tokens": verified_total / rounds_total,
        "rejected_tokens": (verified_total - accepted_total) / rounds_total,
        "waste": (verified_total - accepted_total) / verified_total if verified_total else 0.0,
        "drafted_rounds": drafted_steps / step, "steps": step, "requests": len(speeds),
    }


def sweep(names: Sequence[str], traces: Traces, profile: SPSProfile, concurrencies: Sequence[int],
          temperatures: torch.Tensor | None = None, seed: int = 0, prior_survival: Sequence[float] | None = None,
          draft_profile: SPSProfile | None = None, narrow_draft_profile: SPSProfile | None = None,
          biases: torch.Tensor | None = None) -> list[dict]:
    """:func:`simulate` for every policy name x concurrency, a fresh policy per point (same seed: same draws);
    ``temperatures`` and ``biases`` calibrate the confidences; ``prior_survival`` starts the DSpark policies' running
    mean as in the engine."""
    return [simulate(make_policy(n, temperatures, prior_survival, biases), traces, profile, c, seed=seed,
                     draft_profile=draft_profile, narrow_draft_profile=narrow_draft_profile)
            for n in names for c in concurrencies]

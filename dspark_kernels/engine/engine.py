"""Continuous-batching speculative engine with a verify-length policy (confidence-scheduled verification).

``Engine.add_request`` queues a request at any time; every ``Engine.step`` runs

1. a prefill forward for the queued requests that fit under ``max_batch`` (one ragged forward; their first token
   comes from the prefill logits, noise round 0), then
2. one draft/verify round for every live request, the just-prefilled ones included: unless the policy's ``drafts(live,
   step)`` says no (then the round is a plain decode step: no draft, ``l_r = 0``), the drafter drafts ``w =
   draft_width(live, step)`` (at most ``gamma``) tokens per request, the policy picks ``l_r`` in 0..w from their
   confidences, the target verifies ``[anchor, d_1 .. d_{l_r}]`` of all requests in ONE ragged forward,
   :func:`rejection_sample` accepts a prefix (draft-probability rows of the verified drafts only), the target cache
   drops the rejected drafts and the drafter's context grows by the kept tokens.

The drafter's context is extended lazily: the prompt's and every round's committed tokens (with their target
features) wait per request (:class:`~.rounds.PendingContext`) until the request's next drafting round, whose draft
takes them in within the same pass, so a policy that does not draft costs no drafter work at all.

An emitted EOS ends a request (later tokens dropped), as does ``max_new_tokens``; finished requests leave the batch
and free their target and drafter caches. So do aborted requests (:meth:`Engine.abort`, at any point, also from a
streaming callback) and failed ones: a forward that raises (prefill, draft or verify) fails the requests of that
forward (``finish_reason`` "error", the exception in ``Request.error``), frees their pages, and the engine goes on
with the others; a streaming callback that raises fails its own request the same way, at the end of the step.
Admission reserves each request's worst case (prompt + max_new_tokens + gamma + 1 tokens) in pages of the KV pools
(``kv_pages``); a queued request waits, in order, until its reservation fits.

Randomness is counter-based per request (round t of seed s uses (s, t)),
so a request's output depends only on its own seed, its verify lengths and each round's draft width (a block
drafter's block attends both ways, so the number of slots drafted shapes every slot's distribution). With a
per-request policy (fixed-k, threshold) it therefore does not depend on the batch; the load-aware policies
(smartspec, dspark, dspark_prod) choose ``l_r`` and the width from the whole batch, which changes the realisation but
not the output distribution (lossless), and at temperature 0 every policy emits the target's greedy tokens.

Metrics stay on the device and are read by :meth:`Engine.metrics` only: per request the accept histogram, verified
and accepted drafts and rounds; per position the accepted drafts and the rounds that reached the position (verified
it after accepting every draft before it); the calibration pairs (confidence logits of the verified drafts and whether
each was accepted). They count the verifier's verdicts: a request's last round may keep fewer tokens than it accepted
when its ``max_new_tokens`` or an EOS cuts it (its ``tokens`` are what it emitted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..drafters import Drafter, check_drafter_target, check_gamma
from ..models import CausalLM
from ..ops._validate import is_int
from ..request_checks import check_requests
from ..sampling import INT32_MAX, Sampling, as_int, check_sampling
from .policies import Policy, PolicyError
from .rounds import PendingContext, draft, finish_reason, no_drafts, prefill, verify_round

if TYPE_CHECKING:  # annotations only: importing the package must not import sps (its CLI runs as __main__)
    from .sps import SPSProfile

__all__ = ["Engine", "PolicyError", "Request", "run_closed_loop"]


@dataclass
class Request:
    """One request's parameters and state; ``tokens``: its new tokens; ``rounds``: its noise counter (prefill = 0);
    ``t_start``/``t_end``: wall clock at admission (its prefill step) and at finishing; ``reason``: None while it
    runs, then "eos", "length", "aborted" or "error" (``error``: the exception, of a forward or of its callback);
    ``on_tokens(rid, new_tokens, reason)``: its streaming callback, ``streamed`` the tokens it has been given (a
    callback that raises fails its request if it still runs, records the exception, and is not called again);
    ``pages``: the KV pages its worst
    case (prompt + max_new_tokens + gamma + 1 tokens) reserves at admission."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    eos: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    rounds: int = 0
    reason: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    on_tokens: Callable[[int, list[int], str | None], None] | None = None
    streamed: int = 0
    error: str | None = None
    pages: int = 0


class _Metrics:
    """Device-side counters, grown by doubling: ``hist [cap, gamma + 1]``, ``verified``/``accepted``/``rounds
    [cap]`` per request id; ``pos_accepted [gamma]`` (the verifier's counter of drafts accepted at each position) and
    ``pos_reached [gamma]`` (rounds that verified the position after accepting every draft before it: the
    denominator of the conditional acceptance); calibration pairs kept per round."""

    def __init__(self, gamma: int, device: torch.device) -> None:
        self.gamma, self.device = gamma, device
        self.hist = torch.zeros(0, gamma + 1, dtype=torch.int64, device=device)
        self.verified = torch.zeros(0, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(0, dtype=torch.int64, device=device)
        self.pos_accepted = torch.zeros(gamma, dtype=torch.int64, device=device)
        self.pos_reached = torch.zeros(gamma, dtype=torch.int64, device=device)
        self._positions = torch.arange(gamma, device=device)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def ensure(self, rid: int) -> None:
        cap = self.verified.numel()
        if rid < cap:
            return
        new = max(2 * cap, rid + 1, 16)
        self.hist = torch.cat([self.hist, self.hist.new_zeros(new - cap, self.gamma + 1)])
        self.verified = torch.cat([self.verified, self.verified.new_zeros(new - cap)])
        self.accepted = torch.cat([self.accepted, self.accepted.new_zeros(new - cap)])

    def record(self, rids: torch.Tensor, lens: torch.Tensor, accepted: torch.Tensor, conf: torch.Tensor | None):
        acc = accepted.long()
        self.hist.index_put_((rids, acc), torch.ones_like(acc), accumulate=True)
        self.verified.index_add_(0, rids, lens)
        self.accepted.index_add_(0, rids, acc)
        reached = (self._positions[None, :] < lens[:, None]) & (self._positions[None, :] <= acc[:, None])
        self.pos_reached += reached.sum(0)
        if conf is not None:
            self.pairs.append((conf, lens, acc))

    def calibration_pairs(self) -> dict[str, np.ndarray]:
        """Verified drafts only: ``conf_logits``, ``accepted`` (0/1) and 0-based ``position``, each ``[M]``."""
        logits, labels, positions = [], [], []
        for conf, lens, acc in self.pairs:  # conf [R, width] of each drafted round
            pos = torch.arange(conf.shape[1], device=conf.device)[None, :].expand_as(conf)
            mask = pos < lens[:, None]
            logits.append(conf[mask].float().cpu())
            labels.append((pos < acc[:, None])[mask].cpu())
            positions.append(pos[mask].cpu())
        return {"conf_logits": _cat(logits, np.float32), "accepted": _cat(labels, bool),
                "position": _cat(positions, np.int64)}


def _cat(xs: list[torch.Tensor], dtype) -> np.ndarray:
    return torch.cat(xs).numpy() if xs else np.zeros(0, dtype=dtype)


class Engine:
    """Continuous batching over ``target`` + ``drafter`` with verify lengths from ``policy`` (see module docstring).

    ``sps_profile`` (the target's verify steps/s by token count), ``draft_profile`` (the drafter's rounds/s by
    request count at ``gamma`` slots; optional, required by the gated policies) and ``narrow_draft_profile`` (the same
    at one slot; optional, with ``draft_profile``: the draft cost then follows the width) are bound to the policy: see
    :mod:`~dspark_kernels.engine.policies` for the cost model. Without a draft profile the draft round is taken as
    free, or as already inside ``sps_profile``. The KV pools hold ``max_batch`` requests of up to ``max_seq_len``
    tokens (prompt + new tokens + gamma + 1) each. ``clock`` (e.g. ``time.perf_counter``): time every round and
    report it to the policy (``Policy.observe_round``; the draft gate then decides on measured round times). The times
    are those of steady drafting: a drafting round whose requests hold more than ``gamma + 1`` pending context tokens
    (a new prompt, or context deferred over plain steps) gives them to the drafter in a call of their own before the
    round's clock starts (a drafted round right after a plain step costs what one after a drafted round costs:
    measured at R = 1, 2, 4 and 8 on this repository's CPU, medians within 2.5%). ``None`` (default): no timing, so
    every decision depends only on the profiles and earlier rounds' drafts (reproducible).
    """

    def __init__(self, target: CausalLM, drafter: Drafter, policy: Policy, sps_profile: SPSProfile, gamma: int,
                 page_size: int = 16, max_batch: int = 8, max_seq_len: int = 1024, impl: str | None = None,
                 draft_profile: SPSProfile | None = None, clock: Callable[[], float] | None = None,
                 narrow_draft_profile: SPSProfile | None = None, kv_pages: int | None = None) -> None:
        check_gamma(drafter, gamma)
        check_drafter_target(drafter, target)
        if policy.replay_only:
            raise ValueError(f"policy {policy.name!r} needs realised outcomes: use it in the replay simulator only")
        for name, v in (("page_size", page_size), ("max_batch", max_batch), ("max_seq_len", max_seq_len),
                        ("kv_pages", 1 if kv_pages is None else kv_pages)):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        from .sps import SPSProfile  # at call time: importing the package must not import sps (see above)

        if not isinstance(sps_profile, SPSProfile):
            raise TypeError(f"sps_profile must be an SPSProfile (engine.sps.load_profile), got "
                            f"{type(sps_profile).__name__}")
        positions = target.config.max_position_embeddings
        if positions is not None and max_seq_len > positions + gamma + 1:
            raise ValueError(f"max_seq_len ({max_seq_len}) exceeds the target's max_position_embeddings ({positions}) "
                             f"+ gamma + 1 = {positions + gamma + 1}")
        policy.bind(sps_profile, gamma, max_batch, draft_profile, narrow_draft_profile)
        self.target, self.drafter, self.policy, self.gamma = target, drafter, policy, gamma
        self.max_batch, self.max_seq_len, self.impl, self.clock = max_batch, max_seq_len, impl, clock
        self._now = clock if clock is not None else (lambda: 0.0)  # round timing reads this; reported with a clock only
        self.device = target.device
        pages = max_batch * -(-max_seq_len // page_size) if kv_pages is None else kv_pages
        self.kv_pages, self.page_size = pages, page_size
        self.tcache = target.new_cache(pages, page_size)
        self.dstate = drafter.new_state(pages, page_size)
        self._reserved: dict[int, int] = {}  # pages reserved per admitted request (its worst case)
        self._in_step = False
        self._abort_later: set[int] = set()
        self._fail_later: dict[int, BaseException] = {}
        self.requests: dict[int, Request] = {}
        self.pending: list[int] = []
        self.live: list[int] = []
        self.steps = 0
        self.scheduler_s = self.round_s = 0.0  # with a clock: wall time in the policy's calls; the rounds' clock time
        self._next_id = 0
        self._pending = PendingContext()
        self._metrics = _Metrics(gamma, self.device)

    # ---------------------------------------------------------------------------------------------------- requests
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None, eos: int | Sequence[int] | None = None,
                    on_tokens: Callable[[int, list[int], str | None], None] | None = None) -> int:
        """Queue a request (prefilled at the next step with room in the batch and the KV pools); returns its id.
        ``eos``: a stop token id, or several (e.g. ``target.config.eos_token_ids``). ``on_tokens(rid, new_tokens,
        reason)``: called after every step that emits tokens for it or ends it (``reason`` None while it runs)."""
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be callable, got {type(on_tokens).__name__}")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        (prompt,), stop = check_requests(self.target.config, [prompt], max_new_tokens, eos)
        check_sampling(temperature, top_k, top_p)
        seed = int(torch.randint(0, INT32_MAX, ()).item()) if seed is None else as_int("seed", seed)
        need = len(prompt) + max_new_tokens + self.gamma + 1
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + gamma + 1 = {need} "
                             f"exceeds max_seq_len = {self.max_seq_len}")
        pages = -(-need // self.page_size)
        if pages > self.kv_pages:
            raise ValueError(f"prompt + max_new_tokens + gamma + 1 = {need} tokens need {pages} pages, "
                             f"more than the KV pools hold (kv_pages = {self.kv_pages})")
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = Request(rid, prompt, max_new_tokens, float(temperature), int(top_k), float(top_p),
                                     seed, stop, on_tokens=on_tokens, pages=pages)
        self.pending.append(rid)
        self._metrics.ensure(rid)
        return rid

    def abort(self, rid: int) -> bool:
        """End request ``rid`` now: a queued one leaves the queue, a running one frees its KV and drafter pages
        (called from a streaming callback during a step, at the end of that step); its ``finish_reason`` becomes
        "aborted" and the tokens it has are kept. The other requests are untouched. Returns False when it had
        already finished; KeyError for an unknown id."""
        if rid not in self.requests:
            raise KeyError(f"abort: no request with id {rid!r}")
        req = self.requests[rid]
        if req.reason is not None:
            return False
        if rid in self.pending:
            self.pending.remove(rid)
            self._end([rid], "aborted", time.perf_counter())
        elif self._in_step:
            self._abort_later.add(rid)
        else:
            self.live.remove(rid)
            self._end([rid], "aborted", time.perf_counter())
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.live or self.pending)

    @property
    def free_pages(self) -> int:
        """Pages of the KV pools not reserved by an admitted request."""
        return self.kv_pages - sum(self._reserved.values())

    def _release(self, rid: int) -> None:
        """Free ``rid``'s target and drafter pages, its pending drafter context and its reservation (whatever it
        holds: an admission that failed may have added it to one cache only)."""
        if rid in self.tcache:
            self.tcache.free(rid)
        if self._reserved.pop(rid, None) is not None:
            self.drafter.free(self.dstate, rid)
        self._pending.drop(rid)

    def _end(self, rids: Sequence[int], reason: str, now: float, error: BaseException | None = None) -> None:
        """End ``rids`` with ``reason`` (aborted or error): release them and tell their streams."""
        for i in rids:
            req = self.requests[i]
            req.reason, req.t_end = reason, now
            req.error = None if error is None else f"{type(error).__name__}: {error}"
            self._release(i)
        self._stream(rids)

    def _stream(self, rids: Sequence[int]) -> None:
        """Give each request's callback the tokens it has not seen yet (and its reason once it ended)."""
        for i in rids:
            req = self.requests[i]
            if req.on_tokens is not None and (len(req.tokens) > req.streamed or req.reason is not None):
                new = req.tokens[req.streamed:]
                req.streamed = len(req.tokens)
                try:
                    req.on_tokens(i, new, req.reason)
                except Exception as err:  # the caller's code failed: its request fails (at the end of the step)
                    req.on_tokens = None
                    if req.reason is None:
                        self._fail_later[i] = err
                    else:
                        req.error = f"on_tokens raised {type(err).__name__}: {err}"

    def _sampling(self, rids: Sequence[int]) -> Sampling:
        rs = [self.requests[i] for i in rids]
        return Sampling.of([r.temperature for r in rs], [r.top_k for r in rs], [r.top_p for r in rs],
                           [r.seed for r in rs], [r.rounds for r in rs], self.device)

    def _finish(self, rids: Sequence[int], now: float) -> list[int]:
        """Apply the length cap/EOS to ``rids``; free the finished ones and return them."""
        done = []
        for i in rids:
            req = self.requests[i]
            req.reason = finish_reason(req.tokens, req.max_new_tokens, req.eos)
            if req.reason is not None:
                req.t_end = now
                self._release(i)
                done.append(i)
        return done

    def _admit(self, now: float) -> list[int]:
        """Prefill the queued requests that fit, in order: up to ``max_batch`` live, and while the next one's
        worst case fits in the unreserved pages. Returns the ones that finished on their first token, or failed."""
        room, free, new = self.max_batch - len(self.live), self.free_pages, []
        for i in self.pending[:room]:
            if self.requests[i].pages > free:
                break
            free -= self.requests[i].pages
            new.append(i)
        self.pending = self.pending[len(new):]
        if not new:
            return []
        try:
            for i in new:
                req = self.requests[i]
                req.t_start = now
                self.tcache.add_request(i)
                self.drafter.add_request(self.dstate, i)
                self._reserved[i] = req.pages
            first = prefill(self.target, self.drafter, self.tcache, self.dstate, new,
                            [self.requests[i].prompt for i in new], self._sampling(new), self.impl,
                            defer=lambda kept: self._pending.add(new, kept))
        except Exception as err:  # the prefill forward (or a cache) failed: these requests fail, the others go on
            self._end(new, "error", time.perf_counter(), err)
            return new
        for i, tok in zip(new, first):
            self.requests[i].tokens.append(tok)
            self.requests[i].rounds = 1
        done = self._finish(new, time.perf_counter())
        self.live += [i for i in new if i not in done]
        self._stream(new)
        return done

    # -------------------------------------------------------------------------------------------------------- step
    def step(self) -> list[int]:
        """Admit queued requests, then run one draft/verify round for every live request; returns the ids of the
        requests that finished during this step (ended, aborted from a callback, or failed)."""
        self._in_step = True
        try:
            done = self._admit(time.perf_counter())
            done += self._apply_aborts()  # aborted from a callback at their prefill: no round for them
            if self.live:
                live = self.live
                try:
                    done += self._round(live)
                except PolicyError:
                    raise
                except Exception as err:  # a draft or verify forward failed: its requests fail, the queue goes on
                    self.live = [i for i in self.live if i not in live]
                    self._end(live, "error", time.perf_counter(), err)
                    done += live
        finally:
            self._in_step = False
        return done + self._apply_aborts()

    def _apply_aborts(self) -> list[int]:
        """End the running requests a callback aborted (or whose callback raised) during this step; returns them."""
        failed = {i: err for i, err in self._fail_later.items() if self.requests[i].reason is None}
        aborted = [i for i in self._abort_later if self.requests[i].reason is None and i not in failed]
        self._abort_later.clear()
        self._fail_later.clear()
        ended = aborted + list(failed)
        if ended:
            self.live = [i for i in self.live if i not in ended]
        if aborted:
            self._end(aborted, "aborted", time.perf_counter())
        for i, err in failed.items():
            self._end([i], "error", time.perf_counter(), err)
        return ended

    def _scheduled(self, call, *args):
        """``call(*args)`` of the policy; with a clock, its wall time (``time.perf_counter``, so the rounds' clock
        reads stay two a round) is added to ``scheduler_s``."""
        if self.clock is None:
            return call(*args)
        start = time.perf_counter()
        out = call(*args)
        self.scheduler_s += time.perf_counter() - start
        return out

    def _round(self, live: list[int]) -> list[int]:
        """One draft/verify round of the live requests ``live``; returns the ones that finished."""
        r, dev, gamma = len(live), self.device, self.gamma
        t_round = self._now()
        samp = self._sampling(live)
        anchors = torch.tensor([self.requests[i].tokens[-1] for i in live], dtype=torch.int64, device=dev)
        drafting = self._scheduled(self.policy.drafts, live, self.steps)
        if drafting:
            width = self._scheduled(self.policy.draft_width, live, self.steps)
            if not (is_int(width) and 1 <= width <= gamma):
                raise PolicyError(f"policy {self.policy.name!r} asked for draft width {width!r}, outside 1..{gamma}")
            backlog = self._pending.longest(live) > gamma + 1
            context = self._pending.take(live, dev)
            if backlog:  # a new prompt, or context deferred over plain steps: taken in before the round is timed
                self.drafter.extend(self.dstate, live, *context)
                context, t_round = None, self._now()
            drafted = draft(self.drafter, self.dstate, live, anchors, width, samp, self.impl, context=context)
            conf = None if drafted.confidence_logits is None else drafted.confidence_logits.view(r, width)
            lens = self._scheduled(self.policy.choose, conf, live, self.steps).to(dev, torch.int64)
        else:  # a plain decode step: nothing drafted, nothing to verify
            width, drafted = 1, no_drafts(r, 1, dev)
            conf, lens = None, torch.zeros(r, dtype=torch.int64, device=dev)
        m = self._metrics
        rnd = verify_round(self.target, self.drafter, self.tcache, live, anchors, drafted, lens, width, samp,
                           accept_counter=m.pos_accepted[:width], impl=self.impl)
        self._pending.add(live, rnd.kept)
        self._scheduled(self.policy.observe, rnd.num_accepted, lens)
        m.record(torch.tensor(live, dtype=torch.int64, device=dev), lens, rnd.num_accepted, conf)
        self.steps += 1
        for i, tokens in zip(live, rnd.emitted):
            self.requests[i].tokens.extend(tokens)
            self.requests[i].rounds += 1
        seconds = self._now() - t_round
        self.round_s += seconds
        finished = self._finish(live, time.perf_counter())
        if self.clock is not None:
            self._scheduled(self.policy.observe_round, r, drafting, seconds)
        self.live = [i for i in live if i not in finished]
        self._stream(live)
        return finished

    # ----------------------------------------------------------------------------------------------------- metrics
    def metrics(self) -> dict:
        """Read the device counters (one transfer) and summarise.

        Per request (``requests[rid]``): tokens, rounds, ``accept_hist``, ``verified``/``accepted``/``rejected``
        drafts, ``tau``, ``tokens_per_s`` (tokens / (finish - admission), finished requests only). Totals: ``tau``
        (mean accepted drafts + 1 per request-round: the accepted length with the correction/bonus token),
        ``verified_per_round``, ``rejected_per_round``, ``waste`` = rejected / verified, ``scheduler_s`` / ``round_s``
        (with a clock: seconds in the policy's calls / in the rounds), ``acceptance_by_position``
        (P(draft j + 1 accepted | drafts 1..j accepted and draft j + 1 verified)), and the calibration pairs. All
        count the verifier's verdicts (module docstring).
        """
        m = self._metrics
        hist, ver, acc = m.hist.cpu(), m.verified.cpu(), m.accepted.cpu()
        pos_acc, pos_reached = m.pos_accepted.cpu(), m.pos_reached.cpu()
        per = {}
        for rid, req in self.requests.items():
            rounds = int(hist[rid].sum())
            per[rid] = {
                "tokens": len(req.tokens), "rounds": rounds, "accept_hist": hist[rid].tolist(),
                "verified": int(ver[rid]), "accepted": int(acc[rid]), "rejected": int(ver[rid] - acc[rid]),
                "tau": (int(acc[rid]) + rounds) / rounds if rounds else float("nan"), "finish_reason": req.reason,
                "tokens_per_s": len(req.tokens) / (req.t_end - req.t_start) if req.reason and req.t_end > req.t_start
                else float("nan"),
            }
        rounds, verified, accepted = int(hist.sum()), int(ver.sum()), int(acc.sum())
        return {
            "requests": per, "rounds": rounds, "steps": self.steps,
            "scheduler_s": self.scheduler_s, "round_s": self.round_s,
            "tau": (accepted + rounds) / rounds if rounds else float("nan"),
            "verified_per_round": verified / rounds if rounds else float("nan"),
            "rejected_per_round": (verified - accepted) / rounds if rounds else float("nan"),
            "waste": (verified - accepted) / verified if verified else 0.0,
            "acceptance_by_position": [a / n if n else float("nan") for a, n in zip(pos_acc.tolist(),
                                                                                      pos_reached.tolist())],
            "calibration_pairs": m.calibration_pairs(),
        }


def run_closed_loop(engine: Engine, prompts: Sequence[Sequence[int]], concurrency: int,
                    max_new_tokens: int | Sequence[int],
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seeds: Sequence[int] | None = None, eos: int | Sequence[int] | None = None) -> dict:
    """Closed-loop load: keep ``concurrency`` requests in flight (a finished one is replaced by the next prompt at
    once) until every prompt is done; ``max_new_tokens``: one cap for all, or one per prompt. Returns the engine's
    :meth:`Engine.metrics` plus ``elapsed_s``,
    ``system_tps`` (new tokens / wall time), ``per_user_tps`` (list, one per request), ``concurrency``, and
    ``rids`` (the engine ids, in prompt order)."""
    if not is_int(concurrency) or not 1 <= concurrency <= engine.max_batch:
        raise ValueError(f"concurrency must be an int in [1, max_batch = {engine.max_batch}], got {concurrency!r}")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: one per prompt ({len(prompts)}), got {len(seeds)}")
    caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(caps) != len(prompts):
        raise ValueError(f"max_new_tokens: one cap or one per prompt ({len(prompts)}), got {len(caps)}")
    queue = list(range(len(prompts)))[::-1]
    rids: list[int] = [-1] * len(prompts)

    def submit() -> None:
        i = queue.pop()
        rids[i] = engine.add_request(prompts[i], caps[i], temperature, top_k, top_p, seeds[i], eos)

    first = set(engine.requests)
    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        submit()
    while engine.has_work:
        for _ in engine.step():
            if queue:
                submit()
    elapsed = time.perf_counter() - t0
    out = engine.metrics()
    mine = [out["requests"][i] for i in rids if i not in first]
    out.update(elapsed_s=elapsed, concurrency=concurrency, rids=rids,
               system_tps=sum(r["tokens"] for r in mine) / elapsed if elapsed > 0 else float("nan"),
               per_user_tps=[r["tokens_per_s"] for r in mine])
    return out

"""Serving benchmark: verify-length policies on the throughput vs per-user-speed frontier.

Two modes, same outputs:

* ``live``: the continuous-batching :class:`~dspark_kernels.engine.engine.Engine` runs a closed loop with the
  shipped target and drafter at each concurrency (default 1, 2, 4, 8) for each policy (``oracle`` excluded), all
  policies of one concurrency back to back. Each request's cap on new tokens is drawn from ``--length-range`` around
  ``--max-new-tokens`` (:func:`request_caps`; with equal caps, plain decoding would keep every batch in lockstep,
  prefilled together and attending over equal lengths, which no speculative policy and no real workload does). The
  baselines pay only for the drafting they use: ``none`` runs without a drafter, ``mtp1`` with the shipped MTP-1
  drafter at gamma 1 (:func:`baseline_drafter`). Time is wall clock on this
  machine (``--gemm-dtype bfloat16``: weight-only bf16 GEMMs). Two profiles give the policies their cost model: the
  target's verify steps/s by token count (model key ``<target>[+bfloat16]``, :func:`measure_target_profile`) and the
  drafter's rounds/s by request count at gamma slots and at one (``<target>+<drafter>-rounds[+bfloat16]`` and
  ``<target>+<drafter>-rounds-w1[+bfloat16]``, :func:`~dspark_kernels.engine.sps.profile_drafter`). They are
  loaded from ``autotune/sps/`` when present for this device and large enough and a spot check of the target's
  smallest sizes agrees with its stored profile (within 15%), else (or with ``--reprofile``) measured here (with
  ``--prompt-len`` contexts) and saved. The gated policies start from the drafter's held-out mean
  survival (its ``calibration.json``) instead of drafting a first round to measure it, and the engines time their
  rounds (``Engine(..., clock=time.perf_counter)``), so the gate compares measured rates once it has them.
* ``replay``: traces (confidence logits and accepted counts per round, full-gamma verification) are recorded once
  with the target and drafter, then every policy is simulated (:mod:`dspark_kernels.engine.replay`) against an SPS
  profile JSON (``--profile``; default: ``analytic_roofline("H200", 8e9)``, labelled modelled) at concurrency up to
  1024, without running the model.

Per point: per-user tokens/s (median, p10), system tokens/s, tau (tokens per request-round), verified and rejected
drafts per request-round, waste = rejected / verified; a live point is the median (by system tokens/s) of ``--repeats``
runs, whose system tokens/s it lists; the runs cycle through the policies in turn, in reverse order every other cycle,
so that no policy always holds the same place in the cycle (on this repository's CPU a policy that does what ``none``
does measured 0.975-0.979x of it always running after it, 1.01x with the order alternated). Read-outs: (a) system
throughput at fixed per-user speeds, (b) per-user speed at the throughput of each mtp1 point, relative to mtp1; both
interpolated on each policy's Pareto frontier; (c) live only: each policy's system throughput over ``none``'s and over
the best fixed-k policy's in the same round-robin cycle, the median over the cycles (:func:`paired_ratios`). Writes
``--json``, and ``.csv`` and ``.png`` (Pareto plot) next to it.

CLI: ``python -m dspark_kernels.bench serving --mode replay --json results/serving_replay.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..cli_args import (
    DEFAULT_CORPUS,
    DRAFT_VOCAB_HELP,
    draft_vocab_choice,
    fraction_below_one,
    model_source,
    non_negative_float,
    positive_float,
    positive_int,
)
from ..drafters import MAX_GAMMA, NullDrafter, load_drafter
from ..engine.engine import Engine, run_closed_loop
from ..engine.policies import GATED_POLICY_NAMES, POLICY_NAMES, make_policy
from ..engine.replay import Traces, sweep
from ..engine.speculative import speculative_generate
from ..engine.sps import (
    SPS_DIR,
    SPSProfile,
    analytic_roofline,
    draft_round_widths,
    load_profile,
    profile_device_name,
    profile_drafter,
    profile_target,
    read_profile,
    target_step_fn,
)
from ..models import load_model
from ..models.gemm_dtype import GEMM_DTYPES
from ..models.registry import shipped_drafter
from ..train.calibration import DrafterCalibration, load_calibration
from . import ASSETS, device_record

LIVE_CONCURRENCY = (1, 2, 4, 8)
# the read-outs interpolate linearly between a policy's points: with powers of two only, the frontier read low where
# the modelled H200 profile turns compute-bound (~200 tokens a step): at T = 0 Algorithm 1 read 1.21x / 1.53x MTP-1's
# per-user speed at c = 128 / 256, 1.29x / 1.60x on this grid
REPLAY_CONCURRENCY = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 768,
                      1024)
PROFILE_WARMUP = 3  # untimed calls per size
PROFILE_REPEATS = 20  # timed calls per size: on a CPU, steps of neighbouring sizes differ less than 5 calls' noise
SPOT_SIZES = 4  # the sizes the target profile's spot check measures again (1..SPOT_SIZES)
SPOT_TOLERANCE = 0.15  # a stored profile whose rates differ from its spot check's by more is measured anew


def measure_target_profile(target, max_tokens: int, context: int, model: str) -> SPSProfile:
    """The target's verify steps/s at every batch B = 1..``max_tokens``: one request holding ``context`` tokens
    verifies B tokens (rolled back). Every size is measured: a sparse profile would read as a staircase whose first
    token past each measured size never pays, and Algorithm 1 would stop there."""
    step = target_step_fn(target, target.device, max_tokens, context, per_request=max_tokens)
    return profile_target(step, max_tokens, device=profile_device_name(target.device), model=model,
                          warmup=PROFILE_WARMUP, repeats=PROFILE_REPEATS)


def request_caps(n: int, max_new_tokens: int, length_range: float, seed: int) -> list[int]:
    """Each of ``n`` requests' cap on new tokens, uniform over ``[(1 - length_range), (1 + length_range)] *
    max_new_tokens`` (rounded, at least 1) from ``seed``; ``length_range = 0``: ``max_new_tokens`` for all."""
    rng = random.Random(seed)
    lo = max(1, round((1 - length_range) * max_new_tokens))
    hi = max(lo, round((1 + length_range) * max_new_tokens))
    return [rng.randint(lo, hi) for _ in range(n)]


def prompts_for(args: argparse.Namespace, n: int, vocab: int, seed: int) -> tuple[list[list[int]], str]:
    """``n`` prompts: with ``--prompts``, the prompt set's held-out chat prompts of every domain, interleaved (the
    i-th of each domain in turn, from the ``seed``-th on, cycling), rendered through the chat template; else
    ``--prompt-len`` tokens each: corpus test-split windows when the corpus and a tokenizer exist, else seeded random
    token ids (labelled "random")."""
    if args.prompts is not None:
        from ..models.target_tokenizer import load_target_tokenizer
        from ..train.prompts import DOMAINS
        from .acceptance import chat_benchmark_prompts

        per_domain = chat_benchmark_prompts(load_target_tokenizer(args.model), args.prompts, list(DOMAINS), 10**9)
        mixed = [p for group in zip(*per_domain.values()) for p in group]
        return [mixed[(seed + i) % len(mixed)] for i in range(n)], f"chat:{'+'.join(DOMAINS)}"
    if (Path(args.corpus) / "manifest.json").exists():
        from ..models.target_tokenizer import load_target_tokenizer
        from .acceptance import benchmark_prompts

        return benchmark_prompts(load_target_tokenizer(args.model), Path(args.corpus), args.domain, n,
                                 args.prompt_len, seed), f"corpus:{args.domain}"
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, vocab) for _ in range(args.prompt_len - 1)] for _ in range(n)], "random"


def drafter_calibration(drafter_dir: Path, gamma: int) -> DrafterCalibration:
    """The calibration of ``drafter_dir`` for ``gamma`` drafts; an uncalibrated drafter's (all ``None``) when it has
    no ``calibration.json``."""
    try:
        return load_calibration(drafter_dir, gamma)
    except FileNotFoundError:
        return DrafterCalibration()


def baseline_drafter(policy: str, args: argparse.Namespace, target, drafter) -> tuple[object, int]:
    """(drafter, gamma) a live policy runs with: each baseline pays only for the drafting it uses. ``none`` decodes
    with the :class:`NullDrafter` (no draft, no drafter context); ``mtp1`` uses the MTP-1 drafter of
    ``--mtp1-drafter`` at gamma 1 (one chain step, as the paper's MTP-1 baseline) when that directory exists, else
    the first draft of ``drafter``; every other policy uses ``drafter`` at ``--gamma``."""
    if policy == "none":
        return NullDrafter(), 1
    if policy == "mtp1" and args.mtp1_drafter is not None and Path(args.mtp1_drafter).exists():
        return load_drafter(args.mtp1_drafter, target, gemm_dtype=args.gemm_dtype, draft_vocab=args.draft_vocab), 1
    return drafter, args.gamma


def _spot_ratio(stored: SPSProfile, spot: SPSProfile) -> float:
    """The median over ``spot``'s sizes of the stored rate over the spot check's (first context bucket): 1 when the
    stored profile still describes the machine, below 1 when it was measured slower than the machine runs now; NaN
    when the two share no size (a sparse stored profile), which no tolerance accepts."""
    rates = dict(zip(stored.batch_sizes, stored.steps_per_s[0]))
    ratios = [rates[b] / r for b, r in zip(spot.batch_sizes, spot.steps_per_s[0]) if b in rates]
    return statistics.median(ratios) if ratios else math.nan


def _live_profile(args, device: str, model: str, size: int, measure, spot_check: bool = True,
                  stale: bool = False) -> tuple[SPSProfile, str, bool]:
    """``(profile, where it came from, stale)``: the stored profile of ``model`` on ``device`` (a profile key,
    :func:`profile_device_name`) when it reaches ``size``, neither ``--reprofile`` nor ``stale`` (another profile of
    this machine failed its spot check) asks for a new one, and, with ``spot_check``, a spot check agrees with it; else
    ``measure(n, model)`` (saved in its place), with ``n`` the larger of ``size`` and the stored profile's last size,
    so that a small run does not shrink what a larger one measured. ``stale`` is returned True when the spot check
    disagreed.

    The spot check measures the first ``SPOT_SIZES`` sizes again (``measure(SPOT_SIZES, model)``, a second or so) and
    compares the median rate ratio with ``SPOT_TOLERANCE``: a stored CPU profile taken while other work shared the
    cores reads every step slow, and its rates would send the cost model's choices astray without a word. Only the
    target's profile is spot-checked: a draft round's time in a fresh process also depends on how many of the
    sequential head's bias rows are kept yet (``reference.sequential_head``), so a spot check of it reads slow until
    the process has drafted a while; the machine's state shows in the target's steps alike."""
    why = "measured anew (the target's stored profile failed its spot check)" if stale else "measured"
    n = size
    try:
        profile = load_profile(device, model, args.sps_dir)
        n = max(size, profile.batch_sizes[-1])
        if profile.batch_sizes[-1] >= size and not (args.reprofile or stale):
            if not spot_check:
                return profile, f"loaded (measured {profile.created})", False
            ratio = _spot_ratio(profile, measure(min(SPOT_SIZES, size), model))
            if abs(ratio - 1) <= SPOT_TOLERANCE:
                return profile, f"loaded (measured {profile.created}; a spot check reads {ratio:.2f}x its rates)", False
            verdict = "shares no size with a spot check" if math.isnan(ratio) else \
                f"reads {ratio:.2f}x a spot check's rates"
            why, stale = f"measured anew (the stored one, of {profile.created}, {verdict})", True
    except FileNotFoundError:
        pass
    profile = measure(n, model)
    return profile, f"{why}, saved to {profile.save(args.sps_dir)}", stale


def run_live(args, target, drafter, cal: DrafterCalibration) -> tuple[list[dict], SPSProfile, str]:
    # bf16 GEMMs and the batch-invariant attention give other profiles than fp32 GEMMs and the fused attention
    suffix = ("" if args.gemm_dtype == "float32" else f"+{args.gemm_dtype}") + \
        ("+batch-invariant" if args.batch_invariant else "")
    max_c, target_name, device = max(args.concurrency), Path(args.model).stem, profile_device_name(target.device)
    profile, where, stale = _live_profile(args, device, f"{target_name}{suffix}", max_c * (args.gamma + 1),
                                          lambda n, model: measure_target_profile(target, n, args.prompt_len, model))
    draft_profiles = {}  # draft slots -> the drafter's rounds/s by request count
    for width, tag in draft_round_widths(args.gamma):
        draft_profiles[width], draft_where, _ = _live_profile(
            args, device, f"{target_name}+{Path(args.drafter).name}{tag}{suffix}", max_c,
            lambda n, model, width=width: profile_drafter(target, drafter, n, device=device, model=model,
                                                          context=args.prompt_len, gamma=width, warmup=PROFILE_WARMUP,
                                                          repeats=PROFILE_REPEATS),
            spot_check=False, stale=stale)
        where += f"; draft-round profile at {width} slot(s) {draft_where}"
    runners = {name: baseline_drafter(name, args, target, drafter) for name in args.policies if name != "oracle"}
    warm, _ = prompts_for(args, 2, target.config.vocab_size, args.seed + 1)  # untimed: first-call allocations
    for run_drafter, gamma in runners.values():
        run_closed_loop(Engine(target, run_drafter, make_policy("fixed3"), profile, gamma, max_batch=2,
                               max_seq_len=max(map(len, warm)) + 9 + gamma), warm, 2, 8, temperature=args.temperature)
    points = []
    # every policy at one concurrency back to back, --repeats times round-robin (every other cycle in reverse, so
    # that a place in the cycle favours no policy): slow drifts of a shared machine's speed hit them alike, and the
    # median run of each point drops the outliers
    for c in args.concurrency:
        prompts, source = prompts_for(args, max(args.requests_per_level * c, args.min_requests),
                                      target.config.vocab_size, args.seed)
        caps = request_caps(len(prompts), args.max_new_tokens, args.length_range, args.seed)
        runs: dict[str, list[dict]] = {}
        for cycle in range(args.repeats):
            for name, (run_drafter, gamma) in list(runners.items())[:: -1 if cycle % 2 else 1]:
                policy = make_policy(name, *cal.policy_args())
                eng = Engine(target, run_drafter, policy, profile, gamma, max_batch=c,
                             max_seq_len=max(map(len, prompts)) + max(caps) + args.gamma + 1,
                             draft_profile=draft_profiles[args.gamma] if run_drafter is drafter else None,
                             narrow_draft_profile=draft_profiles[1] if run_drafter is drafter else None,
                             clock=time.perf_counter)
                try:
                    runs.setdefault(name, []).append(
                        run_closed_loop(eng, prompts, c, caps, temperature=args.temperature))
                except ValueError as e:
                    if "confidence head" not in str(e):
                        raise
                    print(f"skip {name}: {e}", flush=True)
                    del runners[name], runs[name]
        for name, outs in runs.items():
            out = sorted(outs, key=lambda o: o["system_tps"])[len(outs) // 2]
            speeds = out["per_user_tps"]
            points.append({
                "policy": name, "concurrency": c, "per_user_tps_median": statistics.median(speeds),
                "per_user_tps_p10": float(np.percentile(speeds, 10)), "system_tps": out["system_tps"],
                "system_tps_runs": [o["system_tps"] for o in outs],
                "tau": out["tau"], "verified_tokens": out["verified_per_round"],
                "rejected_tokens": out["rejected_per_round"], "waste": out["waste"], "steps": out["steps"],
                "requests": len(speeds), "elapsed_s": out["elapsed_s"], "prompts": source,
                # the policy's own calls (wall time), per round and as a share of the rounds' time
                "scheduler_ms_per_round": 1e3 * out["scheduler_s"] / max(out["steps"], 1),
                "scheduler_share": out["scheduler_s"] / out["round_s"] if out["round_s"] > 0 else 0.0,
                "acceptance_by_position": out["acceptance_by_position"],
            })
            _print_point(points[-1])
    return points, profile, where


def run_replay(args, target, drafter, cal: DrafterCalibration) -> tuple[list[dict], SPSProfile, str]:
    if args.profile is not None:
        profile, where = read_profile(args.profile), str(args.profile)
    else:
        profile, where = analytic_roofline("H200", 8e9, model="8B (modelled)"), 'analytic_roofline("H200", 8e9)'
    drafts = [None if path is None else read_profile(path) for path in (args.draft_profile, args.narrow_draft_profile)]
    if drafts[0] is not None:
        where += f"; draft rounds {args.draft_profile}" + \
            ("" if drafts[1] is None else f" and at one slot {args.narrow_draft_profile}")
    prompts, source = prompts_for(args, args.trace_prompts, target.config.vocab_size, args.seed)
    res = speculative_generate(target, drafter, prompts, args.max_new_tokens, args.gamma,
                               temperature=args.temperature, seeds=list(range(len(prompts))), record_traces=True)
    traces = Traces.from_result(res.extra)
    print(f"traces: {traces.rounds.numel()} requests, {traces.conf.shape[0]} rounds, tau {res.tau:.3f} ({source})",
          flush=True)
    names = list(args.policies)
    if drafts[0] is None:
        names = [n for n in names if n not in GATED_POLICY_NAMES]
        if len(names) < len(args.policies):
            print("replay without --draft-profile charges no drafting: the gated policies are left out", flush=True)
    points = sweep(names, traces, profile, args.concurrency, cal.temperatures, seed=args.seed,
                   prior_survival=None if drafts[0] is None else cal.prior_survival, draft_profile=drafts[0],
                   narrow_draft_profile=drafts[1], biases=cal.biases)
    for p in points:
        p["prompts"] = source
        _print_point(p)
    return points, profile, where


def _print_point(p: dict) -> None:
    print(f"{p['policy']:13s} c={p['concurrency']:5d} user {p['per_user_tps_median']:10.2f} tok/s "
          f"(p10 {p['per_user_tps_p10']:10.2f}) system {p['system_tps']:11.2f} tok/s tau {p['tau']:.3f} "
          f"verified {p['verified_tokens']:.2f} waste {p['waste']:.2f}", flush=True)


def _frontier(points: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Pareto frontier (per-user, system) of one policy, per-user descending / system ascending."""
    pts = sorted(((p["per_user_tps_median"], p["system_tps"]) for p in points), reverse=True)
    user, system = [], []
    for u, s in pts:
        if not system or s > system[-1]:
            user.append(u)
            system.append(s)
    return np.array(user), np.array(system)


def system_at_speed(points: list[dict], speed: float) -> float | None:
    """System tokens/s a policy reaches at per-user speed >= ``speed`` (interpolated on its frontier)."""
    user, system = _frontier(points)
    if speed > user[0]:
        return None
    return float(np.interp(speed, user[::-1], system[::-1]))


def speed_at_throughput(points: list[dict], throughput: float) -> float | None:
    """Per-user tokens/s a policy keeps at system throughput ``throughput`` (interpolated on its frontier)."""
    user, system = _frontier(points)
    if throughput > system[-1]:
        return None
    return float(np.interp(throughput, system, user))


def readouts(points: list[dict], speeds: list[float] | None) -> dict:
    """(a) system tokens/s at fixed per-user speeds (default: 25/50/75% of the fastest per-user median) and
    (b) per-user speed at each mtp1 point's throughput, and its ratio to mtp1's."""
    by_policy: dict[str, list[dict]] = {}
    for p in points:
        by_policy.setdefault(p["policy"], []).append(p)
    top = max(p["per_user_tps_median"] for p in points)
    speeds = speeds or [round(f * top, 3) for f in (0.25, 0.5, 0.75)]
    fixed = {f"{s:g}": {name: system_at_speed(pts, s) for name, pts in by_policy.items()} for s in speeds}
    matched = []
    for ref in sorted(by_policy.get("mtp1", []), key=lambda p: p["concurrency"]):
        row = {"mtp1_concurrency": ref["concurrency"], "system_tps": ref["system_tps"],
               "mtp1_per_user_tps": ref["per_user_tps_median"], "per_user_tps": {}, "vs_mtp1": {}}
        for name, pts in by_policy.items():
            u = speed_at_throughput(pts, ref["system_tps"])
            row["per_user_tps"][name] = u
            row["vs_mtp1"][name] = None if u is None else u / ref["per_user_tps_median"]
        matched.append(row)
    out = {"system_tps_at_per_user_speed": fixed, "per_user_at_matched_throughput_vs_mtp1": matched}
    if all("system_tps_runs" in p for p in points):
        out["paired_system_tps_ratios"] = paired_ratios(points)
    return out


def paired_ratios(points: list[dict]) -> dict:
    """Per concurrency and policy: the median over round-robin cycles of the policy's system tokens/s divided by
    ``none``'s (``vs_none``) and by the best fixed-k policy's (``vs_best_fixed``) in the same cycle. A cycle runs
    every policy back to back, so a slow drift of a shared machine's speed hits both runs of a pair alike and these
    ratios spread less than ratios of the per-point medians. A key is absent when its reference policy was not run.
    Needs ``system_tps_runs`` (live points), in run order."""
    runs: dict[int, dict[str, list[float]]] = {}
    for p in points:
        runs.setdefault(p["concurrency"], {})[p["policy"]] = p["system_tps_runs"]
    out = {}
    for c, by_policy in sorted(runs.items()):
        refs = {}
        if "none" in by_policy:
            refs["vs_none"] = by_policy["none"]
        fixed = [r for name, r in by_policy.items() if name.startswith("fixed")]
        if fixed:
            refs["vs_best_fixed"] = [max(cycle) for cycle in zip(*fixed)]
        out[str(c)] = {name: {key: statistics.median(a / b for a, b in zip(r, ref)) for key, ref in refs.items()}
                       for name, r in by_policy.items()}
    return out


def format_readouts(r: dict) -> str:
    lines = ["(a) system tokens/s at per-user speed >= S:"]
    for s, row in r["system_tps_at_per_user_speed"].items():
        vals = ", ".join(f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in row.items())
        lines.append(f"  S={s}: {vals}")
    lines.append("(b) per-user speed at each mtp1 point's throughput, relative to mtp1:")
    for row in r["per_user_at_matched_throughput_vs_mtp1"]:
        vals = ", ".join(f"{k} {'-' if v is None else f'{v:.2f}x'}" for k, v in row["vs_mtp1"].items())
        lines.append(f"  mtp1 c={row['mtp1_concurrency']} ({row['system_tps']:.1f} tok/s): {vals}")
    if "paired_system_tps_ratios" in r:
        lines.append("(c) system tokens/s over none's / over the best fixed-k's, paired by round-robin cycle (median):")
        for c, row in r["paired_system_tps_ratios"].items():
            vals = ", ".join(f"{k} " + " / ".join(f"{v:.3f}" for v in ratios.values()) for k, ratios in row.items())
            lines.append(f"  c={c}: {vals}")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Pareto plot: system tokens/s against per-user tokens/s, one line per policy (points = concurrencies)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    policies = dict.fromkeys(p["policy"] for p in data["points"])
    colors = plt.cm.tab20(np.linspace(0, 1, max(len(policies), 2)))
    for name, color in zip(policies, colors):
        pts = sorted((p for p in data["points"] if p["policy"] == name), key=lambda p: p["concurrency"])
        ax.plot([p["per_user_tps_median"] for p in pts], [p["system_tps"] for p in pts], marker="o", ms=3,
                color=color, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user tokens/s (median)")
    ax.set_ylabel("system tokens/s")
    ax.set_title(f"serving {data['mode']} ({data['profile']['source']} SPS: {data['profile']['device']})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(points: list[dict], path: Path) -> None:
    keys = list(dict.fromkeys(k for p in points for k in p if not isinstance(p[k], (list, dict))))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(points)


def run(args: argparse.Namespace) -> dict:
    target = load_model(args.model, gemm_dtype=args.gemm_dtype, batch_invariant=args.batch_invariant)
    drafter = load_drafter(args.drafter, target, gemm_dtype=args.gemm_dtype, draft_vocab=args.draft_vocab)
    cal = drafter_calibration(Path(args.drafter), args.gamma)
    runner = run_live if args.mode == "live" else run_replay
    points, profile, where = runner(args, target, drafter, cal)
    data = {
        "benchmark": "serving", "mode": args.mode, "model": Path(str(args.model)).stem, "device": device_record(),
        "profile": {"device": profile.device, "model": profile.model, "source": profile.source,
                    "formula": profile.formula, "origin": where},
        "settings": {"model": str(args.model), "drafter": str(args.drafter), "mtp1_drafter": str(args.mtp1_drafter),
                     "draft_vocab": args.draft_vocab, "threads": torch.get_num_threads(), "gamma": args.gamma,
                     "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                     "length_range": args.length_range if args.mode == "live" else None,
                     "prompt_len": args.prompt_len, "calibrated": cal.temperatures is not None,
                     "calibration_biases": None if cal.biases is None else cal.biases.tolist(),
                     "gate_prior": cal.prior_survival, "seed": args.seed,
                     "gemm_dtype": args.gemm_dtype, "batch_invariant": args.batch_invariant},
        "points": points,
    }
    data["readouts"] = readouts(points, args.speeds)
    print(format_readouts(data["readouts"]), flush=True)
    return data


MAX_CONCURRENCY = 1024


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors, before any model loads, for values argparse accepts but the run would fail on or silently
    replace: unknown policies, a gamma beyond the drafters' blocks, a concurrency beyond what the engine serves, an
    unreadable or invalid --profile, a --corpus that holds no corpus, a --prompts that is no prompt set, a bad
    --draft-vocab. Fills in the drafters shipped for --model and its draft vocabulary."""
    shipped = args.drafter is None
    for attr, name in (("drafter", "dspark"), ("mtp1_drafter", "mtp1")):
        if getattr(args, attr) is None:
            setattr(args, attr, shipped_drafter(args.model, name) or ASSETS / "drafters" / name)
    if not (Path(args.drafter) / "drafter_config.json").is_file():
        p.error(f"--drafter {args.drafter}: no drafter there (no drafter_config.json)")
    try:
        dirs = [Path(args.drafter)] + ([Path(args.mtp1_drafter)] if Path(args.mtp1_drafter).exists() else [])
        args.draft_vocab = draft_vocab_choice(args.draft_vocab, args.model, shipped, dirs)
    except ValueError as e:
        p.error(str(e))
    if args.prompts is not None and not (args.prompts / "manifest.json").is_file():
        p.error(f"--prompts {args.prompts} is no prompt set (no manifest.json); build one with "
                f"`python -m dspark_kernels.train.prompts --out {args.prompts}`")
    known = (*POLICY_NAMES, *GATED_POLICY_NAMES)
    unknown = [n for n in args.policies if n not in known]
    if unknown:
        p.error(f"--policies {unknown}: choose from {', '.join(known)}")
    if args.gamma > MAX_GAMMA:
        p.error(f"--gamma must be in 1..{MAX_GAMMA}, got {args.gamma}")
    too_many = [c for c in args.concurrency or () if c > MAX_CONCURRENCY]
    if too_many:
        p.error(f"--concurrency must be in 1..{MAX_CONCURRENCY}, got {too_many}")
    if args.profile is not None:
        try:
            read_profile(args.profile)
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--profile {args.profile}: {e}")
    if not (Path(args.corpus) / "manifest.json").is_file() and Path(args.corpus) != DEFAULT_CORPUS:
        p.error(f"--corpus {args.corpus} holds no corpus (no manifest.json); build one there with "
                f"`python -m dspark_kernels.train.corpus --out {args.corpus}`")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("live", "replay"), default="replay",
                   help="live: closed-loop serving on this machine; replay: recorded acceptance traces against an SPS "
                        "profile")
    p.add_argument("--model", type=model_source, default="dspark-target",
                   help="target: a registry name, an HF model directory or a GGUF file (default: the shipped target)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="DSpark drafter directory (the confidence policies read its calibrated head; default: the one "
                        "shipped for --model, else the small target's)")
    p.add_argument("--policies", nargs="+", default=list(POLICY_NAMES),
                   help="verify policies to compare (none, mtp1, fixedK, threshold0.5, smartspec, dspark, "
                        "dspark_prod, oracle, and the +gate variants)")
    p.add_argument("--mtp1-drafter", type=Path, default=None,
                   help="live: the drafter the mtp1 policy runs with, at gamma 1 (default: the one shipped for "
                        "--model, else the small target's; missing: --drafter's first draft)")
    p.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)
    p.add_argument("--prompts", type=Path, default=None,
                   help="chat prompts: a prompt-set directory (python -m dspark_kernels.train.prompts); its held-out "
                        "prompts of every domain, interleaved, rendered through the target's chat template (instead "
                        "of --corpus windows)")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=None,
                   help=f"default live {list(LIVE_CONCURRENCY)}, replay {list(REPLAY_CONCURRENCY)}")
    p.add_argument("--gamma", type=positive_int, default=7,
                   help="drafts per request per round (the block size), 1..16")
    p.add_argument("--temperature", type=non_negative_float, default=1.0,
                   help="sampling temperature of every request (0 = greedy)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="mean new tokens per request (see --length-range)")
    p.add_argument("--length-range", type=fraction_below_one, default=0.5,
                   help="live: each request's cap on new tokens is drawn from [1 - x, 1 + x] x --max-new-tokens "
                        "(seeded; the same draws for every policy), so requests do not start and finish in lockstep "
                        "as they never do in serving; 0: every request gets exactly --max-new-tokens")
    p.add_argument("--prompt-len", type=positive_int, default=64,
                   help="tokens per prompt")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help="corpus whose test split gives the prompts (without one at the default path: seeded random "
                        "token ids, labelled so)")
    p.add_argument("--domain", default="prose",
                   help="corpus domain the prompts come from")
    p.add_argument("--requests-per-level", type=positive_int, default=8, help="live: requests = this x concurrency")
    p.add_argument("--min-requests", type=positive_int, default=4, help="live: at least this many requests per point")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="live: runs per point, round-robin over the policies; the point is the median run")
    p.add_argument("--trace-prompts", type=positive_int, default=32, help="replay: prompts decoded to record traces")
    p.add_argument("--profile", type=Path, default=None, help="replay: SPS profile JSON (default: modelled H200 8B)")
    p.add_argument("--draft-profile", type=Path, default=None,
                   help="replay: the drafter's draft-round profile JSON at --gamma slots (rounds/s by request count); "
                        "charges every drafted round and lets the gated policies run (default: drafting is free)")
    p.add_argument("--narrow-draft-profile", type=Path, default=None,
                   help="replay: the same at one slot (with --draft-profile; widths between are interpolated)")
    p.add_argument("--sps-dir", type=Path, default=SPS_DIR, help="live: where measured profiles are stored")
    p.add_argument("--reprofile", action="store_true",
                   help="live: measure the profiles anew and overwrite the stored ones (a CPU profile describes the "
                        "machine as it was when measured: one taken while other work shared the cores reads slow)")
    p.add_argument("--speeds", type=positive_float, nargs="+", default=None, help="per-user speeds for read-out (a)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts, lengths and sampling")
    p.add_argument("--gemm-dtype", choices=sorted(GEMM_DTYPES), default="float32",
                   help="live: linear-layer weight dtype of target and drafter (bfloat16: weight-only bf16 GEMMs)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="live: the target with batch-invariant attention (a request's greedy output does not depend on "
                        "what it is batched with): what deterministic serving costs")
    p.add_argument("--json", type=Path, default=Path("results/serving.json"),
                   help="result JSON (a CSV and a plot are written next to it)")


def main(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if not 0 <= args.length_range < 1:
        raise ValueError(f"--length-range must be in [0, 1), got {args.length_range}")
    if args.narrow_draft_profile is not None and args.draft_profile is None:
        raise ValueError("--narrow-draft-profile needs --draft-profile (the draft rounds at --gamma slots)")
    if args.mode == "live" and (args.draft_profile is not None or args.profile is not None):
        raise ValueError("--profile and --draft-profile are for --mode replay (live mode measures its profiles)")
    for name in ("profile", "draft_profile", "narrow_draft_profile"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            raise ValueError(f"--{name.replace('_', '-')} {path}: no such file")
    if args.concurrency is None:
        args.concurrency = list(LIVE_CONCURRENCY if args.mode == "live" else REPLAY_CONCURRENCY)
    data = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    write_csv(data["points"], args.json.with_suffix(".csv"))
    plot(data, args.json.with_suffix(".png"))
    print(f"wrote {args.json} (+ .csv, .png)")

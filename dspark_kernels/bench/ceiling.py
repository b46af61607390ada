"""Parallel-drafting ceiling: how much a drafter that does not see its earlier drafts can accept on this target.

At temperature 1 a draft at position k is accepted with probability ``sum_x min(q_k(x), p_k(x | ctx, x_1..x_{k-1}))``
(given drafts 1..k-1 accepted). A parallel drafter (DFlash: rank 0) proposes ``q_k`` from the context alone, so the
best it can do at position k is

    ceiling_k = max over distributions q of  E_{x_<k ~ target} sum_x min(q(x), p_k(x | ctx, x_<k)),

which is below 1 whenever the target's continuation branches before k. DSpark's sequential head conditions ``q_k`` on
the previous draft only (a rank-r bias), an EAGLE-style chain on all of them (a full layer per step), so this ceiling
says how much of the gap to a chain drafter is structural, whatever the training budget.

For each domain the bench takes the acceptance benchmark's prompts, lets the target continue each at T = 1 and puts
an anchor every ``--stride`` tokens; from each anchor it samples ``--paths`` continuations of ``gamma`` tokens from
the target (T = 1) and reads the target's distributions along them (teacher forcing). ``ceiling_k`` is then solved
exactly over those paths (:func:`best_unconditioned_acceptance`, water-filling). With finitely many paths the optimum
is fitted in-sample, so it overestimates the true ceiling (more paths lower it; ``--paths`` sets how many). Position 1
sees no earlier draft, so its ceiling is 1 by construction (a check of the indexing).

The anchors' paths follow the target, while in a real round the accepted prefix follows ``min(q, p)``; the bench
measures the target-path version. At temperature 0 every path is the greedy one and the ceiling is 1 at every
position: there the gap to a chain drafter is capacity, not structure.

CLI: ``python -m dspark_kernels.bench ceiling --json results/ceiling.json`` (also writes ``.md``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..cli_args import model_source, positive_int
from ..models import CausalLM, forward_sequences, generate, load_model
from ..models.target_tokenizer import load_target_tokenizer
from . import device_record
from .acceptance import DOMAIN_SPLITS, benchmark_prompts


def best_unconditioned_acceptance(probs: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The distribution ``q [V]`` maximising ``mean_s sum_x min(q(x), probs[s, x])`` and that maximum.

    ``probs [S, V]``: S distributions over the same vocabulary (rows sum to 1). The objective is a sum over x of
    concave piecewise-linear functions of ``q(x)``: its slope in ``q(x)`` is the fraction of rows with
    ``probs[s, x] > q(x)``. Water-filling is therefore exact: take the segments (x, between consecutive sorted values
    of column x) in order of decreasing slope until their lengths sum to 1. Computed in float64, with each row
    renormalised to sum to exactly 1 (float32 softmax rows are off by ~1e-7).
    """
    if probs.dim() != 2 or probs.shape[0] < 1:
        raise ValueError(f"probs must be [S, V] with S >= 1, got shape {tuple(probs.shape)}")
    s, v = probs.shape
    p = probs.double()
    srt = (p / p.sum(dim=1, keepdim=True)).sort(dim=0, descending=True).values  # p_(1) >= ... >= p_(S) per column
    below = torch.cat([srt[1:], srt.new_zeros(1, v)])
    lengths = (srt - below).flip(0)  # row j: slope (S - j) / S, i.e. the steepest segments first
    slopes = torch.arange(s, 0, -1, dtype=torch.float64)[:, None] / s
    flat = lengths.reshape(-1)
    before = flat.cumsum(0) - flat
    taken = torch.minimum(flat, (1.0 - before).clamp(min=0.0)).view(s, v)
    return float((taken * slopes).sum()), taken.sum(dim=0)


def expected_acceptance(q: torch.Tensor, probs: torch.Tensor) -> float:
    """``mean_s sum_x min(q(x), probs[s, x])``: the acceptance of drafting from ``q [V]`` against each row of
    ``probs [S, V]``, averaged (float64)."""
    return float(torch.minimum(q.double()[None, :], probs.double()).sum(dim=1).mean())


@torch.no_grad()
def path_distributions(target: CausalLM, context: list[int], num_paths: int, gamma: int,
                       seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_paths`` continuations of ``context`` by ``gamma`` tokens that the target samples itself at T = 1 (seeds
    ``seed .. seed + num_paths - 1``): ``(dists [gamma, num_paths, V], tokens [num_paths, gamma])``, where
    ``dists[k - 1, s]`` is the target's distribution of position k given the context and path s's tokens before k."""
    paths = generate(target, [context] * num_paths, gamma, temperature=1.0, seeds=range(seed, seed + num_paths)).tokens
    c, n = len(context), len(context) + gamma - 1  # logits rows c-1 .. c+gamma-2 predict positions 1..gamma
    rows = (torch.arange(num_paths, device=target.device)[:, None] * n + (c - 1)
            + torch.arange(gamma, device=target.device)).reshape(-1)
    logits = forward_sequences(target, [(context + p)[:n] for p in paths], logits_indices=rows)[0].logits.float()
    dists = torch.softmax(logits, dim=-1).view(num_paths, gamma, -1).transpose(0, 1)
    return dists, torch.tensor(paths, dtype=torch.int64, device=target.device)


def ideal_prefix_acceptance(dists: torch.Tensor, tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """``P(drafts 1..k all accepted) [gamma]`` at T = 1 for a parallel drafter drawing position k from
    ``drafts[k - 1] [V]``, estimated over the target's own paths (``dists [gamma, S, V]``, ``tokens [S, gamma]``):
    ``sum over x_1..x_k of prod_j min(q_j(x_j), p_j(x_j | x_<j))`` is ``E_{x ~ target} prod_j min(1, q_j / p_j)``."""
    p_tok = dists.gather(2, tokens.t()[:, :, None]).squeeze(2).double()  # [gamma, S]
    q_tok = drafts.double().gather(1, tokens.t())  # [gamma, S]
    return torch.minimum(q_tok / p_tok, torch.ones_like(p_tok)).cumprod(dim=0).mean(dim=1)


def run(args: argparse.Namespace) -> dict:
    target = load_model(args.model)
    tokenizer = load_target_tokenizer(args.model)
    results = []
    for domain in args.domains:
        t0 = time.perf_counter()
        prompts = benchmark_prompts(tokenizer, Path(args.corpus), domain, args.num_prompts, args.prompt_len,
                                    args.seed)
        rollouts = generate(target, prompts, args.span, temperature=1.0, seeds=range(len(prompts))).tokens
        anchors = []
        for i, (prompt, rollout) in enumerate(zip(prompts, rollouts)):
            for offset in range(0, len(rollout), args.stride):
                dists, tokens = path_distributions(target, prompt + rollout[:offset], args.paths, args.gamma,
                                                   seed=1000 * (i * args.span + offset))
                best = [best_unconditioned_acceptance(d) for d in dists]
                survival = ideal_prefix_acceptance(dists, tokens, torch.stack([q for _, q in best]))
                entropy = (-(dists * dists.clamp_min(1e-30).log()).sum(-1)).mean(dim=1).tolist()
                anchors.append({"prompt": i, "offset": offset, "ceiling": [c for c, _ in best],
                                "ideal_survival": survival.tolist(), "entropy": entropy})
        by_pos = torch.tensor([a["ceiling"] for a in anchors]).mean(0).tolist()
        ent = torch.tensor([a["entropy"] for a in anchors]).mean(0).tolist()
        survival = torch.tensor([a["ideal_survival"] for a in anchors]).mean(0)
        tau = 1 + float(survival.sum())
        results.append({"domain": domain, "num_anchors": len(anchors), "ceiling_by_position": by_pos,
                        "ideal_survival_by_position": survival.tolist(), "ideal_parallel_tau": tau,
                        "entropy_by_position": ent, "anchors": anchors})
        print(f"{domain:8s} anchors={len(anchors)} ceiling " + " ".join(f"{x:.3f}" for x in by_pos)
              + f" ideal parallel tau {tau:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"benchmark": "ceiling", "device": device_record(), "settings": {
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "span": args.span, "stride": args.stride,
        "paths": args.paths, "gamma": args.gamma, "seed": args.seed, "model": str(args.model)}, "results": results}


def summary_table(data: dict, acceptance: dict | None) -> str:
    """Markdown, means over domains: the ceiling by position; the ideal parallel drafter (each position drawn from
    its ceiling's optimum) as conditional acceptance by position and tau; then each drafter's measured conditional
    acceptance and tau at T = 1 and the same gamma from an acceptance-benchmark JSON, when given."""
    gamma = data["settings"]["gamma"]
    res = data["results"]
    ceiling = torch.tensor([r["ceiling_by_position"] for r in res]).mean(0)
    survival = torch.tensor([r["ideal_survival_by_position"] for r in res]).mean(0)
    ideal = survival / torch.cat([torch.ones(1, dtype=survival.dtype), survival[:-1]])
    ideal_tau = sum(r["ideal_parallel_tau"] for r in res) / len(res)

    def row(name: str, values, tau: str) -> str:
        return f"| {name} | " + " | ".join(f"{float(x):.2f}" for x in values) + f" | {tau} |"

    lines = ["| T = 1 | " + " | ".join(f"pos {k + 1}" for k in range(gamma)) + " | tau |",
             "| --- | " + " | ".join("---" for _ in range(gamma)) + " | --- |",
             row("parallel ceiling (every anchor)", ceiling, ""),
             row("ideal parallel drafter (conditional)", ideal, f"{ideal_tau:.2f}")]
    if acceptance is not None:
        measured: dict[str, list[dict]] = {}
        for r in acceptance["results"]:
            if r["temperature"] == 1.0 and r["gamma"] == gamma:
                measured.setdefault(r["drafter"], []).append(r)
        for name, rows in measured.items():
            acc = torch.tensor([r["acceptance_by_position"] for r in rows]).nanmean(0)
            lines.append(row(f"{name} (measured)", acc, f"{sum(r['tau'] for r in rows) / len(rows):.2f}"))
    return "\n".join(lines) + "\n\n" + entropy_table(data)


ENTROPY_BUCKETS = ((0.0, 1.5), (1.5, 3.0), (3.0, float("inf")))


def entropy_table(data: dict) -> str:
    """Markdown: anchors grouped by the target's mean entropy (nats) over positions 1..gamma-1 of their paths; per
    group the share of anchors, the mean ceiling at positions 2.. and the ideal parallel drafter's tau."""
    anchors = [a for r in data["results"] for a in r["anchors"]]
    gamma = data["settings"]["gamma"]
    lines = ["| mean entropy (nats) | anchors | " + " | ".join(f"ceiling pos {k + 1}" for k in range(1, gamma))
             + " | ideal parallel tau |", "| --- | --- | " + " | ".join("---" for _ in range(1, gamma)) + " | --- |"]
    for lo, hi in ENTROPY_BUCKETS:
        group = [a for a in anchors if lo <= sum(a["entropy"][:-1]) / max(1, gamma - 1) < hi]
        if not group:
            continue
        ceiling = torch.tensor([a["ceiling"][1:] for a in group]).mean(0).tolist()
        tau = sum(1 + sum(a["ideal_survival"]) for a in group) / len(group)
        lines.append(f"| {lo:g} - {hi:g} | {len(group)} ({100 * len(group) / len(anchors):.0f}%) | "
                     + " | ".join(f"{c:.2f}" for c in ceiling) + f" | {tau:.2f} |")
    mean_h = sum(sum(a["entropy"]) / len(a["entropy"]) for a in anchors) / len(anchors)
    note = f"Mean entropy of the target's next-token distributions on these paths: {mean_h:.2f} nats."
    return "\n".join(lines) + "\n\n" + note + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_source, default="dspark-target",
                   help="target: a registry name, an HF model directory or a GGUF file (default: the shipped target)")
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"),
                   help="corpus whose test split gives the prompts (the default is built on first use)")
    p.add_argument("--domains", nargs="+", default=list(DOMAIN_SPLITS),
                   help="corpus domains to measure")
    p.add_argument("--num-prompts", type=positive_int, default=12,
                   help="prompts per domain")
    p.add_argument("--prompt-len", type=positive_int, default=64,
                   help="tokens per prompt")
    p.add_argument("--span", type=positive_int, default=96, help="tokens the target continues each prompt by (T = 1)")
    p.add_argument("--stride", type=positive_int, default=12,
                   help="an anchor every this many tokens of the continuation")
    p.add_argument("--paths", type=positive_int, default=32, help="continuations sampled per anchor")
    p.add_argument("--gamma", type=positive_int, default=7,
                   help="block size whose accepted length the ceiling bounds")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt windows")
    p.add_argument("--acceptance", type=Path, default=Path("results/acceptance.json"),
                   help="acceptance-benchmark JSON whose measured rows the table shows next to the ceiling")
    p.add_argument("--json", type=Path, default=Path("results/ceiling.json"),
                   help="result JSON (a markdown table is written next to it)")


def main(args: argparse.Namespace) -> None:
    from ..train.corpus import build_corpus

    for name in ("num_prompts", "span", "stride", "paths", "gamma"):  # for callers that bypass the parser
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "build_corpus", False):
        build_corpus(Path(args.corpus))
    data = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    acceptance = json.loads(args.acceptance.read_text()) if args.acceptance.exists() else None
    table = summary_table(data, acceptance)
    args.json.with_suffix(".md").write_text(table)
    print(table)

"""Acceptance benchmark: accepted length tau and per-position acceptance of every shipped drafter.

For each domain (code, prose, heldout) x drafter x temperature x gamma, the shipped target decodes the same prompts
speculatively (full gamma verified every round, no scheduler) and the verifier's statistics are collected:

* ``tau``: mean tokens emitted per round = accepted drafts + the correction/bonus token (DeepSpec/DFlash convention);
* ``acceptance_by_position[j]``: conditional acceptance P(draft j+1 accepted | drafts 1..j accepted);
* ``accept_hist[a]``: rounds that accepted exactly ``a`` drafts.

Prompts are windows of the corpus's *test* split (never training text, and not the validation text used for
calibration rollouts). MTP-1 verifies one draft by construction, so it runs at gamma 1 only.

CLI: ``python -m dspark_kernels.bench acceptance --json results/acceptance.json`` (also writes ``.md`` and ``.png``
next to it).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from ..cli_args import model_source, positive_int
from ..engine.speculative import speculative_generate
from ..models import load_model
from ..models.drafter_api import load_drafter
from ..models.target_tokenizer import TargetTokenizer, load_target_tokenizer
from ..train.corpus import read_split
from . import ASSETS, DRAFTERS, device_record

DOMAIN_SPLITS = {"code": "test", "prose": "test", "heldout": "test"}


def benchmark_prompts(tokenizer: TargetTokenizer, corpus_dir: Path, domain: str, n: int, prompt_len: int,
                      seed: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` tokens (the tokenizer's prefix, e.g. BOS, + a window) from the domain's test
    split, seeded."""
    rng = random.Random(seed)
    docs = tokenizer.encode_batch(read_split(corpus_dir, domain, DOMAIN_SPLITS[domain]))
    docs = [d for d in docs if len(d) > prompt_len + 8]
    if not docs:
        raise ValueError(f"--prompt-len {prompt_len}: no {domain} document of the corpus's test split is longer than "
                         f"{prompt_len + 8} tokens; use a shorter prompt length")
    prompts = []
    for _ in range(n):
        ids = rng.choice(docs)
        start = rng.randrange(0, len(ids) - prompt_len)
        prompts.append((tokenizer.prefix + ids[start:])[:prompt_len])
    return prompts


def run(args: argparse.Namespace) -> dict:
    target = load_model(args.model)
    tokenizer = load_target_tokenizer(args.model)
    results = []
    for name in args.drafters:
        drafter = load_drafter(Path(args.drafter_dir) / name, target)
        gammas = [1] if name == "mtp1" else args.gammas
        for domain in args.domains:
            prompts = benchmark_prompts(tokenizer, Path(args.corpus), domain, args.num_prompts, args.prompt_len,
                                        args.seed)
            for temperature in args.temperatures:
                for gamma in gammas:
                    t0 = time.perf_counter()
                    res = speculative_generate(target, drafter, prompts, args.max_new_tokens, gamma,
                                               temperature=temperature, seeds=list(range(len(prompts))),
                                               eos_token_id=list(tokenizer.eos_token_ids))
                    results.append({
                        "domain": domain, "drafter": name, "temperature": temperature, "gamma": gamma,
                        "tau": res.tau, "acceptance_by_position": res.acceptance_by_position,
                        "accept_hist": res.accept_hist, "num_prompts": len(prompts), "num_rounds": res.rounds,
                        "new_tokens": res.num_generated, "seconds": time.perf_counter() - t0,
                    })
                    print(f"{domain:8s} {name:14s} T={temperature:g} gamma={gamma:2d} tau={res.tau:.3f} "
                          f"rounds={res.rounds}", flush=True)
    return {"benchmark": "acceptance", "device": device_record(), "settings": {
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
        "seed": args.seed, "model": str(args.model)}, "results": results}


def summary_table(data: dict) -> str:
    """Markdown: tau per (drafter, T, gamma) and domain, with the mean over domains."""
    rows: dict[tuple, dict[str, float]] = {}
    domains: list[str] = []
    for r in data["results"]:
        rows.setdefault((r["drafter"], r["temperature"], r["gamma"]), {})[r["domain"]] = r["tau"]
        if r["domain"] not in domains:
            domains.append(r["domain"])
    lines = ["| drafter | T | gamma | " + " | ".join(domains) + " | mean |",
             "| --- | --- | --- | " + " | ".join("---" for _ in domains) + " | --- |"]
    for (drafter, t, g), taus in rows.items():
        vals = [taus.get(d, float("nan")) for d in domains]
        lines.append(f"| {drafter} | {t:g} | {g} | " + " | ".join(f"{v:.2f}" for v in vals)
                     + f" | {sum(vals) / len(vals):.2f} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    """Conditional acceptance by position, one panel per domain, one line per drafter (T=1, largest gamma)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({r["domain"] for r in data["results"]})
    temps = sorted({r["temperature"] for r in data["results"]})
    temp = 1.0 if 1.0 in temps else temps[-1]
    fig, axes = plt.subplots(1, len(domains), figsize=(4.5 * len(domains), 3.6), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        rs = [r for r in data["results"] if r["domain"] == domain and r["temperature"] == temp]
        for name in dict.fromkeys(r["drafter"] for r in rs):
            mine = max((r for r in rs if r["drafter"] == name), key=lambda r: r["gamma"])
            acc = mine["acceptance_by_position"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {mine['tau']:.2f})")
        ax.set_title(f"{domain}, T={temp:g}")
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("conditional acceptance")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_source, default="dspark-target",
                   help="target: a registry name, an HF model directory or a GGUF file (default: the shipped target)")
    p.add_argument("--drafter-dir", type=Path, default=ASSETS / "drafters")
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS))
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--domains", nargs="+", choices=list(DOMAIN_SPLITS), default=list(DOMAIN_SPLITS))
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--gammas", type=int, nargs="+", default=[7, 15])
    p.add_argument("--num-prompts", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("results/acceptance.json"))
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="do not run: combine these result JSONs (e.g. drafters split over processes) into --json")


def merge(paths: list[Path]) -> dict:
    """One result dict from several runs with the same settings (their ``results`` concatenated)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    for p, other in zip(paths[1:], runs[1:]):
        if other["settings"] != runs[0]["settings"]:
            raise ValueError(f"--merge: {p} was run with settings {other['settings']}, "
                             f"{paths[0]} with {runs[0]['settings']}")
    return {**runs[0], "results": [r for run in runs for r in run["results"]]}


def main(args: argparse.Namespace) -> None:
    from ..train.corpus import build_corpus

    if args.merge:
        data = merge(args.merge)
    else:
        if not (Path(args.corpus) / "manifest.json").exists():
            build_corpus(Path(args.corpus))
        data = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    table = summary_table(data)
    args.json.with_suffix(".md").write_text(table)
    plot(data, args.json.with_suffix(".png"))
    print(table)

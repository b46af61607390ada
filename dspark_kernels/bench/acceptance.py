"""Acceptance benchmark: accepted length tau and per-position acceptance of every shipped drafter.

For each domain (code, prose, heldout) x drafter x temperature x gamma, the shipped target decodes the same prompts
speculatively (full gamma verified every round, no scheduler) and the verifier's statistics are collected:

* ``tau``: mean tokens emitted per round = accepted drafts + the correction/bonus token (DeepSpec/DFlash convention);
* ``acceptance_by_position[j]``: conditional acceptance P(draft j+1 accepted | drafts 1..j accepted);
* ``accept_hist[a]``: rounds that accepted exactly ``a`` drafts.

Prompts are either chat prompts (``--prompts``: a prompt-set directory of ``python -m
dspark_kernels.train.prompts``, whose *held-out* prompts of each domain are used, or a JSON file holding a list of
``{"id", "prompt"}`` user messages, domain ``custom``), each rendered through the target's chat template; or, without
``--prompts``, windows of the corpus's *test* split (never training text, and not the validation text used for
calibration rollouts). MTP-1 verifies one draft by construction, so it runs at gamma 1 only. Every value is checked
before any model loads.

CLI: ``python -m dspark_kernels.bench acceptance --json results/acceptance.json`` (also writes ``.md`` and ``.png``
next to it); on SmolLM2: ``python -m dspark_kernels.bench acceptance --model smollm2-135m-instruct --prompts
data/prompts --json results/acceptance_smollm2.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from ..cli_args import DEFAULT_CORPUS, DRAFT_VOCAB_HELP, check_corpus, draft_vocab_choice, model_source, positive_int
from ..drafters import load_drafter
from ..drafters.block_drafter import MAX_GAMMA
from ..engine.speculative import speculative_generate
from ..models import load_model
from ..models.registry import REGISTRY
from ..models.target_tokenizer import TargetTokenizer, load_target_tokenizer
from ..train.corpus import read_split
from ..train.prompts import DOMAINS as PROMPT_DOMAINS
from ..train.prompts import read_prompts
from . import DRAFTERS, device_record

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


def chat_benchmark_prompts(tokenizer: TargetTokenizer, source: Path, domains: list[str],
                           n: int) -> dict[str, list[list[int]]]:
    """Per domain, the first ``n`` chat prompts of ``source`` rendered through the chat template: the held-out prompts
    of a prompt-set directory (``domains`` of it), or the user messages of a JSON file (domain ``custom``)."""
    if source.is_dir():
        records = {d: read_prompts(source, d, "heldout")[:n] for d in domains}
    else:
        records = {"custom": read_prompt_file(source)[:n]}
    return {d: [tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]) for r in recs]
            for d, recs in records.items()}


def read_prompt_file(path: Path) -> list[dict]:
    """A JSON list of ``{"id", "prompt"}`` objects (``prompt`` a non-empty string); ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--prompts {path}: not a readable JSON file: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"--prompts {path}: expected a non-empty JSON list of {{\"id\", \"prompt\"}} objects")
    for k, rec in enumerate(data):
        if not isinstance(rec, dict) or "id" not in rec or not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
            raise ValueError(f"--prompts {path}: entry {k} is not an object with an \"id\" and a non-empty "
                             f"\"prompt\" string")
    return data


def run(args: argparse.Namespace) -> dict:
    target = load_model(args.model)
    tokenizer = load_target_tokenizer(args.model)
    if args.prompts is not None:
        if tokenizer.chat_template is None:
            raise ValueError(f"--prompts: {args.model} has no chat template to render chat prompts with")
        prompt_sets = chat_benchmark_prompts(tokenizer, args.prompts, args.domains, args.num_prompts)
    else:
        prompt_sets = {d: benchmark_prompts(tokenizer, Path(args.corpus), d, args.num_prompts, args.prompt_len,
                                            args.seed) for d in args.domains}
    results = []
    for name in args.drafters:
        drafter = load_drafter(Path(args.drafter_dir) / name, target, draft_vocab=args.draft_vocab)
        gammas = [1] if name == "mtp1" else args.gammas
        for domain, prompts in prompt_sets.items():
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
        "seed": args.seed, "model": str(args.model), "drafter_dir": str(args.drafter_dir),
        "draft_vocab": args.draft_vocab,
        "prompts": str(args.prompts) if args.prompts is not None else f"corpus:{args.corpus}"}, "results": results}


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
    p.add_argument("--drafter-dir", type=Path, default=None,
                   help="directory holding one subdirectory per drafter (default: the drafters shipped for --model)")
    p.add_argument("--drafters", nargs="+", default=None,
                   help=f"drafter subdirectories to benchmark (default: those of {', '.join(DRAFTERS)} present)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="chat prompts: a prompt-set directory (its held-out prompts) or a JSON list of {id, prompt}; "
                        "default: windows of --corpus")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help=f"corpus whose test split gives the prompt windows without --prompts (the default, "
                        f"{DEFAULT_CORPUS}, is built on first use; another path must hold a corpus)")
    p.add_argument("--domains", nargs="+", default=None,
                   help=f"domains (default: {', '.join(DOMAIN_SPLITS)} for corpus windows, "
                        f"{', '.join(PROMPT_DOMAINS)} for a prompt set)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="sampling temperatures (>= 0)")
    p.add_argument("--gammas", type=int, nargs="+", default=[7, 15], help=f"block sizes, 1..{MAX_GAMMA}")
    p.add_argument("--num-prompts", type=positive_int, default=16, help="prompts per domain")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="tokens per corpus window (<= 2048)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="most new tokens per prompt (<= 4096)")
    p.add_argument("--seed", type=int, default=0, help="prompt-window and sampling seed, 0..2**31 - 1")
    p.add_argument("--json", type=Path, default=Path("results/acceptance.json"),
                   help="result JSON (the .md table and .png plot are written next to it)")
    p.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="do not run: combine these result JSONs (e.g. drafters split over processes) into --json")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for values argparse accepts but the run would fail on (before any model loads); resolves the
    defaults of ``--drafter-dir`` and ``--domains``."""
    import math

    bad_t = [t for t in args.temperatures if not (math.isfinite(t) and t >= 0)]
    if bad_t:
        p.error(f"--temperatures must be finite and >= 0, got {bad_t}")
    bad_g = [g for g in args.gammas if not 1 <= g <= MAX_GAMMA]
    if bad_g:
        p.error(f"--gammas must lie in 1..{MAX_GAMMA}, got {bad_g}")
    if args.prompt_len > 2048:
        p.error(f"--prompt-len must be <= 2048, got {args.prompt_len}")
    if args.max_new_tokens > 4096:
        p.error(f"--max-new-tokens must be <= 4096, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**31:
        p.error(f"--seed must be in 0..2**31 - 1, got {args.seed}")
    if args.merge:
        return
    shipped = args.drafter_dir is None
    if args.drafter_dir is None:
        spec = REGISTRY.get(args.model) if isinstance(args.model, str) else None
        if spec is None or spec.drafters is None:
            p.error(f"--drafter-dir is required: no drafters are shipped for --model {args.model}")
        args.drafter_dir = spec.drafters
    if args.drafters is None:
        args.drafters = [d for d in DRAFTERS if (Path(args.drafter_dir) / d / "drafter_config.json").is_file()]
        if not args.drafters:
            p.error(f"--drafter-dir: no such drafter under {args.drafter_dir} (looked for {', '.join(DRAFTERS)})")
    missing = [d for d in args.drafters if not (Path(args.drafter_dir) / d / "drafter_config.json").is_file()]
    if missing:
        p.error(f"--drafters {missing}: no such drafter under {args.drafter_dir}")
    try:
        args.draft_vocab = draft_vocab_choice(args.draft_vocab, args.model, shipped,
                                              [Path(args.drafter_dir) / d for d in args.drafters])
    except ValueError as e:
        p.error(str(e))
    allowed = list(PROMPT_DOMAINS) if args.prompts is not None and args.prompts.is_dir() else list(DOMAIN_SPLITS)
    if args.domains is None:
        args.domains = allowed
    elif args.prompts is None or args.prompts.is_dir():
        unknown = [d for d in args.domains if d not in allowed]
        if unknown:
            p.error(f"--domains {unknown}: choose from {allowed}")
    if args.prompts is not None:
        if not args.prompts.exists():
            p.error(f"--prompts {args.prompts} does not exist")
        try:
            if args.prompts.is_dir():
                for d in args.domains:
                    read_prompts(args.prompts, d, "heldout")
            else:
                read_prompt_file(args.prompts)
        except (OSError, ValueError) as e:
            p.error(str(e))
    else:
        args.build_corpus = check_corpus(p, args.corpus)


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
        try:
            data = merge(args.merge)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: --merge: {e}") from None
    else:
        if args.prompts is None and getattr(args, "build_corpus", False):
            build_corpus(Path(args.corpus))
        data = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    table = summary_table(data)
    args.json.with_suffix(".md").write_text(table)
    plot(data, args.json.with_suffix(".png"))
    print(table)

"""End-to-end speculative decoding demo: ``python -m dspark_kernels.demo``.

Loads SmolLM2-135M-Instruct (fetched on first use) and the DSpark and DFlash drafters shipped for it (or yours:
``--model``, ``--drafter``; ``--model dspark-target`` selects the small shipped target and its drafters), decodes
chat prompts of three domains (code, math, chat; rendered through the target's chat template, or raw text prompts
for a target without one) at batch size 1 with plain autoregressive decoding, DSpark and DFlash, streams DSpark's
text as it is accepted, and prints
a table of tokens/s, accepted length tau and speedup over autoregressive decoding, all measured side by side in this
run: every prompt is decoded ``--repeats`` times by each method, interleaved, and each method is timed by its fastest
run. At temperature 0 it also checks that every method produced the target's own greedy text.

By default the drafters draft an adaptive number of tokens per round (``--draft-length adaptive``, at most
``--gamma``, default 15): the round costs of each drafter are measured at start (:func:`measure_round_costs`) and
:class:`AdaptiveDraftLength` picks each round's length from the acceptance so far, down to plain decode steps where
drafting does not pay; ``--draft-length fixed`` drafts ``--gamma`` (default 7) every round. tau counts every target
forward after the prefill (a plain step emits one token). ``--json`` writes the settings, ``model``, ``drafters``,
``device`` (with the git commit), ``runs`` (all prompts), ``by_domain`` and ``by_prompt`` (each prompt alone), one
row per method with ``method``, ``domain``, ``tokens_per_s``, ``tau``, ``new_tokens`` and ``speedup``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from .bench import device_record
from .cli_args import DRAFT_VOCAB_HELP, draft_vocab_choice, model_source
from .drafters import load_drafter
from .engine.draft_length import DRAFT_LENGTH_MODES, AdaptiveDraftLength, cli_gamma, measure_round_costs
from .engine.speculative import speculative_generate
from .models import generate, load_model
from .models.gemm_dtype import GEMM_DTYPES
from .models.registry import shipped_drafter
from .models.target_tokenizer import load_target_tokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_NEW_TOKENS = 4096
# user messages for a chat target, per domain
CHAT_PROMPTS = {
    "code": ["Write a Python function `count_words(text)` that returns a dictionary mapping each word to the number "
             "of times it appears.",
             "Explain what this Python code does:\n\n```python\nsquares = [x * x for x in range(10) if x % 2]\n```"],
    "math": ["A shop sells pencils at 3 dollars each. Maria buys 7 pencils and pays with a 50 dollar bill. How much "
             "change does she get? Explain step by step.",
             "Solve for x: 4x + 9 = 37. Show your steps."],
    "chat": ["Give me three tips for sleeping better.",
             "Explain in simple words what a computer network is."],
}
# raw text prompts for a target without a chat template (the small shipped target)
TEXT_PROMPTS = {
    "code": ["import os\n\n\ndef list_python_files(root):\n", "class Stack:\n    def __init__(self):\n"],
    "prose": ["The module provides", "Return a new list containing"],
    "heldout": ["#ifndef Py_LIST_H\n#define Py_LIST_H\n", "/* Object protocol */\n\nPyAPI_FUNC(int) "],
}


def _run_ar(target, prompt, args, eos):
    return generate(target, [prompt], args.max_new_tokens, temperature=args.temperature, seeds=[args.seed],
                    eos_token_id=eos, impl=args.impl)


def _run_spec(target, drafter, prompt, args, eos, schedule=None, on_tokens=None):
    return speculative_generate(target, drafter, [prompt], args.max_new_tokens, args.gamma,
                                temperature=args.temperature, seeds=[args.seed], eos_token_id=eos,
                                impl=args.impl, on_tokens=on_tokens, draft_length=schedule)


def _zero_totals(methods) -> dict:
    """Per method (``ar`` first): summed new tokens, seconds, rounds and emitted tokens (tau * rounds), all zero."""
    return {m: {"tokens": 0, "seconds": 0.0, "rounds": 0, "emitted": 0.0} for m in ("ar", *methods)}


def _rows(totals: dict, identical: dict | None) -> list[dict]:
    """tokens/s, tau and speedup over AR of every method from its summed tokens, seconds and rounds."""
    ar_tps = totals["ar"]["tokens"] / totals["ar"]["seconds"]
    rows = [{"method": "ar", "tokens_per_s": ar_tps, "tau": 1.0, "new_tokens": totals["ar"]["tokens"],
             "speedup": 1.0}]
    for name, t in totals.items():
        if name == "ar":
            continue
        tps = t["tokens"] / t["seconds"]
        rows.append({"method": name, "tokens_per_s": tps, "tau": t["emitted"] / max(t["rounds"], 1),
                     "new_tokens": t["tokens"], "speedup": tps / ar_tps,
                     "identical_to_ar": identical[name] if identical is not None else None})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m dspark_kernels.demo", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", help="decode only this prompt (a user message for a chat target; default: built-in "
                                    "prompts per domain)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--gamma", type=int, default=None,
                   help="draft length (fixed), or the most a round drafts (adaptive); default 7 fixed, 15 adaptive")
    p.add_argument("--draft-length", choices=sorted(DRAFT_LENGTH_MODES), default="adaptive",
                   help="adaptive: each round's length from the measured round costs and the acceptance so far")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per prompt")
    p.add_argument("--impl", choices=("auto", "triton", "torch"), default=None,
                   help="kernel implementation (default: Triton on a GPU, the PyTorch reference on a CPU)")
    p.add_argument("--model", type=model_source, default=DEFAULT_MODEL,
                   help=f"target: a registry name, an HF model directory or a GGUF file (default: {DEFAULT_MODEL}, "
                        f"fetched on first use)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="DSpark drafter directory (default: the one shipped for a registry --model)")
    p.add_argument("--baseline-drafter", type=Path, default=None,
                   help="DFlash comparison drafter (default: the one shipped for a registry --model; none otherwise)")
    p.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)
    p.add_argument("--seed", type=int, default=0, help="sampling seed, 0 .. 2**31 - 1")
    p.add_argument("--repeats", type=int, default=3,
                   help="decode every prompt this many times with each method, interleaved, and time each method by "
                        "its fastest run (the first run streams the text)")
    p.add_argument("--gemm-dtype", choices=sorted(GEMM_DTYPES), default="float32",
                   help="dtype of the linear layers' weights for every method (activations stay fp32); bf16 GEMMs pay "
                        "on CPUs with native bf16 (avx512_bf16 / AMX) and on GPUs")
    p.add_argument("--drafter-gemm-dtype", choices=sorted(GEMM_DTYPES), default="float32",
                   help="dtype of the drafters' own linear layers' weights (their LM head is the target's): it decides "
                        "only which tokens are proposed, never the output; fp32 is the faster at a draft block's few "
                        "rows on CPUs whose small bf16 GEMMs have a high fixed cost")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant attention in the target: a token's logits do not depend on how many tokens "
                        "share its forward, so at T=0 every method reproduces AR bit for bit on any prompt (slower "
                        "attention on the CPU)")
    p.add_argument("--json", type=Path, help="write machine-readable stats here")
    args = p.parse_args(argv)
    check_demo_args(p, args)

    t_load = time.perf_counter()
    try:
        target = load_model(args.model, gemm_dtype=args.gemm_dtype, batch_invariant=args.batch_invariant)
        tokenizer = load_target_tokenizer(args.model)
        drafter_paths = {"dspark": args.drafter}
        if args.baseline_drafter is not None:
            drafter_paths["dflash"] = args.baseline_drafter
        methods = {name: load_drafter(path, target, gemm_dtype=args.drafter_gemm_dtype, draft_vocab=args.draft_vocab)
                   for name, path in drafter_paths.items()}
    except (OSError, ValueError) as e:  # missing or malformed checkpoints (CheckpointError is a ValueError)
        p.error(f"cannot load the models: {e}")
    chat = tokenizer.chat_template is not None
    prompts = {"custom": [args.prompt]} if args.prompt is not None else CHAT_PROMPTS if chat else TEXT_PROMPTS
    print(f"loaded target + {len(methods)} drafter(s) in {time.perf_counter() - t_load:.1f}s; "
          f"{args.draft_length} draft length (gamma {'<= ' if args.draft_length == 'adaptive' else ''}{args.gamma}), "
          f"T={args.temperature:g}, {args.max_new_tokens} new tokens per prompt, batch 1, {args.gemm_dtype} GEMM "
          f"weights ({args.drafter_gemm_dtype} in the drafters)"
          f"{', batch-invariant attention' if args.batch_invariant else ''}"
          f"{f', draft vocabulary {args.draft_vocab}' if args.draft_vocab else ''}")
    eos = list(tokenizer.eos_token_ids)
    warm = tokenizer.encode_prompt("def f(x):")
    _run_ar(target, warm, args, eos)
    schedules = {name: None for name in methods}
    for name, drafter in methods.items():
        _run_spec(target, drafter, warm, args, eos)
        if args.draft_length == "adaptive":
            costs = measure_round_costs(target, drafter, warm, args.gamma)
            schedules[name] = AdaptiveDraftLength(costs)
            print(f"{name}: a round of k drafts costs 1 + {costs.fixed:.2f} + {costs.per_token:.3f} k plain steps")
    print()

    identical = {m: True for m in methods}
    items = [(d, text) for d, texts in prompts.items() for text in texts]
    # totals[domain]: _zero_totals rows, summed over the domain's prompts; domain "all" sums every prompt
    totals = {d: _zero_totals(methods) for d in ("all", *prompts)}
    by_prompt: list[dict] = []  # the same rows for each prompt alone (k = 1.. in the order decoded)
    for k, (domain, text) in enumerate(items, 1):
        ids = tokenizer.encode_prompt(text)
        print(f"--- [{k}/{len(items)}] {domain} --- DSpark output (streamed as accepted):")
        sys.stdout.write(f"[user] {text}\n[assistant] " if chat else text)
        ar = _run_ar(target, ids, args, eos)
        results = {}
        for name, drafter in methods.items():
            pieces = tokenizer.stream(skip_special_tokens=True)
            stream = (lambda i, toks: (sys.stdout.write(pieces.push(toks)), sys.stdout.flush())) \
                if name == "dspark" else None
            results[name] = _run_spec(target, drafter, ids, args, eos, schedules[name], on_tokens=stream)
            if name == "dspark":
                sys.stdout.write(pieces.flush())
            identical[name] &= results[name].tokens == ar.tokens
        # the same decodes again, interleaved; each method is timed by its fastest run (same seed, same tokens)
        seconds = {"ar": ar.elapsed_s, **{name: res.elapsed_s for name, res in results.items()}}
        for _ in range(args.repeats - 1):
            seconds["ar"] = min(seconds["ar"], _run_ar(target, ids, args, eos).elapsed_s)
            for name, drafter in methods.items():
                again = _run_spec(target, drafter, ids, args, eos, schedules[name])
                seconds[name] = min(seconds[name], again.elapsed_s)
        mine = _zero_totals(methods)
        for tot in (totals["all"], totals[domain], mine):
            tot["ar"]["tokens"] += ar.num_generated
            tot["ar"]["seconds"] += seconds["ar"]
            for name, res in results.items():
                t = tot[name]
                t["tokens"] += res.num_generated
                t["seconds"] += seconds[name]
                t["rounds"] += res.rounds
                t["emitted"] += res.tau * res.rounds
        rows = _rows(mine, None)
        by_prompt += [{"prompt": k, "domain": domain, **row} for row in rows]
        print("\n    [" + "; ".join(f"{r['method']} {r['tokens_per_s']:.0f} tok/s, tau {r['tau']:.2f}" for r in rows)
              + "]\n")

    runs = [{"domain": "all", **row} for row in _rows(totals["all"], identical if args.temperature == 0 else None)]
    by_domain = [{"domain": d, **row} for d in prompts for row in _rows(totals[d], None)]
    print(f"{'domain':8s} {'method':8s} {'tokens/s':>9s} {'tau':>6s} {'speedup':>8s}  identical to AR")
    for d, rows in [("all", runs)] + [(d, [r for r in by_domain if r["domain"] == d]) for d in prompts]:
        for r in rows:
            same = "-" if r["method"] == "ar" or r.get("identical_to_ar") is None else str(r["identical_to_ar"])
            print(f"{d:8s} {r['method']:8s} {r['tokens_per_s']:9.1f} {r['tau']:6.2f} {r['speedup']:7.2f}x  {same}")
    costs = {name: vars(sched.costs) for name, sched in schedules.items() if sched is not None}
    out = {"model": str(args.model), "drafters": {name: str(path) for name, path in drafter_paths.items()},
           "device": device_record(),
           "settings": {"gamma": args.gamma, "draft_length": args.draft_length, "round_costs": costs,
                        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                        "prompts": len(items), "batch_size": 1, "threads": torch.get_num_threads(),
                        "gemm_dtype": args.gemm_dtype, "drafter_gemm_dtype": args.drafter_gemm_dtype,
                        "batch_invariant": args.batch_invariant, "repeats": args.repeats,
                        "draft_vocab": args.draft_vocab}, "runs": runs,
           "by_domain": by_domain, "by_prompt": by_prompt}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


def check_demo_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every value checked, and the default drafters resolved, before any model loads (usage errors via ``p``)."""
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        p.error(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**31:
        p.error(f"--seed must be in 0..2**31 - 1, got {args.seed}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.impl == "triton" and not torch.cuda.is_available():
        p.error("--impl triton needs a CUDA GPU (none is visible); use --impl torch or auto")
    try:
        args.gamma = cli_gamma(args.gamma, args.draft_length)
    except ValueError as e:
        p.error(str(e))
    shipped = args.drafter is None
    if args.drafter is None:
        args.drafter = shipped_drafter(args.model, "dspark")
        if args.drafter is None:
            p.error(f"--drafter is required: no DSpark drafter is shipped for --model {args.model}")
        if args.baseline_drafter is None:
            args.baseline_drafter = shipped_drafter(args.model, "dflash")
    dirs = [d for d in (args.drafter, args.baseline_drafter) if d is not None]
    for name in ("drafter", "baseline_drafter"):
        path = getattr(args, name)
        if path is not None and not (path / "drafter_config.json").is_file():
            p.error(f"--{name.replace('_', '-')} {path} is not a drafter directory (no drafter_config.json)")
    try:
        args.draft_vocab = draft_vocab_choice(args.draft_vocab, args.model, shipped, dirs)
    except ValueError as e:
        p.error(str(e))
    if args.json is not None:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"--json {args.json}: cannot create its directory: {e}")
        if args.json.is_dir() or not os.access(args.json if args.json.exists() else args.json.parent, os.W_OK):
            p.error(f"--json {args.json} cannot be written")


if __name__ == "__main__":
    main()

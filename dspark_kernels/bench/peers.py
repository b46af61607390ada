"""Peer comparison: the shipped target decoded by ``transformers`` and by us, greedy, side by side in one run.

Methods (batch 1, temperature 0, the same prompts and ``--max-new-tokens``, EOS honoured by all):

* ``hf_generate``: ``Qwen3ForCausalLM.generate`` (plain autoregressive decoding with the HF dynamic cache);
* ``hf_assisted``: assisted generation with the shipped small same-tokenizer model (``assets/assistant``: 2 layers,
  hidden 128, trained on the same corpus) as ``assistant_model``, transformers' default draft-length schedule;
* ``hf_prompt_lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens``, n-gram drafts copied from the context);
* ``ar``: our runtime's plain decode (:func:`dspark_kernels.models.generate`);
* one run per block/chain drafter named in ``--drafters`` (default: ``dspark``): our speculative loop, with the
  adaptive draft length (``--draft-length adaptive``, at most ``--gamma``, default 15; round costs measured at start
  per drafter, :mod:`dspark_kernels.engine.draft_length`) or a fixed one (``--draft-length fixed``, default 7).

Every method is warmed up once, then every prompt is decoded ``--repeats`` times by every method, the methods
interleaved (one pass over methods and prompts per repeat, so a slow drift of a shared machine hits all alike), and
each method is timed by its fastest decode of each prompt; tokens/s = new tokens / the sum of those seconds. Greedy
decoding is deterministic, so the repeats return the same tokens. ``identical_to_ar``
says whether a method produced exactly our AR decode's tokens on every prompt (HF runs in float32, like ours by
default; a greedy tie broken differently by a different kernel would show here, not be hidden). ``--gemm-dtype
bfloat16`` runs our methods with weight-only bf16 GEMMs (:mod:`dspark_kernels.models.gemm_dtype`); their text is then
the bf16-GEMM target's, so the HF rows may differ from our AR. ``--drafter-gemm-dtype`` (default float32) sets our
drafters' own layers apart from the target's.

CLI: ``python -m dspark_kernels.bench peers --json results/peers.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..cli_args import model_source, non_negative_int, positive_int
from ..demo import TEXT_PROMPTS as PROMPTS
from ..engine.draft_length import DRAFT_LENGTH_MODES, AdaptiveDraftLength, cli_gamma, measure_round_costs
from ..engine.speculative import speculative_generate
from ..models import generate, load_model
from ..models.convert import converted_directory
from ..models.drafter_api import load_drafter
from ..models.gemm_dtype import GEMM_DTYPES
from ..models.target_tokenizer import load_target_tokenizer
from . import ASSETS, device_record


def _hf_runner(model: str | Path, assistant_dir: Path | None, lookup_tokens: int, eos: list[int]):
    """``{method: fn(prompt_ids) -> new token ids}`` for the transformers methods (a GGUF target runs from its
    dequantized Hugging Face directory, :func:`converted_directory`, so both runtimes hold the same fp32 weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted_directory(model), dtype=torch.float32).eval()
    common = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "eos_token_id": eos,
              "pad_token_id": eos[0]}
    runs = {"hf_generate": {}}
    if assistant_dir is not None:
        assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
        runs["hf_assisted"] = {"assistant_model": assistant}
    if lookup_tokens > 0:
        runs["hf_prompt_lookup"] = {"prompt_lookup_num_tokens": lookup_tokens}

    def make(extra):
        @torch.no_grad()
        def run(ids: list[int], max_new: int) -> list[int]:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, **common, **extra)
            return out[0, len(ids):].tolist()
        return run

    return {name: make(extra) for name, extra in runs.items()}


def _speculative_runner(target, drafter, args: argparse.Namespace, schedule: AdaptiveDraftLength | None,
                        eos: list[int]):
    """``fn(prompt_ids, max_new) -> new token ids`` with our speculative loop, greedy (``schedule``: adaptive draft
    length; ``None``: ``args.gamma`` every round)."""
    def run(ids: list[int], max_new: int) -> list[int]:
        return speculative_generate(target, drafter, [ids], max_new, args.gamma, eos_token_id=eos,
                                    impl=args.impl, draft_length=schedule).tokens[0]
    return run


def time_methods(methods: dict, prompts: list[list[int]], max_new_tokens: int, repeats: int
                 ) -> tuple[dict[str, list[list[int]]], dict[str, float]]:
    """Decode every prompt ``repeats`` times with every ``methods[name](ids, max_new) -> new ids`` (interleaved: one
    pass over methods and prompts per repeat). Returns each method's new tokens per prompt (the last repeat's) and its
    seconds: the sum over prompts of the fastest decode."""
    outputs = {name: [[] for _ in prompts] for name in methods}
    best = {name: [float("inf")] * len(prompts) for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            for k, ids in enumerate(prompts):
                t0 = time.perf_counter()
                outputs[name][k] = fn(ids, max_new_tokens)
                best[name][k] = min(best[name][k], time.perf_counter() - t0)
    return outputs, {name: sum(b) for name, b in best.items()}


def run(args: argparse.Namespace) -> dict:
    target = load_model(args.model, gemm_dtype=args.gemm_dtype)
    tokenizer = load_target_tokenizer(args.model)
    eos = list(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode(t) for d in args.domains for t in PROMPTS[d]]
    warm = tokenizer.encode("def f(x):")

    methods = {}
    assistant = args.assistant if args.assistant.exists() else None
    if assistant is None:
        print(f"no assistant model at {args.assistant}: hf_assisted skipped")
    methods.update(_hf_runner(args.model, assistant, args.prompt_lookup_tokens, eos))
    methods["ar"] = lambda ids, n: generate(target, [ids], n, eos_token_id=eos, impl=args.impl).tokens[0]
    costs = {}
    for name in args.drafters:
        drafter = load_drafter(Path(args.drafter_dir) / name, target, gemm_dtype=args.drafter_gemm_dtype)
        schedule = None
        if args.draft_length == "adaptive":  # measure_round_costs warms the drafter up itself
            schedule = AdaptiveDraftLength(measure_round_costs(target, drafter, warm, args.gamma))
            costs[name] = vars(schedule.costs)
        methods[name] = _speculative_runner(target, drafter, args, schedule, eos)

    for fn in methods.values():
        fn(warm, 8)
    outputs, seconds = time_methods(methods, prompts, args.max_new_tokens, args.repeats)
    rows = []
    for name in methods:
        new = sum(len(o) for o in outputs[name])
        rows.append({"method": name, "tokens_per_s": new / seconds[name], "new_tokens": new, "seconds": seconds[name]})
        print(f"{name:18s} {new / seconds[name]:8.1f} tok/s  ({new} tokens, {seconds[name]:.2f} s, fastest of "
              f"{args.repeats} per prompt)", flush=True)
    for row in rows:
        row["identical_to_ar"] = outputs[row["method"]] == outputs["ar"]
    best_hf = max((r for r in rows if r["method"].startswith("hf_")), key=lambda r: r["tokens_per_s"])
    for row in rows:
        row["vs_best_transformers"] = row["tokens_per_s"] / best_hf["tokens_per_s"]
    return {"settings": {"max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
                         "draft_length": args.draft_length, "round_costs": costs, "domains": args.domains,
                         "prompts": len(prompts), "prompt_lookup_num_tokens": args.prompt_lookup_tokens,
                         "batch_size": 1, "temperature": 0.0, "gemm_dtype": args.gemm_dtype,
                         "drafter_gemm_dtype": args.drafter_gemm_dtype, "repeats": args.repeats},
            "device": device_record(), "best_transformers": best_hf["method"], "runs": rows}


def markdown(result: dict) -> str:
    lines = ["| method | tokens/s | new tokens | vs best transformers | identical to our AR |", "|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['new_tokens']} | "
                     f"{r['vs_best_transformers']:.2f}x | {'yes' if r['identical_to_ar'] else 'no'} |")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_source, default="dspark-target",
                   help="target: a registry name, an HF model directory or a GGUF file (default: the shipped target)")
    p.add_argument("--assistant", type=Path, default=ASSETS / "assistant",
                   help="small HF model for transformers' assisted generation")
    p.add_argument("--drafter-dir", type=Path, default=ASSETS / "drafters")
    p.add_argument("--drafters", nargs="+", default=["dspark"], help="our drafters to run (shipped names)")
    p.add_argument("--domains", nargs="+", choices=sorted(PROMPTS), default=sorted(PROMPTS))
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--gamma", type=int, default=None,
                   help="draft length (fixed), or the most a round drafts (adaptive); default 7 fixed, 15 adaptive")
    p.add_argument("--draft-length", choices=sorted(DRAFT_LENGTH_MODES), default="adaptive")
    p.add_argument("--prompt-lookup-tokens", type=non_negative_int, default=10, help="0 skips prompt-lookup decoding")
    p.add_argument("--impl", choices=("auto", "triton", "torch"), default=None)
    p.add_argument("--gemm-dtype", choices=sorted(GEMM_DTYPES), default="float32",
                   help="our methods' linear-layer weight dtype (transformers runs in float32)")
    p.add_argument("--drafter-gemm-dtype", choices=sorted(GEMM_DTYPES), default="float32",
                   help="our drafters' own linear-layer weight dtype (their LM head is the target's); it changes which "
                        "tokens are proposed, never the output")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="decode every prompt this many times with each method, interleaved; time the fastest")
    p.add_argument("--json", type=Path, help="write the results here (and a markdown table next to it)")


def main(args: argparse.Namespace) -> dict:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    args.gamma = cli_gamma(args.gamma, args.draft_length)
    result = run(args)
    table = markdown(result)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(table)
    return result

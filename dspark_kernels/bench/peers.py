"""Peer comparison: a target decoded by ``transformers``, by llama.cpp and by us, greedy, side by side in one run.

Methods (batch 1, temperature 0, the same prompts and ``--max-new-tokens``, EOS honoured by all; the demo's prompts,
chat-templated for a target with a chat template such as SmolLM2-135M-Instruct, raw text otherwise):

* ``hf_generate``: ``AutoModelForCausalLM.generate`` (plain autoregressive decoding with the HF dynamic cache);
* ``hf_assisted``: assisted generation with a small same-tokenizer model (``--assistant``; default: the one shipped
  for the small target, ``assets/assistant``: 2 layers, hidden 128, trained on the same corpus; none for other
  targets) as ``assistant_model``, transformers' default draft-length schedule;
* ``hf_prompt_lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens``, n-gram drafts copied from the context);
* ``llamacpp_ar`` and ``llamacpp_prompt_lookup``: llama.cpp (``llama-cpp-python``, the optional ``llamacpp`` extra)
  on the same GGUF file, with this machine's thread count, plain and with its prompt-lookup drafting; only for a GGUF
  target and when the package is installed. llama.cpp computes with the GGUF's quantized weights, we with their
  dequantized values, so its greedy text may differ from ours;
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
import importlib.util
import json
import time
from pathlib import Path

import torch

from ..cli_args import DRAFT_VOCAB_HELP, draft_vocab_choice, model_source, non_negative_int, positive_int
from ..demo import CHAT_PROMPTS, TEXT_PROMPTS
from ..drafters import load_drafter
from ..engine.draft_length import DRAFT_LENGTH_MODES, AdaptiveDraftLength, cli_gamma, measure_round_costs
from ..engine.speculative import speculative_generate
from ..models import generate, load_model
from ..models.convert import converted_directory
from ..models.gemm_dtype import GEMM_DTYPES
from ..models.gguf_reader import is_gguf_file
from ..models.registry import REGISTRY, resolve_model
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


def _llamacpp_runner(gguf: Path, lookup_tokens: int, eos: list[int]):
    """``{method: fn(prompt_ids, max_new) -> new token ids}`` for llama.cpp on ``gguf``: plain greedy decoding, and
    with its prompt-lookup draft model when ``lookup_tokens > 0``."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def make(draft):
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=4096, n_batch=512, n_threads=torch.get_num_threads(),
                              verbose=False, draft_model=draft)

        def run(ids: list[int], max_new: int) -> list[int]:
            out: list[int] = []
            llm.reset()
            for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
                out.append(int(tok))
                if tok in eos or len(out) >= max_new:
                    break
            return out
        return run

    runs = {"llamacpp_ar": make(None)}
    if lookup_tokens > 0:
        runs["llamacpp_prompt_lookup"] = make(LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens))
    return runs


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
    table = CHAT_PROMPTS if tokenizer.chat_template is not None else TEXT_PROMPTS
    domains = args.domains or list(table)
    unknown = [d for d in domains if d not in table]
    if unknown:
        raise ValueError(f"--domains {unknown}: this target's prompts have domains {list(table)}")

    prompts = [tokenizer.encode_prompt(t) for d in domains for t in table[d]]
    warm = tokenizer.encode_prompt("def f(x):")

    methods = {}
    if args.assistant is None:
        print(f"no assistant model for {args.model}: hf_assisted skipped")
    methods.update(_hf_runner(args.model, args.assistant, args.prompt_lookup_tokens, eos))
    gguf = resolve_model(args.model)
    if is_gguf_file(gguf) and importlib.util.find_spec("llama_cpp") is not None:
        methods.update(_llamacpp_runner(gguf, args.prompt_lookup_tokens, eos))
    else:
        print("llama.cpp skipped (a GGUF target and the llamacpp extra are needed)")
    methods["ar"] = lambda ids, n: generate(target, [ids], n, eos_token_id=eos, impl=args.impl).tokens[0]
    costs = {}
    for name in args.drafters:
        drafter = load_drafter(Path(args.drafter_dir) / name, target, gemm_dtype=args.drafter_gemm_dtype,
                               draft_vocab=args.draft_vocab)
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
                         "draft_length": args.draft_length, "round_costs": costs, "domains": domains,
                         "prompts": len(prompts), "prompt_lookup_num_tokens": args.prompt_lookup_tokens,
                         "batch_size": 1, "temperature": 0.0, "gemm_dtype": args.gemm_dtype,
                         "drafter_gemm_dtype": args.drafter_gemm_dtype, "repeats": args.repeats,
                         "draft_vocab": args.draft_vocab},
            "model": str(args.model), "drafter_dir": str(args.drafter_dir), "drafters": list(args.drafters),
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
    p.add_argument("--assistant", type=Path, default=None,
                   help="small same-tokenizer HF model for transformers' assisted generation (default: the one shipped "
                        "for the small target; none for other targets, and hf_assisted is skipped)")
    p.add_argument("--drafter-dir", type=Path, default=None,
                   help="directory of our drafters (default: the drafters shipped for --model)")
    p.add_argument("--drafters", nargs="+", default=["dspark"], help="our drafters to run (subdirectory names)")
    p.add_argument("--domains", nargs="+", default=None,
                   help="prompt domains (default: all of the demo's prompts for this target: code, math, chat for a "
                        "chat target)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="most new tokens per prompt")
    p.add_argument("--gamma", type=int, default=None,
                   help="draft length (fixed), or the most a round drafts (adaptive); default 7 fixed, 15 adaptive")
    p.add_argument("--draft-length", choices=sorted(DRAFT_LENGTH_MODES), default="adaptive",
                   help="adaptive: each round's length from the measured round costs; fixed: --gamma every round")
    p.add_argument("--prompt-lookup-tokens", type=non_negative_int, default=10, help="0 skips prompt-lookup decoding")
    p.add_argument("--impl", choices=("auto", "triton", "torch"), default=None,
                   help="kernel implementation (default: Triton on a GPU, the PyTorch reference on a CPU)")
    p.add_argument("--gemm-dtype", choices=sorted(GEMM_DTYPES), default="float32",
                   help="our methods' linear-layer weight dtype (transformers runs in float32)")
    p.add_argument("--drafter-gemm-dtype", choices=sorted(GEMM_DTYPES), default="float32",
                   help="our drafters' own linear-layer weight dtype (their LM head is the target's); it changes which "
                        "tokens are proposed, never the output")
    p.add_argument("--draft-vocab", type=int, default=None, help=DRAFT_VOCAB_HELP)
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="decode every prompt this many times with each method, interleaved; time the fastest")
    p.add_argument("--json", type=Path, help="write the results here (and a markdown table next to it)")


def main(args: argparse.Namespace) -> dict:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    args.gamma = cli_gamma(args.gamma, args.draft_length)
    spec = REGISTRY.get(args.model) if isinstance(args.model, str) else None
    shipped = args.drafter_dir is None
    if args.drafter_dir is None:
        if spec is None or spec.drafters is None:
            raise ValueError(f"--drafter-dir is required: no drafters are shipped for --model {args.model}")
        args.drafter_dir = spec.drafters
    missing = [d for d in args.drafters if not (args.drafter_dir / d / "drafter_config.json").is_file()]
    if missing:
        raise ValueError(f"--drafters {missing}: no such drafter under {args.drafter_dir}")
    args.draft_vocab = draft_vocab_choice(args.draft_vocab, args.model, shipped,
                                          [args.drafter_dir / d for d in args.drafters])
    if args.assistant is None and args.model == "dspark-target":
        args.assistant = ASSETS / "assistant"
    if args.assistant is not None and not (args.assistant / "config.json").is_file():
        raise ValueError(f"--assistant {args.assistant} is not a model directory (no config.json)")
    result = run(args)
    table = markdown(result)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(table)
    return result

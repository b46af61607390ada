"""Global-memory traffic, grid and serial depth of every Triton op at serving shapes, counted under the interpreter.

Runs each op's Triton path on the CPU interpreter inside :func:`perf.traffic.count_traffic` and writes one row per
case to ``results/kernel_traffic.json``: ``{"op", "shape", "bytes_moved", "min_bytes", "programs",
"dependent_chain", ...}``. ``min_bytes`` is the traffic the op cannot avoid (derived per op below: every input it
must read once, every output once); ``bytes_moved / min_bytes`` is how far the kernel's structure sits from that.

The shapes are an 8B-class target's (32 query heads, 8 KV heads, head dim 128, bf16 logits and K/V, vocabulary
151,936) at batch 8 unless a case says otherwise.
``--vocab`` sets the sampling cases' vocabulary. The rejection-sampling cases and the filtered sequential-head case
run at 1/8 of it (18,992: the interpreter runs each tile's ``tl.topk`` of the filtered rows, and any radix-select
pass, in Python); the rows say so in ``shape.V``, and ``min_bytes`` is for the vocabulary counted.

CLI (about an hour on 2 cores)::

    python perf/kernel_traffic.py --json results/kernel_traffic.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit function is defined
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dspark_kernels.engine.sps import SPSProfile  # noqa: E402
from dspark_kernels.ops import (  # noqa: E402
    draft_block_attention,
    prefix_survival,
    rejection_sample,
    select_verify_lengths_alg1,
    sequential_head,
    verify_attention,
)
from perf.roofline import device_info  # noqa: E402
from perf.test_rejection_sample_bench import _batch as rejection_batch  # noqa: E402
from perf.test_sequential_head_bench import _batch as head_batch  # noqa: E402
from perf.test_survival_bench import _batch as schedule_batch  # noqa: E402
from perf.traffic import count_traffic  # noqa: E402
from tests.test_draft_block_attention import make_block_batch  # noqa: E402
from tests.test_verify_attention import make_paged_batch  # noqa: E402

V, HQ, HKV, D, RANK, HIDDEN = 151_936, 32, 8, 128, 64, 4096
BF16 = torch.bfloat16


def sequential_head_case(kind: str, r: int, gamma: int, v: int, top_k: int = 0,
                         top_p: float = 1.0) -> tuple[dict, callable, int]:
    """``kind`` head, ``r`` requests of ``gamma`` sampled slots (T = 1; with ``top_k`` / ``top_p`` on every
    request). Minimum: ``w2`` once per slot (the slots depend on each other; the requests of a slot share it), the
    base logits once, the draft rows written once, the other weights and activations once."""
    batch = head_batch(kind, r, gamma, v, RANK, HIDDEN, torch.device("cpu"), BF16)
    if top_k:
        batch["top_k"] = torch.full((r,), top_k, dtype=torch.int64)
    if top_p < 1:
        batch["top_p"] = torch.full((r,), top_p)
    n = r * gamma
    w = batch["weights"]
    small = sum(t.numel() * t.element_size() for t in (w.conf_w, w.gate_w, w.rnn_w, batch["hidden"]) if t is not None)
    min_bytes = gamma * RANK * v * 2 + n * v * 2 + n * v * 4 + n * RANK * 2 + small
    return ({"kind": kind, "R": r, "gamma": gamma, "V": v, "rank": RANK, "d": HIDDEN, "dtype": "bfloat16",
             "top_k": top_k, "top_p": top_p},
            lambda: sequential_head(**batch, impl="triton", check_inputs=False), min_bytes)


def rejection_case(r: int, gamma: int, top_k: int, top_p: float, v: int) -> tuple[dict, callable, int]:
    """T = 1 verification of ``r`` requests with ``gamma`` drafts each. Minimum: the target logits once; the draft
    probabilities at the drafted tokens, and one full draft row per request (the residual of its first rejection)."""
    batch = rejection_batch(r, gamma, v, torch.device("cpu"), BF16)
    if top_k:
        batch["top_k"] = torch.full((r,), top_k, dtype=torch.int64)
    if top_p < 1:
        batch["top_p"] = torch.full((r,), top_p)
    n = r * gamma
    min_bytes = (n + r) * v * 2 + n * 4 + r * v * 4 + r * (gamma + 1) * 8
    return ({"R": r, "gamma": gamma, "V": v, "top_k": top_k, "top_p": top_p, "logits_dtype": "bfloat16"},
            lambda: rejection_sample(**batch, impl="triton", check_inputs=False), min_bytes)


def verify_case(r: int, q_len: int, ctx: int, v: int, prefill: int = 0) -> tuple[dict, callable, int]:
    """Paged attention of ``q_len`` new tokens per request over ``ctx`` cached ones (decode: ``q_len`` 1), plus, with
    ``prefill``, one more request prefilling that many tokens (a ragged batch). Minimum: Q once, each request's K and
    V once, O once (``v`` unused: the attention cases have no vocabulary)."""
    q_lens, kv_lens = [q_len] * r + ([prefill] if prefill else []), [ctx] * r + ([prefill] if prefill else [])
    args = make_paged_batch(q_lens, kv_lens, HQ, HKV, D, 16, dtype=BF16)
    min_bytes = 2 * (2 * sum(q_lens) * HQ * D + 2 * sum(kv_lens) * HKV * D)
    return ({"R": len(q_lens), "q_len": q_len, "prefill": prefill, "ctx": ctx, "hq": HQ, "hkv": HKV, "d": D,
             "dtype": "bfloat16"},
            lambda: verify_attention(*args, impl="triton", check_inputs=False, max_seqlen_q=max(q_lens)), min_bytes)


def draft_block_case(r: int, gamma: int, ctx: int, v: int) -> tuple[dict, callable, int]:
    """A draft block of ``gamma`` queries per request over its ``ctx`` context tokens plus the block's own K/V.
    Minimum: Q, block K/V and O once, each request's context K/V once (``v`` unused)."""
    args = make_block_batch([gamma] * r, [ctx] * r, HQ, HKV, D, 16, dtype=BF16)
    min_bytes = 2 * r * (2 * gamma * HQ * D + 2 * gamma * HKV * D + 2 * ctx * HKV * D)
    return ({"R": r, "gamma": gamma, "ctx": ctx, "hq": HQ, "hkv": HKV, "d": D, "dtype": "bfloat16"},
            lambda: draft_block_attention(*args, impl="triton", check_inputs=False, max_seqlen_q=gamma), min_bytes)


def schedule_case(r: int, lookahead: int, noise: float) -> tuple[dict, callable, int]:
    """Algorithm 1 (``lookahead`` 1) or the step-aware stop over the scheduler bench's batch (``r`` requests of
    gamma 16 slots) against its modelled H200 roofline of an 8e9-parameter target, or with ``noise`` > 0 against it
    measured with that lognormal noise at every B and fitted non-increasing, as a measured profile is (its noise
    pooled into flat runs). Minimum: the survivals once, the table up to B = R + N once, the lengths once."""
    logits, cu, (temps, biases), _, sps = schedule_batch(r, torch.device("cpu"))
    a = prefix_survival(logits, cu, temps, biases, impl="torch")
    n, bmax = a.numel(), sps.numel() - 1
    if noise:
        gen = torch.Generator().manual_seed(r)
        torch.randn(n, generator=gen)  # the noise continues the bench's seeded stream after its logits
        rates = sps[1:].double() * torch.exp(noise * torch.randn(bmax, generator=gen, dtype=torch.float64))
        sps = SPSProfile("H200 (modelled, noisy)", "8e9", tuple(range(1, bmax + 1)),
                         (tuple(rates.tolist()),)).as_table(bmax)
    min_bytes = n * 4 + (bmax + 1) * sps.element_size() + r * 4
    return ({"R": r, "gamma": n // r, "N": n, "lookahead": lookahead, "profile_noise": noise},
            lambda: select_verify_lengths_alg1(a, cu, sps, lookahead=lookahead, impl="triton", check_inputs=False),
            min_bytes)


CASES = {  # name: (op, builder of (shape, run, min_bytes) for a vocabulary size)
    "sequential_head vanilla gamma 15": ("sequential_head", lambda v: sequential_head_case("vanilla", 8, 15, v)),
    "sequential_head gated gamma 7": ("sequential_head", lambda v: sequential_head_case("gated", 8, 7, v)),
    "sequential_head vanilla gamma 7 top-k 50 top-p 0.9": (
        "sequential_head", lambda v: sequential_head_case("vanilla", 8, 7, v // 8, top_k=50, top_p=0.9)),
    "rejection_sample T=1": ("rejection_sample", lambda v: rejection_case(8, 7, 0, 1.0, v // 8)),
    "rejection_sample T=1 top-k 50 top-p 0.9": ("rejection_sample", lambda v: rejection_case(8, 7, 50, 0.9, v // 8)),
    "verify_attention decode R=1 ctx 4k": ("verify_attention", lambda v: verify_case(1, 1, 4096, v)),
    "verify_attention verify 8 R=8 ctx 4k": ("verify_attention", lambda v: verify_case(8, 8, 4096, v)),
    "verify_attention prefill 256 among 7 decodes ctx 1k": ("verify_attention",
                                                            lambda v: verify_case(7, 1, 1024, v, prefill=256)),
    "draft_block_attention R=64 gamma 7 ctx 4k": ("draft_block_attention", lambda v: draft_block_case(64, 7, 4096, v)),
    "select_verify_lengths_alg1 R=256 gamma 16": ("select_verify_lengths_alg1",
                                                  lambda v: schedule_case(256, 1, 0.0)),
    "step-aware stop R=256 gamma 16 modelled H200": ("select_verify_lengths_alg1",
                                                     lambda v: schedule_case(256, 4096, 0.0)),
    "step-aware stop R=256 gamma 16 noisy measured H200": ("select_verify_lengths_alg1",
                                                           lambda v: schedule_case(256, 4096, 0.02)),
}


def measure(name: str, vocab: int = V) -> dict:
    op, build = CASES[name]
    shape, run, min_bytes = build(vocab)
    with count_traffic() as t:
        run()
    row = {"op": op, "case": name, "shape": shape, "bytes_moved": t.bytes_moved, "min_bytes": min_bytes,
           "programs": t.programs, "dependent_chain": t.dependent_chain, "kernel_bytes": t.kernel_bytes,
           "torch_bytes": t.torch_bytes, "launches": len(t.launches)}
    row["ratio"] = row["bytes_moved"] / row["min_bytes"]
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, default=Path("results/kernel_traffic.json"), help="where to write the rows")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="cases to count")
    p.add_argument("--update", action="store_true",
                   help="replace only these cases' rows in an existing --json file, keeping the others")
    p.add_argument("--vocab", type=int, default=V,
                   help="vocabulary of the sampling cases (the rejection cases run at 1/8 of it; rows record theirs)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    rows = []
    for name in args.cases:
        row = measure(name, args.vocab)
        rows.append(row)
        print(f"{name:45s} moved {row['bytes_moved'] / 1e6:10.1f} MB  min {row['min_bytes'] / 1e6:8.1f} MB  "
              f"x{row['ratio']:6.2f}  programs {row['programs']}  chain {row['dependent_chain']}", flush=True)
    if args.update and args.json.is_file():
        kept = [row for row in json.loads(args.json.read_text())["rows"] if row["case"] not in args.cases]
        order = list(CASES)
        rows = sorted(kept + rows, key=lambda row: order.index(row["case"]) if row["case"] in order else len(order))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "kernel_traffic", "device": device_info(), "rows": rows},
                                    indent=1) + "\n")


if __name__ == "__main__":
    main()

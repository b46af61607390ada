"""Sweep launch configs of the Triton ops on this GPU and store the winners (``python -m dspark_kernels.autotune``).

For every op and shape bucket: each candidate config is forced onto the op's launcher, its output is checked against
the PyTorch reference (candidates that fail to compile, crash or mismatch are reported and skipped), the rest are
timed with ``triton.testing.do_bench`` and the fastest is written to ``<out-dir>/<sanitized gpu>.json`` in the
format :mod:`.store` reads (``{"gpu", "driver", "ops": {op: {bucket: {param: int}}}}``). Ops already in that file
but not tuned in this run are kept. Without a CUDA GPU the command exits with status 2.

``survival`` has two buckets: ``prefix`` (the per-request survival product, a scalar loop: warps only) and ``scan``
(Algorithm 1's Theta scan, first drop and scatter: block size and warps).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .store import CONFIG_DIR, _check_store, config_path, device_name

NO_GPU_EXIT = 2


# ----------------------------------------------------------------------------------------------- selection (pure)
@dataclass
class Trial:
    """One candidate's fate: ``status`` is ``"ok"`` (timed), ``"error"`` (did not compile/run) or ``"mismatch"``."""

    config: dict[str, int]
    status: str
    ms: float | None = None
    detail: str = ""


def evaluate(
    candidates: Sequence[dict[str, int]],
    run: Callable[[dict[str, int]], object],
    check: Callable[[object], str | None],
    bench: Callable[[Callable[[], object]], float],
) -> list[Trial]:
    """Run, verify and time every candidate. ``check(output)`` returns ``None`` when the output is right, else why."""
    trials = []
    for cfg in candidates:
        try:
            out = run(cfg)
        except Exception as e:  # compile errors, resource limits, launch failures
            trials.append(Trial(dict(cfg), "error", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                                if str(e) else type(e).__name__))
            continue
        try:
            why = check(out)
        except Exception as e:
            why = f"check failed: {type(e).__name__}: {e}"
        if why:
            trials.append(Trial(dict(cfg), "mismatch", detail=why))
            continue
        try:
            ms = float(bench(lambda cfg=cfg: run(cfg)))
        except Exception as e:
            trials.append(Trial(dict(cfg), "error", detail=f"timing: {type(e).__name__}: {e}"))
            continue
        trials.append(Trial(dict(cfg), "ok", ms=ms))
    return trials


def pick(trials: Sequence[Trial], margin: float = 0.03) -> Trial | None:
    """The fastest verified trial, except that the first verified one (the grid lists the defaults first) is kept
    unless another is more than ``margin`` faster: a winner inside the timing noise is not worth a stored config.
    ``None`` when no candidate passed."""
    ok = [t for t in trials if t.status == "ok" and t.ms is not None]
    if not ok:
        return None
    fastest = min(ok, key=lambda t: t.ms)  # the first listed on a tie
    return ok[0] if ok[0].ms <= fastest.ms * (1 + margin) else fastest


def grid(defaults: dict[str, int], **choices: Sequence[int]) -> list[dict[str, int]]:
    """``defaults`` first, then every combination of ``choices`` over the defaults, without duplicates."""
    out = [dict(defaults)]
    keys = list(choices)
    for values in itertools.product(*(choices[k] for k in keys)):
        cfg = {**defaults, **dict(zip(keys, values))}
        if cfg not in out:
            out.append(cfg)
    return out


def merge_store(existing: dict | None, gpu: str, driver: str, ops: dict[str, dict[str, dict[str, int]]]) -> dict:
    """A store object with ``ops`` over the ops of ``existing`` (same GPU file), validated like the loader does."""
    merged = {k: dict(v) for k, v in (existing or {}).get("ops", {}).items()}
    for op, buckets in ops.items():
        merged.setdefault(op, {}).update(buckets)
    data = {"gpu": gpu, "driver": driver, "ops": merged}
    return _check_store(data, Path(f"<{gpu}>"))


# --------------------------------------------------------------------------------------------------- comparisons
def close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> str | None:
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    a, b = out.float(), ref.float()
    if not bool(torch.isfinite(a).all()):
        return "non-finite output"
    err = (a - b).abs() - rtol * b.abs()
    worst = float(err.max()) if err.numel() else 0.0
    return None if worst <= atol else f"max error {worst + atol:.3g} > atol {atol} (+ rtol {rtol})"


def mostly_equal(out: torch.Tensor, ref: torch.Tensor, max_frac: float, what: str) -> str | None:
    """Integer outputs (sampled tokens) agree except at most ``max_frac`` of entries (float ties at the CDF edge)."""
    if out.shape != ref.shape:
        return f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if out.numel() == 0:
        return None
    frac = float((out != ref).float().mean())
    return None if frac <= max_frac else f"{what}: {100 * frac:.2f}% differ (> {100 * max_frac:.2f}%)"


# ------------------------------------------------------------------------------------------------------- cases
@contextlib.contextmanager
def forced_config(module: str, cfg: dict[str, int] | None) -> Iterator[None]:
    """Make ``module``'s launcher see ``cfg`` over its defaults (``None``: leave the store in charge)."""
    mod = importlib.import_module(module)
    original = mod.launch_config
    if cfg is not None:
        mod.launch_config = lambda op, defaults, device, bucket="default", **kw: {**defaults, **cfg}
    try:
        yield
    finally:
        mod.launch_config = original


@dataclass
class Case:
    """One (op, bucket): ``make()`` builds ``(run_triton(), reference_output, check(out, ref))`` on the GPU."""

    op: str
    bucket: str
    module: str | None  # None: the op reads no launch config (timed only, nothing stored)
    candidates: list[dict[str, int]]
    make: Callable[[], tuple[Callable[[], object], object, Callable[[object, object], str | None]]]
    shapes: str = ""
    trials: list[Trial] = field(default_factory=list)


def _paged(q_lens, kv_lens, hq, hkv, d, page_size, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in kv_lens]
    n_pages = sum(pages_per) + 1
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(pages_per), dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages_per):
        table[r, :n] = perm[used:used + n]
        used += n
    k = torch.randn(n_pages, page_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_pages, page_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return [t.to(dev) for t in (q, k, v, table, cu, lens)]


def _attention_case(op, bucket, shapes, candidates, dev):
    """verify_attention (shapes: (q_len, kv_len, R)) or draft_block_attention (shapes: (gamma, ctx, R))."""
    from dspark_kernels.ops import draft_block_attention, verify_attention

    hq, hkv, d, page = 32, 8, 128, 16  # Qwen3-8B attention

    def make():
        batches = []
        for q_len, kv, r in shapes:
            if op == "verify_attention":
                args = _paged([q_len] * r, [kv] * r, hq, hkv, d, page, torch.bfloat16, dev)
                fn = verify_attention
            else:
                q, k, v, table, cu, _ = _paged([q_len] * r, [kv] * r, hq, hkv, d, page, torch.bfloat16, dev)
                g = torch.Generator().manual_seed(1)
                kb = torch.randn(q.shape[0], hkv, d, generator=g).to(torch.bfloat16).to(dev)
                vb = torch.randn(q.shape[0], hkv, d, generator=g).to(torch.bfloat16).to(dev)
                args = [q, kb, vb, k, v, table, cu, torch.full((r,), kv, dtype=torch.int32, device=dev)]
                fn = draft_block_attention
            batches.append((fn, args, q_len))
        refs = [fn(*args, impl="torch", check_inputs=False) for fn, args, _ in batches]

        def run():
            return [fn(*args, impl="triton", check_inputs=False, max_seqlen_q=m) for fn, args, m in batches]

        def check(outs, refs):
            for o, r in zip(outs, refs):
                why = close(o, r, atol=2e-2, rtol=2e-2)
                if why:
                    return why
            return None

        return run, refs, check

    module = f"dspark_kernels.ops.{op}"
    desc = ", ".join(f"{'q' if op == 'verify_attention' else 'gamma'}={a} ctx={b} R={c}" for a, b, c in shapes)
    return Case(op, bucket, module, candidates, make, shapes=f"{desc}; Hq 32 Hkv 8 D 128 bf16")


def _rejection_case(candidates, dev, r, gamma=7, v=151936):
    from dspark_kernels.ops import rejection_sample

    def make():
        n = r * gamma
        g = torch.Generator(device=dev).manual_seed(0)
        probs = torch.softmax(torch.randn(n, v, device=dev, generator=g) * 2, dim=-1)
        batch = dict(
            draft_token_ids=torch.multinomial(probs, 1, generator=g).squeeze(1),
            cu_num_draft_tokens=torch.arange(r + 1, device=dev, dtype=torch.int32) * gamma,
            draft_probs=probs,
            target_logits=(torch.randn(n + r, v, device=dev, generator=g) * 2).to(torch.bfloat16),
            temperature=torch.ones(r, device=dev), top_k=None, top_p=None,
            accept_uniforms=torch.rand(n, device=dev, generator=g).clamp(1e-7, 1 - 1e-7),
            sample_uniforms=torch.rand(n + r, device=dev, generator=g).clamp(1e-7, 1 - 1e-7),
            max_spec_len=gamma,
        )
        ref = rejection_sample(**batch, impl="torch", check_inputs=False)

        def run():
            return rejection_sample(**batch, impl="triton", check_inputs=False)

        def check(out, ref):
            return mostly_equal(out.num_accepted, ref.num_accepted, 0.02, "num_accepted") or mostly_equal(
                out.output_token_ids, ref.output_token_ids, 0.02, "output_token_ids")

        return run, ref, check

    return Case("rejection_sample", "default", "dspark_kernels.ops.rejection_sample", candidates, make,
                shapes=f"R={r} gamma={gamma} V={v} bf16 logits")


def _sequential_case(candidates, dev, r, kind="gated", gamma=7, v=151936, rank=256, d=4096):
    from dspark_kernels.ops import sequential_head
    from dspark_kernels.ops.sequential_head import SequentialHeadWeights

    def make():
        n = r * gamma
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape):
            return (torch.randn(shape, device=dev, generator=g) * 0.05).to(torch.bfloat16)

        fields = dict(w1=rand(v, rank), w2=rand(rank, v), conf_w=rand(d + rank), conf_b=rand())
        if kind == "gated":
            fields.update(gate_w=rand(d + rank, rank), gate_b=rand(rank))
        args = dict(
            base_logits=(torch.randn(n, v, device=dev, generator=g) * 2).to(torch.bfloat16),
            hidden=torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16),
            anchor_tokens=torch.randint(0, v, (r,), device=dev, generator=g),
            cu_num_draft_tokens=torch.arange(r + 1, device=dev, dtype=torch.int32) * gamma,
            weights=SequentialHeadWeights(kind, **fields),
            temperature=torch.ones(r, device=dev), top_k=None, top_p=None,
            uniforms=torch.rand(n, device=dev, generator=g).clamp(1e-7, 1 - 1e-7),
        )
        ref = sequential_head(**args, impl="torch", check_inputs=False)

        def run():
            return sequential_head(**args, impl="triton", check_inputs=False)

        def check(out, ref):
            return (mostly_equal(out.tokens, ref.tokens, 0.02, "tokens")
                    or close(out.draft_probs, ref.draft_probs, atol=1e-4, rtol=1e-3)
                    or close(out.confidence_logits, ref.confidence_logits, atol=1e-2, rtol=1e-3))

        return run, ref, check

    return Case("sequential_head", "default", "dspark_kernels.ops.sequential_head", candidates, make,
                shapes=f"{kind} R={r} gamma={gamma} V={v} r={rank} d={d} bf16")


def _survival_case(candidates, dev, bucket, r=256, gamma=16):
    """``prefix``: the per-request survival product; ``scan``: Algorithm 1's Theta scan, first drop and scatter
    (the candidate sort is torch's)."""
    from dspark_kernels.engine.sps import analytic_roofline
    from dspark_kernels.ops import prefix_survival, select_verify_lengths_alg1

    def make():
        gen = torch.Generator().manual_seed(r)
        n = r * gamma
        logits = (2 + 2 * torch.randn(n, generator=gen)).to(dev)
        cu = torch.arange(0, n + 1, gamma, dtype=torch.int64, device=dev)
        temps = torch.ones(gamma, device=dev)
        sps = analytic_roofline("H200", 8e9, max_batch=r * (gamma + 1)).as_table(r * (gamma + 1)).to(dev)
        a = prefix_survival(logits, cu, temps, impl="torch", check_inputs=False)

        def go(impl):
            if bucket == "prefix":
                return prefix_survival(logits, cu, temps, impl=impl, check_inputs=False)
            return select_verify_lengths_alg1(a, cu, sps, impl=impl, check_inputs=False)

        def check(out, ref):
            if bucket == "prefix":
                return close(out, ref, atol=1e-6, rtol=1e-5)
            return mostly_equal(out, ref, 0.0, "verify_lens")

        return (lambda: go("triton")), go("torch"), check

    what = "prefix_survival" if bucket == "prefix" else "select_verify_lengths_alg1"
    return Case("survival", bucket, "dspark_kernels.ops.survival", candidates, make,
                shapes=f"{what}, R={r} gamma={gamma}")


def build_cases(dev: torch.device, quick: bool) -> list[Case]:
    """The sweep: small candidate lists at serving shapes (quick: fewer shapes and candidates)."""
    va = importlib.import_module("dspark_kernels.ops.verify_attention")._DEFAULTS
    dba = importlib.import_module("dspark_kernels.ops.draft_block_attention")._DEFAULTS
    rs = importlib.import_module("dspark_kernels.ops.rejection_sample")._DEFAULTS
    sh = importlib.import_module("dspark_kernels.ops.sequential_head")._DEFAULTS
    sv = importlib.import_module("dspark_kernels.ops.survival")._DEFAULTS
    warps = (4,) if quick else (4, 8)
    # the attention loops' K/V tiles and page ids in rings 1 / 2 / 3 deep at 3 / 5 / 7 stages (7: the defaults)
    stages = (7,) if quick else (3, 5, 7)
    decode_shapes = [(1, 2048, 64)] if quick else [(1, 2048, 64), (1, 4096, 16)]
    # rows = q_len * group(4): q_len 8 and 16 are the prefill bucket (rows > 16)
    prefill_shapes = [(8, 2048, 64)] if quick else [(8, 2048, 64), (16, 4096, 16)]
    draft_shapes = [(7, 2048, 64)] if quick else [(7, 2048, 64), (16, 4096, 32)]
    return [
        _attention_case("verify_attention", "decode", decode_shapes,
                        grid(va["decode"], BLOCK_M=(16,), BLOCK_N=(32, 64, 128), num_warps=warps, num_stages=stages),
                        dev),
        _attention_case("verify_attention", "prefill", prefill_shapes,
                        grid(va["prefill"], BLOCK_M=(32, 64), BLOCK_N=(64, 128), num_warps=warps, num_stages=stages),
                        dev),
        _attention_case("draft_block_attention", "default", draft_shapes,
                        grid(dba, BLOCK_M=(16, 32, 64), BLOCK_N=(64,) if quick else (64, 128), num_warps=warps,
                             num_stages=stages),
                        dev),
        _rejection_case([c for c in grid(rs, BLOCK_V=(1024, 2048) if quick else (512, 1024, 2048, 4096),
                                         CHUNK_V=(8192,) if quick else (4096, 8192, 16384), num_warps=warps)
                         if c["CHUNK_V"] % c["BLOCK_V"] == 0], dev, r=64),
        _sequential_case(grid(sh, BLOCK_V=(64, 128) if quick else (64, 128, 256), BLOCK_M=(16, 32),
                              num_warps=(4, 8)), dev, r=16 if quick else 64),
        _survival_case(grid(sv["prefix"], num_warps=(1, 2, 4)), dev, "prefix"),
        _survival_case(grid(sv["scan"], BLOCK=(1024,) if quick else (512, 1024, 2048), num_warps=warps), dev,
                       "scan"),
    ]


OPS = ("verify_attention", "draft_block_attention", "rejection_sample", "sequential_head", "survival")


# ------------------------------------------------------------------------------------------------------- driver
def gpu_identity() -> tuple[str, str]:
    """(GPU name, driver version) via nvidia-ml-py, falling back to torch."""
    name = device_name(torch.cuda.current_device())
    try:
        import pynvml

        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        return name, drv.decode() if isinstance(drv, bytes) else str(drv)
    except Exception:
        return name, f"unknown (torch CUDA {torch.version.cuda})"


def tune_case(case: Case, quick: bool) -> list[Trial]:
    import triton.testing

    run, ref, check = case.make()
    current: list[dict[str, int]] = [{}]  # the candidate evaluate() ran last: the one it times next

    def forced(cfg):
        return forced_config(case.module, cfg) if case.module else contextlib.nullcontext()

    def run_cfg(cfg):
        current[0] = cfg
        with forced(cfg):
            out = run()
        torch.cuda.synchronize()
        return out

    def bench(_fn):
        # the op's launch alone under the forced config (evaluate's closure would add a config switch and a
        # synchronisation to every timed call, which is most of a microsecond kernel's time)
        with forced(current[0]):
            return triton.testing.do_bench(run, warmup=10 if quick else 25, rep=30 if quick else 100,
                                           return_mode="median")

    case.trials = evaluate(case.candidates, run_cfg, lambda out: check(out, ref), bench)

    torch.cuda.empty_cache()
    return case.trials


def _fmt_cfg(cfg: dict[str, int]) -> str:
    short = {"BLOCK_M": "M", "BLOCK_N": "N", "BLOCK_V": "V", "BLOCK_R": "R", "BLOCK_D": "D", "num_warps": "w",
             "num_stages": "s"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in cfg.items()) or "(fixed)"


def print_table(cases: Sequence[Case], file=sys.stdout) -> None:
    print(f"{'op':<22} {'bucket':<8} {'config':<34} {'status':<9} {'ms':>9}  note", file=file)
    for case in cases:
        best = pick(case.trials)
        for t in case.trials:
            mark = "*" if t is best else " "
            ms = f"{t.ms:9.4f}" if t.ms is not None else f"{'-':>9}"
            print(f"{case.op:<22} {case.bucket:<8} {_fmt_cfg(t.config):<34} {t.status:<9} {ms} {mark}{t.detail}",
                  file=file)
    print("(* = winner; ms = triton.testing.do_bench median over all shapes of the bucket)", file=file)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_kernels.autotune", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--out-dir", type=Path, default=CONFIG_DIR, help=f"where <gpu>.json goes (default {CONFIG_DIR})")
    p.add_argument("--quick", action="store_true", help="fewer shapes and candidates (a smoke run)")
    args = p.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {list(OPS)}")
    if not ops:
        p.error(f"--ops names no op; choose from {list(OPS)}")
    if not torch.cuda.is_available():
        print("autotune: no CUDA GPU visible (torch.cuda.is_available() is False); launch configs can only be "
              "tuned on a GPU. Nothing was written.", file=sys.stderr)
        return NO_GPU_EXIT

    dev = torch.device("cuda")
    gpu, driver = gpu_identity()
    print(f"autotune: {gpu} (driver {driver}), torch {torch.__version__}, ops {','.join(ops)}"
          f"{' (quick)' if args.quick else ''}", flush=True)
    cases = [c for c in build_cases(dev, args.quick) if c.op in ops]
    path = config_path(gpu, args.out_dir)
    existing = json.loads(path.read_text()) if path.exists() else None  # a malformed file fails here, not at the end
    if existing is not None and existing.get("gpu") not in (None, gpu):
        existing = None
    merge_store(existing, gpu, driver, {})
    winners: dict[str, dict[str, dict[str, int]]] = {}
    failed_buckets = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            tune_case(case, args.quick)
        except Exception as e:  # building the inputs / reference failed: report and go on
            case.trials = [Trial({}, "error", detail=f"setup: {type(e).__name__}: {e}")]
        best = pick(case.trials)
        n_bad = sum(t.status != "ok" for t in case.trials)
        print(f"  {case.op}/{case.bucket}: {len(case.trials)} candidates, {n_bad} rejected, "
              f"{time.perf_counter() - t0:.1f}s [{case.shapes}]", flush=True)
        if best is None:
            failed_buckets.append(f"{case.op}/{case.bucket}")
        elif case.module is not None:
            winners.setdefault(case.op, {})[case.bucket] = dict(best.config)
            # written after every bucket, so a run stopped by a time limit keeps what it tuned
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(merge_store(existing, gpu, driver, winners), indent=2, sort_keys=True) + "\n")
    print_table(cases)
    print(f"autotune: wrote {path}" if winners else f"autotune: no config to write to {path}")
    if failed_buckets:
        print(f"autotune: no candidate passed for {', '.join(failed_buckets)} (defaults stay in effect)",
              file=sys.stderr)
        return 1
    return 0

"""SPS profiles: the target's forward steps per second at a verify batch of B tokens, the scheduler's cost model.

A profile is stored as JSON at ``autotune/sps/<device>__<model>.json`` (names sanitised)::

    {"device": "NVIDIA H200", "model": "qwen3-8b", "source": "measured" | "modelled", "formula": "" | "...",
     "created": "2026-01-01T00:00:00+00:00", "batch_sizes": [1, 2, 4, ...],
     "steps_per_s": [[...], ...], "context_buckets": null | [1024, 4096, ...]}

``batch_sizes`` is strictly increasing and positive; ``steps_per_s`` has one row per context bucket (exactly one
row when ``context_buckets`` is null), each with one positive finite value per batch size. Every key is required
and no other key is allowed; a violation raises ``ValueError`` naming the file and the field.

No profile: :func:`load_profile` raises ``FileNotFoundError`` with the expected path and how to create it. There is
deliberately no silent default; :func:`analytic_roofline` gives an explicitly "modelled" profile when a measured
one cannot be taken yet.
"""

from __future__ import annotations

import itertools
import json
import math
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..autotune.store import CONFIG_DIR
from ..autotune.store import device_name as gpu_name

SPS_DIR = CONFIG_DIR.parent / "sps"  # autotune/sps next to the launch configs
SOURCES = ("measured", "modelled")
_KEYS = {"device", "model", "source", "formula", "created", "batch_sizes", "steps_per_s", "context_buckets"}

# Datasheet peaks: HBM bytes/s and dense bf16 tensor-core FLOP/s (no sparsity).
GPU_PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100": (3.35e12, 989e12),
    "A100": (2.0e12, 312e12),
}

_CREATE_HINT = (
    "measure one with `from dspark_kernels.engine.sps import profile_target; "
    "profile_target(step_fn, max_batch, device=..., model=...).save()` (step_fn(B) runs one verify forward of B "
    "tokens), or write a modelled one with `analytic_roofline(gpu, params, model=...).save()`"
)


def profile_device_name(device: torch.device) -> str:
    """The ``device`` key of a profile measured where ``device`` runs the target: a GPU's name
    (:func:`dspark_kernels.autotune.store.device_name`), or the CPU's architecture with torch's thread count (a target
    run on the CPU of a machine that also has a GPU gets a CPU profile)."""
    if device.type == "cuda":
        return gpu_name(device.index or 0)
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}t"


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def profile_path(device: str, model: str, sps_dir: Path = SPS_DIR) -> Path:
    """Where the profile of ``model`` on ``device`` lives: ``<sps_dir>/<device>__<model>.json``."""
    return Path(sps_dir) / f"{_sanitize(device)}__{_sanitize(model)}.json"


@dataclass(frozen=True)
class SPSProfile:
    """Steps/s of the target at verify batches of ``batch_sizes[i]`` tokens (row c: context bucket c)."""

    device: str
    model: str
    batch_sizes: tuple[int, ...]
    steps_per_s: tuple[tuple[float, ...], ...]
    context_buckets: tuple[int, ...] | None = None
    source: str = "measured"
    formula: str = ""
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def __post_init__(self) -> None:
        _check_fields(self.to_dict(), "<SPSProfile>")

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "model": self.model,
            "source": self.source,
            "formula": self.formula,
            "created": self.created,
            "batch_sizes": list(self.batch_sizes),
            "steps_per_s": [list(row) for row in self.steps_per_s],
            "context_buckets": None if self.context_buckets is None else list(self.context_buckets),
        }

    def save(self, sps_dir: Path = SPS_DIR) -> Path:
        """Write the profile as JSON under ``sps_dir``; return the path."""
        path = profile_path(self.device, self.model, sps_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def _row(self, context_len: int | None) -> tuple[float, ...]:
        """The row of the smallest context bucket >= ``context_len`` (the last bucket beyond; row 0 if None)."""
        if self.context_buckets is None or context_len is None:
            return self.steps_per_s[0]
        for bucket, row in zip(self.context_buckets, self.steps_per_s):
            if context_len <= bucket:
                return row
        return self.steps_per_s[-1]

    def as_table(self, max_tokens: int, context_len: int | None = None) -> torch.Tensor:
        """The scheduler's ``sps_table`` ``[Bmax + 1]`` float32, index B.

        The measured rates are first fitted by the closest non-increasing sequence (:func:`_non_increasing_fit`,
        least squares): a step over more tokens never reads as faster than one over fewer, which Algorithm 1's
        first-non-improvement stop needs (a dip would read as a wall), and a timing outlier is averaged with its
        neighbours instead of lifting every smaller size to its rate. A real staircase (a GPU's tile or CUDA-graph
        buckets) is non-increasing already and is kept as measured. An unmeasured B between measured sizes gets the
        rate of the next measured size (it can run padded to it). ``Bmax = min(max_tokens, last measured B)``:
        nothing is extrapolated past the profiled range, so the returned table can be shorter than requested and the
        scheduler never admits a batch larger than was measured. Entry 0 (unused) repeats entry 1.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        fitted = _non_increasing_fit(self._row(context_len))
        bmax = min(max_tokens, self.batch_sizes[-1])
        table = torch.empty(bmax + 1, dtype=torch.float32)
        i = 0
        for b in range(1, bmax + 1):
            while self.batch_sizes[i] < b:
                i += 1
            table[b] = fitted[i]
        table[0] = table[1]
        return table


def _non_increasing_fit(rates: Sequence[float]) -> list[float]:
    """The non-increasing sequence closest to ``rates`` in least squares (pool adjacent violators): each run of
    sizes whose rates rise with B is replaced by its mean, repeated until no rise is left."""
    sums: list[float] = []  # rate sums and sizes of the pooled runs of neighbouring sizes
    counts: list[int] = []
    for rate in rates:
        sums.append(rate)
        counts.append(1)
        while len(sums) > 1 and sums[-2] / counts[-2] < sums[-1] / counts[-1]:
            total, count = sums.pop(), counts.pop()
            sums[-1] += total
            counts[-1] += count
    return [total / count for total, count in zip(sums, counts) for _ in range(count)]


def _fail(where: str, field_name: str, why: str) -> ValueError:
    return ValueError(f"SPS profile {where}: field '{field_name}' {why}")


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_fields(data: object, where: str) -> None:
    """Strict schema check of a profile dict; raises ``ValueError`` naming ``where`` and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"SPS profile {where}: expected a JSON object, got {type(data).__name__}")
    missing, extra = _KEYS - data.keys(), data.keys() - _KEYS
    if missing or extra:
        raise ValueError(f"SPS profile {where}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}")
    for name in ("device", "model"):
        if not isinstance(data[name], str) or not data[name]:
            raise _fail(where, name, "must be a non-empty string")
    for name in ("formula", "created"):
        if not isinstance(data[name], str):
            raise _fail(where, name, "must be a string")
    if data["source"] not in SOURCES:
        raise _fail(where, "source", f"must be one of {SOURCES}, got {data['source']!r}")
    sizes = data["batch_sizes"]
    if not isinstance(sizes, (list, tuple)) or not sizes or not all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes
    ):
        raise _fail(where, "batch_sizes", "must be a non-empty list of positive integers")
    if any(b1 >= b2 for b1, b2 in zip(sizes, sizes[1:])):
        raise _fail(where, "batch_sizes", "must be strictly increasing")
    buckets = data["context_buckets"]
    if buckets is not None and (
        not isinstance(buckets, (list, tuple)) or not buckets
        or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in buckets)
        or any(c1 >= c2 for c1, c2 in zip(buckets, buckets[1:]))
    ):
        raise _fail(where, "context_buckets", "must be null or a strictly increasing list of positive integers")
    rows = data["steps_per_s"]
    n_rows = 1 if buckets is None else len(buckets)
    if not isinstance(rows, (list, tuple)) or len(rows) != n_rows:
        raise _fail(where, "steps_per_s", f"must be a list of {n_rows} row(s), one per context bucket")
    for row in rows:
        if not isinstance(row, (list, tuple)) or len(row) != len(sizes):
            raise _fail(where, "steps_per_s", f"rows must have one value per batch size ({len(sizes)})")
        if not all(_positive_finite(v) for v in row):
            raise _fail(where, "steps_per_s", "values must be positive finite numbers")


def load_profile(device: str, model: str, sps_dir: Path = SPS_DIR) -> SPSProfile:
    """Read and validate a stored profile; ``FileNotFoundError`` (path + how to create it) when there is none."""
    path = profile_path(device, model, sps_dir)
    if not path.exists():
        raise FileNotFoundError(f"no SPS profile for device {device!r}, model {model!r} at {path}; {_CREATE_HINT}")
    profile = read_profile(path)
    if (profile.device, profile.model) != (device, model):
        raise ValueError(f"SPS profile {path} is for device {profile.device!r}, model {profile.model!r}, not the "
                         f"requested {device!r}, {model!r} (a renamed or copied file?)")
    return profile


def read_profile(path: Path) -> SPSProfile:
    """Read and validate the profile file at ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"SPS profile {path} is not valid JSON: {e}") from e
    _check_fields(data, str(path))
    return SPSProfile(
        device=data["device"],
        model=data["model"],
        batch_sizes=tuple(data["batch_sizes"]),
        steps_per_s=tuple(tuple(float(v) for v in row) for row in data["steps_per_s"]),
        context_buckets=None if data["context_buckets"] is None else tuple(data["context_buckets"]),
        source=data["source"],
        formula=data["formula"],
        created=data["created"],
    )


def analytic_roofline(
    gpu: str,
    params: float,
    *,
    model: str = "analytic",
    max_batch: int = 1024,
    bytes_per_param: float = 2.0,
    overhead_s: float = 1e-3,
) -> SPSProfile:
    """A "modelled" profile from datasheet peaks (``GPU_PEAKS``: H200, H100, A100; matched by substring).

    ``t(B) = max(params * bytes_per_param / BW, B * 2 * params / FLOPs) + overhead_s`` and ``SPS(B) = 1 / t(B)``
    for B = 1..max_batch: the weights are streamed once per step (memory-bound floor), the matmuls cost 2 FLOPs per
    parameter per token (compute-bound slope), plus a fixed per-step overhead. KV-cache reads and attention FLOPs
    are ignored, so real steps are slower at long context. The result is non-increasing in B.
    """
    peak = next((p for key, p in GPU_PEAKS.items() if key in gpu), None)
    if peak is None:
        raise ValueError(f"gpu must name one of {sorted(GPU_PEAKS)}, got {gpu!r}")
    if not _positive_finite(params) or not _positive_finite(bytes_per_param) or overhead_s < 0 or max_batch < 1:
        raise ValueError("params, bytes_per_param must be > 0, overhead_s >= 0 and max_batch >= 1")
    bw, flops = peak
    sizes = tuple(range(1, max_batch + 1))
    sps = tuple(1.0 / (max(params * bytes_per_param / bw, b * 2.0 * params / flops) + overhead_s) for b in sizes)
    formula = (
        f"t(B) = max({params:.4g} * {bytes_per_param} B / {bw:.4g} B/s, B * 2 * {params:.4g} / {flops:.4g} FLOP/s)"
        f" + {overhead_s} s; SPS = 1 / t"
    )
    return SPSProfile(gpu, model, sizes, (sps,), source="modelled", formula=formula)


def _default_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_target(
    step_fn: Callable[[int], object],
    max_batch: int,
    *,
    device: str,
    model: str,
    batch_sizes: Sequence[int] | None = None,
    warmup: int = 3,
    repeats: int = 10,
    sync: Callable[[], None] = _default_sync,
    clock: Callable[[], float] = time.perf_counter,
) -> SPSProfile:
    """Measure steps/s at each batch size (default 1..max_batch): ``1 / median`` of ``repeats`` timed steps.

    ``step_fn(B)`` runs one verify forward of B tokens; ``sync`` waits for the device (CUDA synchronise by
    default) before and after each timed call. ``warmup`` untimed calls per size absorb compilation/graph capture.
    The timed calls are interleaved: ``repeats`` passes over every size (alternately up and down), so a change of
    the machine's speed during profiling (another process, a clock or power state) lands on every size alike
    instead of on the few sizes measured while it lasted, which would read as a false step in the staircase.
    """
    sizes = tuple(batch_sizes) if batch_sizes is not None else tuple(range(1, max_batch + 1))
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
    for b in sizes:
        for _ in range(warmup):
            step_fn(b)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for rep in range(repeats):
        for b in sizes if rep % 2 == 0 else reversed(sizes):
            sync()
            start = clock()
            step_fn(b)
            sync()
            times[b].append(clock() - start)
    rates = [1.0 / max(statistics.median(times[b]), 1e-9) for b in sizes]
    return SPSProfile(device, model, sizes, (tuple(rates),), source="measured")


def draft_round_widths(gamma: int) -> tuple[tuple[int, str], ...]:
    """The draft widths the drafter's round profiles are measured at, with the tag each profile's model name carries:
    ``gamma`` slots (``-rounds``, the engine's ``draft_profile``) and one (``-rounds-w1``, its
    ``narrow_draft_profile``)."""
    return (gamma, "-rounds"), (1, "-rounds-w1")


def profile_drafter(
    target,
    drafter,
    max_requests: int,
    *,
    device: str,
    model: str,
    context: int = 512,
    gamma: int = 7,
    kept: int = 2,
    warmup: int = 3,
    repeats: int = 10,
    sync: Callable[[], None] = _default_sync,
) -> SPSProfile:
    """The drafter's rounds/s at every request count R = 1..``max_requests`` (a profile whose ``batch_sizes`` are
    request counts; ``Engine(..., draft_profile=...)`` adds it to every modelled round; measured at ``gamma = 1`` it
    is the ``narrow_draft_profile`` that makes the modelled draft cost follow the draft width).

    A round is what the engine spends on the drafter per step: R requests holding ``context`` tokens each draft
    ``gamma`` tokens (T = 1), taking ``kept`` committed tokens each into their context in the same call, as the
    engine hands over what the previous verify round kept (about tau at T = 1). Each size keeps its own contexts,
    built in its first warm-up call (so ``warmup`` must be >= 1), so that the sizes can be timed interleaved
    (:func:`profile_target`); they hold ``max_requests * (max_requests + 1) / 2`` drafter contexts in all.
    """
    from ..sampling import Sampling
    from .rounds import draft, prefill

    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first call of each size builds its contexts), got {warmup}")
    dev = target.device
    pages_per_request = -(-(context + kept * (warmup + repeats) + gamma + 1) // 16)
    rounds: dict[int, tuple] = {}  # R -> the arguments of its draft call

    def start(r: int) -> tuple:
        cache, dstate = target.new_cache(r * pages_per_request, 16), drafter.new_state(r * pages_per_request, 16)
        rids = list(range(r))
        for rid in rids:
            cache.add_request(rid)
            drafter.add_request(dstate, rid)
        sampling = Sampling.of([1.0] * r, [0] * r, [1.0] * r, rids, [0] * r, dev)
        deferred = []
        anchors = prefill(target, drafter, cache, dstate, rids, [[1] * context] * r, sampling, defer=deferred.append)
        ids, feats, cu = deferred[0]
        drafter.extend(dstate, rids, ids, feats, cu)
        new_context = (torch.ones(kept * r, dtype=torch.int64, device=dev), feats.new_zeros(kept * r, feats.shape[1]),
                       torch.arange(0, kept * r + 1, kept, dtype=torch.int32, device=dev))
        return dstate, rids, torch.tensor(anchors, device=dev), sampling, new_context

    def step(r: int) -> None:
        if r not in rounds:
            rounds[r] = start(r)
        dstate, rids, anchors, sampling, new_context = rounds[r]
        draft(drafter, dstate, rids, anchors, gamma, sampling, context=new_context)

    return profile_target(step, max_requests, device=device, model=model, warmup=warmup, repeats=repeats, sync=sync)


def target_step_fn(model, device: torch.device, max_batch: int, context: int, per_request: int):
    """A ``step_fn(B)`` for :func:`profile_target`: one verify forward of B new tokens over ``ceil(B / per_request)``
    requests, each holding ``context`` cached tokens; the new tokens are rolled back so every call sees one state
    (``per_request >= max_batch``: a single request verifies all B tokens)."""
    n_req = math.ceil(max_batch / per_request)
    page = 16
    cache = model.new_cache(num_pages=n_req * math.ceil((context + per_request) / page) + 1, page_size=page)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for r in range(n_req):
        cache.add_request(r)
        ids = torch.randint(0, vocab, (context,), generator=gen).to(device)
        model(ids, torch.tensor([0, context], dtype=torch.int32, device=device), [r], cache)
    new_ids = torch.randint(0, vocab, (max_batch,), generator=gen).to(device)

    def step(b: int) -> None:
        lens = [per_request] * (b // per_request) + ([b % per_request] if b % per_request else [])
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        rids = list(range(len(lens)))
        model(new_ids[:b], cu, rids, cache, check_inputs=False)
        for rid, n in zip(rids, lens):
            cache.rollback(rid, n)

    return step


# ------------------------------------------------------------------------------------------------------------ CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dspark_kernels.engine.sps``: measure and save the SPS profile of a target checkpoint (and, with
    ``--drafter``, the round profiles of a drafter for it at --gamma slots and at one)."""
    import argparse
    import sys

    from ..cli_args import DRAFT_VOCAB_HELP, draft_vocab_choice, missing_inputs_are_usage_errors, model_source
    from ..drafters import check_gamma, load_drafter
    from ..models.registry import is_shipped_drafter
    from ..models.transformer import load_model

    p = argparse.ArgumentParser(prog="python -m dspark_kernels.engine.sps", description=main.__doc__)
    p.add_argument("--target", type=model_source, default="dspark-target",
                   help="target: a registry name, an HF model directory or a GGUF file (default: the shipped target)")
    p.add_argument("--model", default="dspark-target", help="model name in the profile and its file name")
    p.add_argument("--max-batch", type=int, default=256, help="profile B = 1..max-batch verify tokens")
    p.add_argument("--context", type=int, default=512, help="cached tokens per request")
    p.add_argument("--tokens-per-request", type=int, default=8, help="new tokens per request (1 + drafts)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed forwards before each measurement")
    p.add_argument("--repeats", type=int, default=10,
                   help="timed forwards per batch size")
    p.add_argument("--drafter", type=Path, default=None,
                   help="also profile this drafter's rounds by request count at --gamma slots and at one (saved as "
                        "<model>+<drafter>-rounds and <model>+<drafter>-rounds-w1)")
    p.add_argument("--max-requests", type=int, default=64, help="with --drafter: R = 1..max-requests")
    p.add_argument("--gamma", type=int, default=7, help="with --drafter: draft tokens per request")
    p.add_argument("--draft-vocab", type=int, default=None, help=f"with --drafter: {DRAFT_VOCAB_HELP}")
    p.add_argument("--out-dir", type=Path, action="append", help=f"where to save (repeatable; default {SPS_DIR})")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run, not a real profile)")
    args = p.parse_args(argv)
    if min(args.max_batch, args.context, args.tokens_per_request, args.max_requests, args.gamma) < 1:
        p.error("--max-batch, --context, --tokens-per-request, --max-requests and --gamma must be >= 1")
    if args.drafter is not None and args.warmup < 1:
        p.error("--warmup must be >= 1 with --drafter (the first call of each size builds its contexts)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device must name a torch device (cuda, cuda:1, cpu), got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sps: no CUDA GPU visible; an SPS profile measures the target on the GPU it will serve on. "
              "Nothing was written (use --device cpu for a smoke run).", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.drafter is not None:
        try:
            args.draft_vocab = draft_vocab_choice(args.draft_vocab, args.target,
                                                  is_shipped_drafter(args.target, args.drafter), [args.drafter])
        except ValueError as e:
            p.error(str(e))
    with missing_inputs_are_usage_errors(p):  # both loaded (and checked) before anything is measured or written
        model = load_model(args.target, dtype=dtype, device=device)
        drafter = None if args.drafter is None else load_drafter(args.drafter, model, dtype=dtype,
                                                                    draft_vocab=args.draft_vocab)
    positions = model.config.max_position_embeddings
    if positions is not None and args.context + args.tokens_per_request > positions:
        p.error(f"--context {args.context} + --tokens-per-request {args.tokens_per_request} exceeds the target's "
                f"max_position_embeddings ({positions})")
    if drafter is not None:
        check_gamma(drafter, args.gamma)
    step = target_step_fn(model, device, args.max_batch, args.context, args.tokens_per_request)
    name = profile_device_name(device)
    sync = _default_sync if device.type == "cuda" else (lambda: None)
    prof = profile_target(step, args.max_batch, device=name, model=args.model, warmup=args.warmup,
                          repeats=args.repeats, sync=sync)
    for out_dir in args.out_dir or [SPS_DIR]:
        print(f"sps: wrote {prof.save(out_dir)}")
    rates = prof.steps_per_s[0]
    for b in sorted({1, 8, 16, 32, 64, 128, 256, args.max_batch}):
        if b <= args.max_batch:
            print(f"  B={b:4d}  {rates[b - 1]:10.1f} steps/s  {rates[b - 1] * b:12.0f} tokens/s")
    for width, tag in draft_round_widths(args.gamma) if drafter is not None else ():
        rounds = profile_drafter(model, drafter, args.max_requests, device=name,
                                 model=f"{args.model}+{args.drafter.name}{tag}", context=args.context,
                                 gamma=width, warmup=args.warmup, repeats=args.repeats, sync=sync)
        for out_dir in args.out_dir or [SPS_DIR]:
            print(f"sps: wrote {rounds.save(out_dir)}")
        for r in sorted({1, 8, 32, args.max_requests}):
            if r <= args.max_requests:
                print(f"  R={r:4d}  {rounds.steps_per_s[0][r - 1]:10.1f} draft rounds/s at {width} slot(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

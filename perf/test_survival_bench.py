"""Scheduler speed: prefix_survival + select_verify_lengths_alg1 (``alg1``), or the production variant's
capacity_unconstrained + select_verify_lengths_topk (``prod``, the capacity from the same survivals), or Algorithm 1
with the step-aware stop over the whole path (``step``, ``lookahead = N``), the reference on CPU (host scans up to 256
slots) and Triton on CUDA.

Shapes: R in {1, 8, 64, 256} requests (1, 64, 256 on CUDA), gamma = 16 draft slots each (N = 16 R). Bytes ~ the
[N] float32 logits read, survival written, the sort's key/index traffic and the three scan passes (~ 16 N * 4);
FLOPs ~ N log2 N (the sort); ``step`` adds the outlook of every candidate, at most N terms of 3 FLOPs each over an
SPS table that stays in cache (3 N^2 FLOPs, an upper bound: the first-drop kernel takes one term per run of equal
SPS in each window), the first-drop kernel's tau and best reads (16 N bytes) and the run tables, written once and
read (32 (Bmax + 1) bytes). Every record
carries ``scheduler_s`` (median seconds per schedule) and, against a modelled target step (H200 roofline, 8e9
parameters, a verify batch of R (1 + gamma) tokens), ``pct_of_target_step``: the DSpark goal is a scheduler cost
below 1% of a target step at R = 256, gamma = 16.
"""

import math

import pytest
import torch

from dspark_kernels.engine.sps import analytic_roofline
from dspark_kernels.ops import (
    capacity_unconstrained,
    prefix_survival,
    select_verify_lengths_alg1,
    select_verify_lengths_topk,
)
from perf.roofline import record, sync

GAMMA = 16
TARGET_PARAMS = 8e9


def _batch(r: int, device: torch.device):
    """The scheduler's inputs for ``r`` requests of GAMMA slots: confidence logits ``[N]`` (seeded by r), offsets
    ``cu [R + 1]``, unit temperatures and zero biases ``[GAMMA]`` (a calibrated drafter's inputs), the modelled H200
    target and its SPS table up to ``B = R (GAMMA + 1)``."""
    gen = torch.Generator().manual_seed(r)
    n = r * GAMMA
    logits = (2 + 2 * torch.randn(n, generator=gen)).to(device)
    cu = torch.arange(0, n + 1, GAMMA, dtype=torch.int64, device=device)
    calibration = (torch.ones(GAMMA, device=device), torch.zeros(GAMMA, device=device))
    model = analytic_roofline("H200", TARGET_PARAMS, max_batch=r * (GAMMA + 1))
    return logits, cu, calibration, model, model.as_table(r * (GAMMA + 1)).to(device)


def _run(benchmark, device, r, impl, scheme="alg1"):
    logits, cu, (temps, biases), model, sps = _batch(r, device)
    n = logits.numel()

    def step():
        a = prefix_survival(logits, cu, temps, biases, impl=impl, check_inputs=False)
        if scheme in ("alg1", "step"):
            lookahead = n if scheme == "step" else 1
            select_verify_lengths_alg1(a, cu, sps, lookahead=lookahead, impl=impl, check_inputs=False)
        else:
            k = capacity_unconstrained(a, cu, sps, impl=impl, check_inputs=False)
            select_verify_lengths_topk(a, cu, k, impl=impl, check_inputs=False)
        sync(device)

    step()
    benchmark(step)
    record(
        benchmark,
        shapes={"R": r, "gamma": GAMMA, "N": n, "scheme": scheme},
        bytes_moved=16.0 * n * 4 + (16.0 * n + 32.0 * sps.numel() if scheme == "step" else 0.0),
        flops=n * math.log2(max(n, 2)) + (3.0 * n * n if scheme == "step" else 0.0),
        impl=impl,
    )
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    median = benchmark.stats.stats.median
    target_step = 1.0 / float(sps[-1])
    benchmark.extra_info.update(
        {
            "scheduler_s": median,
            "target_step_s_modelled": target_step,
            "target_model": model.formula,
            "pct_of_target_step": 100.0 * median / target_step,
        }
    )


@pytest.mark.parametrize("scheme", ["alg1", "step", "prod"])
@pytest.mark.parametrize("r", [1, 8, 64, 256])
def test_survival_schedule_reference_cpu(benchmark, r, scheme):
    _run(benchmark, torch.device("cpu"), r, "torch", scheme)


@pytest.mark.parametrize("scheme", ["alg1", "step"])
@pytest.mark.parametrize("r", [1, 64, 256])
def test_survival_schedule_triton_cuda(benchmark, r, scheme):
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernels are timed on CUDA only (the interpreter is not a speed reference)")
    _run(benchmark, torch.device("cuda"), r, "triton", scheme)


@pytest.mark.parametrize("scheme", ["alg1", "step"])
def test_survival_schedule_triton_interpreted_smoke(benchmark, interpreted_smoke, scheme):
    _run(benchmark, interpreted_smoke, 4, "triton", scheme)

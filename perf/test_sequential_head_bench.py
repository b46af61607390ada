"""sequential_head speed: the reference on CPU at a small shape, the Triton kernels on CUDA at serving shapes.

Stochastic requests (T = 1, no top-k/top-p), every request with ``gamma`` slots. Each slot is vocab-parallel over
all requests (see ``dspark_kernels/ops/sequential_head.py``): ``w2`` is read once a slot per block of 16 requests.
Bytes per slot (the Triton path's traffic, weights at ``w_elem`` bytes, logits at ``elem``; R requests):
    w2 read                                  r * V * w_elem * ceil(R / 16)
    per request: base logits read, scaled row written (4 B), normalised (read + write, 8 B)   V * (elem + 12)
    w1 row, gate/rnn products, per-tile statistics                                           small
FLOPs per slot: 2 r V R (bias GEMM) + ~12 V R (scale, max, exp, sums, divide) + the latent's small products.
The minimum traffic is ``w2`` once a slot and every row's logits read and draft probabilities written once
(``perf/kernel_traffic.py`` counts both at an 8B-class shape).
"""

import pytest
import torch

from dspark_kernels.ops import sequential_head
from dspark_kernels.ops.sequential_head import SequentialHeadWeights
from perf.roofline import record, sync


def _weights(kind: str, v: int, d: int, r: int, device: torch.device, dtype: torch.dtype) -> SequentialHeadWeights:
    g = torch.Generator(device=device).manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, device=device, generator=g) * 0.05).to(dtype)

    fields = dict(w1=rand(v, r), w2=rand(r, v), conf_w=rand(d + r), conf_b=rand())
    if kind == "gated":
        fields.update(gate_w=rand(d + r, r), gate_b=rand(r))
    if kind == "rnn":
        fields.update(rnn_w=rand(2 * r + d, 3 * r), rnn_b=rand(3 * r))
    return SequentialHeadWeights(kind, **fields)


def _batch(kind: str, r: int, gamma: int, v: int, rank: int, d: int, device: torch.device, dtype: torch.dtype):
    n = r * gamma
    g = torch.Generator(device=device).manual_seed(0)
    return dict(
        base_logits=(torch.randn(n, v, device=device, generator=g) * 2).to(dtype),
        hidden=torch.randn(n, d, device=device, generator=g).to(dtype),
        anchor_tokens=torch.randint(0, v, (r,), device=device, generator=g),
        cu_num_draft_tokens=torch.arange(r + 1, device=device, dtype=torch.int32) * gamma,
        weights=_weights(kind, v, d, rank, device, dtype),
        temperature=torch.ones(r, device=device),
        top_k=None,
        top_p=None,
        uniforms=torch.rand(n, device=device, generator=g).clamp(1e-7, 1 - 1e-7),
    )


def _cost(kind: str, r: int, gamma: int, v: int, rank: int, d: int, elem: int) -> tuple[float, float]:
    """Bytes and FLOPs of ``r`` requests of ``gamma`` slots (all weights and activations at ``elem`` bytes)."""
    slots, gamma_blocks = r * gamma, gamma * -(-r // 16)
    head_params = {"vanilla": 0, "gated": (d + rank) * rank, "rnn": (2 * rank + d) * 3 * rank}[kind]
    per_row_bytes = v * (elem + 12) + (rank + d + d + rank) * elem
    per_row_flops = 2 * rank * v + 12 * v + 2 * head_params + 2 * (d + rank)
    return float(slots * per_row_bytes + rank * v * elem * gamma_blocks), float(slots * per_row_flops)


def _run(benchmark, device: torch.device, kind: str, r: int, gamma: int, v: int, rank: int, d: int, impl: str,
         dtype: torch.dtype) -> None:
    batch = _batch(kind, r, gamma, v, rank, d, device, dtype)

    def step():
        sequential_head(**batch, impl=impl, check_inputs=False)
        sync(device)

    step()
    benchmark(step)
    bytes_moved, flops = _cost(kind, r, gamma, v, rank, d, batch["base_logits"].element_size())
    record(
        benchmark,
        shapes={"kind": kind, "R": r, "gamma": gamma, "V": v, "r": rank, "d": d, "dtype": str(dtype).split(".")[-1]},
        bytes_moved=bytes_moved,
        flops=flops,
        impl=impl,
    )


def test_sequential_head_reference_cpu(benchmark):
    _run(benchmark, torch.device("cpu"), "vanilla", 4, 7, 8192, 64, 256, "torch", torch.float32)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("r", [1, 64, 256])
def test_sequential_head_triton_cuda(benchmark, r, kind):
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernel is timed on CUDA only (the interpreter is not a speed reference)")
    _run(benchmark, torch.device("cuda"), kind, r, 7, 151936, 256, 4096, "triton", torch.bfloat16)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_sequential_head_triton_interpreted_smoke(benchmark, interpreted_smoke, kind):
    _run(benchmark, interpreted_smoke, kind, 2, 3, 300, 8, 32, "triton", torch.float32)

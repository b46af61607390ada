"""sequential_head speed: the reference on CPU at a small shape, the Triton kernel on CUDA at serving shapes.

Stochastic requests (T = 1, no top-k/top-p), every request with ``gamma`` slots. One program per request walks its
slots, so each slot re-reads ``w2`` (no reuse across requests or slots in this design).
Bytes per slot (an estimate of the Triton path, weights at ``w_elem`` bytes, logits at ``elem``):
    w2 read                                  r * V * w_elem
    base logits read                         V * elem
    float32 draft row: scaled write, e read+write, p read+write, 2 draw reads   V * 4 * 7
    w1 row, hidden, gate/rnn weights         r * w_elem + d * elem_h + (gate: (d + r) r, rnn: (2r + d) 3r) * w_elem
FLOPs per slot: 2 r V (bias GEMV) + ~8 V (scale, max, exp, sums, divide) + ~4 V (draw) + gate 2 (d + r) r
or rnn 2 (2r + d) 3r + 2 (d + r) (confidence).
These are the bytes the kernel's passes request, not the op's minimum traffic: at many requests the programs share
``w2`` through the L2 cache, so the achieved "GB/s" (and % of peak bandwidth) can exceed what DRAM delivers; read it
as the kernel's load throughput (at R = 256, gamma 7 the records count 147.6 GB a call against about 1.7 GB that
must cross DRAM: ``w2`` once, the logits and the draft rows).
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


def _cost(kind: str, slots: int, v: int, rank: int, d: int, elem: int) -> tuple[float, float]:
    """Bytes and FLOPs of ``slots`` slots (all weights and activations at ``elem`` bytes)."""
    head_params = {"vanilla": 0, "gated": (d + rank) * rank, "rnn": (2 * rank + d) * 3 * rank}[kind]
    per_slot_bytes = rank * v * elem + v * elem + v * 4 * 7 + (rank + d + head_params + d + rank) * elem
    per_slot_flops = 2 * rank * v + 12 * v + 2 * head_params + 2 * (d + rank)
    return float(slots * per_slot_bytes), float(slots * per_slot_flops)


def _run(benchmark, device: torch.device, kind: str, r: int, gamma: int, v: int, rank: int, d: int, impl: str,
         dtype: torch.dtype) -> None:
    batch = _batch(kind, r, gamma, v, rank, d, device, dtype)

    def step():
        sequential_head(**batch, impl=impl, check_inputs=False)
        sync(device)

    step()
    benchmark(step)
    bytes_moved, flops = _cost(kind, r * gamma, v, rank, d, batch["base_logits"].element_size())
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

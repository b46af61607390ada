"""verify_attention speed: the reference on CPU at small shapes, the Triton kernel on CUDA at serving shapes.

The CPU cases run unplanned (each call plans its own index work) and planned (one ``plan_verify_attention`` made
outside the timed call and reused, as every layer of a model forward does), at the perf shapes and at the shipped
target's (4 query heads, 2 KV heads, D = 64, 128 cached tokens); the batch-invariant reference runs planned at the
same shapes.

Bytes = Q read + each request's K/V pages read once per KV head + O written; FLOPs = 4 * Hq * D per visible
(query, key) pair (QK^T and PV). On a GPU the record carries achieved GB/s, TFLOP/s and % of peak.
"""

import pytest
import torch

from dspark_kernels.ops import plan_verify_attention, verify_attention
from perf.roofline import record, sync
from tests.test_verify_attention import make_paged_batch


def _cost(q_lens, kv_lens, hq, hkv, d, elem):
    pairs = sum(sum(kv - q + i + 1 for i in range(q)) for q, kv in zip(q_lens, kv_lens))
    bytes_moved = elem * (2 * sum(q_lens) * hq * d + 2 * sum(kv_lens) * hkv * d)
    return bytes_moved, 4.0 * pairs * hq * d


CPU_SHAPES = [
    pytest.param([1] * 4, [512] * 4, (32, 8, 128), id="decode-R4-ctx512"),
    pytest.param([8] * 4, [512] * 4, (32, 8, 128), id="verify8-R4-ctx512"),
    pytest.param([1], [128], (4, 2, 64), id="decode-R1-ctx128-shipped"),
    pytest.param([8], [128], (4, 2, 64), id="verify8-R1-ctx128-shipped"),
]
GPU_SHAPES = [
    pytest.param([1] * 64, [2048] * 64, id="decode-R64-ctx2k"),
    pytest.param([8] * 64, [2048] * 64, id="verify8-R64-ctx2k"),
    pytest.param([16] * 16, [4096] * 16, id="verify16-R16-ctx4k"),
    pytest.param([8] * 256, [1024] * 256, id="verify8-R256-ctx1k"),
]


def _run(benchmark, device, q_lens, kv_lens, impl, dtype, heads=(32, 8, 128), planned=False, batch_invariant=False):
    (hq, hkv, d), page_size = heads, 16
    args = [a.to(device) for a in make_paged_batch(q_lens, kv_lens, hq, hkv, d, page_size, dtype=dtype)]
    max_q = max(q_lens)
    plan = plan_verify_attention(*args[3:6], page_size, hq, impl=impl, batch_invariant=batch_invariant) if planned \
        else None

    def step():
        verify_attention(*args, impl=impl, check_inputs=False, max_seqlen_q=max_q, plan=plan)
        sync(device)

    step()
    benchmark(step)
    bytes_moved, flops = _cost(q_lens, kv_lens, hq, hkv, d, args[0].element_size())
    record(
        benchmark,
        shapes={"q_len": q_lens[0], "R": len(q_lens), "kv_len": kv_lens[0], "hq": hq, "hkv": hkv, "d": d,
                "planned": planned, "batch_invariant": batch_invariant},
        bytes_moved=bytes_moved,
        flops=flops,
        impl=impl,
    )


@pytest.mark.parametrize("planned", [False, True], ids=["unplanned", "planned"])
@pytest.mark.parametrize("q_lens,kv_lens,heads", CPU_SHAPES)
def test_verify_attention_reference_cpu(benchmark, q_lens, kv_lens, heads, planned):
    _run(benchmark, torch.device("cpu"), q_lens, kv_lens, "torch", torch.float32, heads, planned)


@pytest.mark.parametrize("q_lens,kv_lens,heads", CPU_SHAPES)
def test_verify_attention_batch_invariant_cpu(benchmark, q_lens, kv_lens, heads):
    """The batch-invariant reference (``plan_verify_attention(..., batch_invariant=True)``), planned, at the same
    shapes: its cost next to the fused path's."""
    _run(benchmark, torch.device("cpu"), q_lens, kv_lens, "torch", torch.float32, heads, True, True)


@pytest.mark.parametrize("q_lens,kv_lens", GPU_SHAPES)
def test_verify_attention_triton_cuda(benchmark, q_lens, kv_lens):
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernel is timed on CUDA only (the interpreter is not a speed reference)")
    _run(benchmark, torch.device("cuda"), q_lens, kv_lens, "triton", torch.bfloat16)


@pytest.mark.parametrize("q_lens,kv_lens", GPU_SHAPES)
def test_verify_attention_triton_cuda_batch_invariant(benchmark, q_lens, kv_lens):
    """The pinned, position-aligned launch (``plan_verify_attention(..., batch_invariant=True)``) at the same shapes."""
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernel is timed on CUDA only (the interpreter is not a speed reference)")
    _run(benchmark, torch.device("cuda"), q_lens, kv_lens, "triton", torch.bfloat16, planned=True,
         batch_invariant=True)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_verify_attention_triton_interpreted_smoke(benchmark, interpreted_smoke, batch_invariant):
    _run(benchmark, interpreted_smoke, [3, 1], [20, 9], "triton", torch.float32, heads=(4, 2, 16),
         planned=batch_invariant, batch_invariant=batch_invariant)

"""draft_block_attention speed: reference on CPU at small shapes, Triton on CUDA at drafting shapes.

Bytes = Q + block K/V + context K/V (once per KV head) + O; FLOPs = 4 * Hq * D * gamma * (ctx + gamma) per request.
"""

import pytest
import torch

from dspark_kernels.ops import draft_block_attention
from perf.roofline import record, sync
from tests.test_draft_block_attention import make_block_batch


def _run(benchmark, device, gamma, ctx, n_req, impl, dtype):
    hq, hkv, d, page_size = 32, 8, 128, 16
    args = [a.to(device) for a in make_block_batch([gamma] * n_req, [ctx] * n_req, hq, hkv, d, page_size, dtype)]

    def step():
        draft_block_attention(*args, impl=impl, check_inputs=False, max_seqlen_q=gamma)
        sync(device)

    step()
    benchmark(step)
    elem = args[0].element_size()
    bytes_moved = elem * n_req * (2 * gamma * hq * d + 2 * gamma * hkv * d + 2 * ctx * hkv * d)
    flops = 4.0 * n_req * hq * d * gamma * (ctx + gamma)
    record(benchmark, shapes={"gamma": gamma, "ctx": ctx, "R": n_req, "hq": hq, "hkv": hkv, "d": d},
           bytes_moved=bytes_moved, flops=flops, impl=impl)


@pytest.mark.parametrize("gamma,ctx,n_req", [(7, 256, 4), (15, 256, 4)])
def test_draft_block_attention_reference_cpu(benchmark, gamma, ctx, n_req):
    _run(benchmark, torch.device("cpu"), gamma, ctx, n_req, "torch", torch.float32)


@pytest.mark.parametrize("gamma,ctx,n_req", [(7, 2048, 1), (7, 2048, 64), (16, 4096, 32), (7, 1024, 256)])
def test_draft_block_attention_triton_cuda(benchmark, gamma, ctx, n_req):
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernel is timed on CUDA only")
    _run(benchmark, torch.device("cuda"), gamma, ctx, n_req, "triton", torch.bfloat16)


def test_draft_block_attention_triton_interpreted_smoke(benchmark, interpreted_smoke):
    _run(benchmark, interpreted_smoke, 3, 20, 2, "triton", torch.float32)

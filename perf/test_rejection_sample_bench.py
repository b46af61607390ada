"""rejection_sample speed: the reference on CPU at a small shape, the Triton kernels on CUDA at serving shapes.

Stochastic requests (T = 1, no top-k/top-p), every request with ``gamma`` drafts and draft probabilities.
Bytes (an upper-bound estimate of the Triton path):
    target logits read once                                (N + R) * V * elem
    float32 workspace: scaled write, e read+write, p read+write  (N + R) * V * 20
    per request, up to 3 passes over p_t and the draft row  R * V * 3 * 8
FLOPs: ~8 per logit in kernel 1 (scale, max, exp, sums, divide), ~6 per vocab entry per sampling pass in kernel 2.
"""

import pytest
import torch

from dspark_kernels.ops import rejection_sample
from perf.roofline import record, sync


def _batch(r: int, gamma: int, v: int, device: torch.device, dtype: torch.dtype) -> dict:
    n = r * gamma
    g = torch.Generator(device=device).manual_seed(0)
    draft_probs = torch.softmax(torch.randn(n, v, device=device, generator=g) * 2, dim=-1)
    return dict(
        draft_token_ids=torch.multinomial(draft_probs, 1, generator=g).squeeze(1),
        cu_num_draft_tokens=torch.arange(r + 1, device=device, dtype=torch.int32) * gamma,
        draft_probs=draft_probs,
        target_logits=(torch.randn(n + r, v, device=device, generator=g) * 2).to(dtype),
        temperature=torch.ones(r, device=device),
        top_k=None,
        top_p=None,
        accept_uniforms=torch.rand(n, device=device, generator=g).clamp(1e-7, 1 - 1e-7),
        sample_uniforms=torch.rand(n + r, device=device, generator=g).clamp(1e-7, 1 - 1e-7),
        max_spec_len=gamma,
    )


def _cost(r: int, gamma: int, v: int, elem: int) -> tuple[float, float]:
    rows = r * (gamma + 1)
    bytes_moved = rows * v * (elem + 20) + r * v * 3 * 8
    flops = rows * v * 8 + r * v * 3 * 6
    return float(bytes_moved), float(flops)


def _run(benchmark, device: torch.device, r: int, gamma: int, v: int, impl: str, dtype: torch.dtype) -> None:
    batch = _batch(r, gamma, v, device, dtype)

    def step():
        rejection_sample(**batch, impl=impl, check_inputs=False)
        sync(device)

    step()
    benchmark(step)
    bytes_moved, flops = _cost(r, gamma, v, batch["target_logits"].element_size())
    record(
        benchmark,
        shapes={"R": r, "gamma": gamma, "V": v, "logits_dtype": str(dtype).replace("torch.", "")},
        bytes_moved=bytes_moved,
        flops=flops,
        impl=impl,
    )


def test_rejection_sample_reference_cpu(benchmark):
    _run(benchmark, torch.device("cpu"), 8, 7, 8192, "torch", torch.float32)


@pytest.mark.parametrize("r", [1, 64, 256])
def test_rejection_sample_triton_cuda(benchmark, r):
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernels are timed on CUDA only (the interpreter is not a speed reference)")
    _run(benchmark, torch.device("cuda"), r, 7, 151936, "triton", torch.bfloat16)


def test_rejection_sample_triton_interpreted_smoke(benchmark, interpreted_smoke):
    _run(benchmark, interpreted_smoke, 2, 3, 300, "triton", torch.float32)

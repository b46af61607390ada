"""rejection_sample speed: the reference on CPU at a small shape, the Triton kernels on CUDA at serving shapes.

Stochastic requests (T = 1), every request with ``gamma`` drafts and draft probabilities; the ``filtered`` cases add
top-k 50 and top-p 0.9 to every request. Bytes of the Triton path (N drafts, R requests, V vocabulary):
    target logits read once (chunk statistics)             (N + R) * V * elem
    the final row and the rejected draft's row re-read     R * V * (elem + 4)   (chunk sums of the last token's draw)
    one chunk of both re-read by the draw                  R * 8192 * (elem + 4)
    with filters: the chunks' candidates written and read  2 * (N + R) * ceil(V / 8192) * 64 * 4
Minimum bytes: the logits once, one draft probability per draft, one draft row per request (its first rejection's
residual), the outputs. FLOPs: ~8 per logit (scale, max, exp, sums) plus ~6 per vocab entry of the draw's rows; the
candidates' sorting networks are not counted.
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


def _cost(r: int, gamma: int, v: int, elem: int, filtered: bool) -> tuple[float, float, float]:
    """(bytes moved, FLOPs, minimum bytes) of one call; see the module docstring."""
    n = r * gamma
    rows = n + r
    bytes_moved = rows * v * elem + r * (v + min(v, 8192)) * (elem + 4)
    if filtered:
        bytes_moved += 2 * rows * -(-v // 8192) * 64 * 4
    flops = rows * v * 8 + r * v * 6
    min_bytes = rows * v * elem + n * 4 + r * v * 4 + r * (gamma + 1) * 8
    return float(bytes_moved), float(flops), float(min_bytes)


def _run(benchmark, device: torch.device, r: int, gamma: int, v: int, impl: str, dtype: torch.dtype,
         filtered: bool = False) -> None:
    batch = _batch(r, gamma, v, device, dtype)
    if filtered:
        batch["top_k"] = torch.full((r,), 50, dtype=torch.int64, device=device)
        batch["top_p"] = torch.full((r,), 0.9, device=device)

    def step():
        rejection_sample(**batch, impl=impl, check_inputs=False)
        sync(device)

    step()
    benchmark(step)
    bytes_moved, flops, min_bytes = _cost(r, gamma, v, batch["target_logits"].element_size(), filtered)
    record(
        benchmark,
        shapes={"R": r, "gamma": gamma, "V": v, "logits_dtype": str(dtype).replace("torch.", ""),
                "top_k": 50 if filtered else 0, "top_p": 0.9 if filtered else 1.0},
        bytes_moved=bytes_moved,
        flops=flops,
        impl=impl,
        min_bytes=min_bytes,
    )


def test_rejection_sample_reference_cpu(benchmark):
    _run(benchmark, torch.device("cpu"), 8, 7, 8192, "torch", torch.float32)


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "top_k_top_p"])
@pytest.mark.parametrize("r", [1, 64, 256])
def test_rejection_sample_triton_cuda(benchmark, r, filtered):
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernels are timed on CUDA only (the interpreter is not a speed reference)")
    _run(benchmark, torch.device("cuda"), r, 7, 151936, "triton", torch.bfloat16, filtered)


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "top_k_top_p"])
def test_rejection_sample_triton_interpreted_smoke(benchmark, interpreted_smoke, filtered):
    _run(benchmark, interpreted_smoke, 2, 3, 300, "triton", torch.float32, filtered)

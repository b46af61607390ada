"""Target forward cost vs number of new tokens: the premise of speculative decoding.

A small random Qwen3 model holds ``CONTEXT`` tokens of one request in its paged cache; each round feeds 1, 4, 8 or 16
new tokens (decode, or verify of 1 + drafts) in one forward and rolls them back afterwards, so every round sees the
same cache state. If the step is bound by weight reads, verifying 16 tokens costs little more than decoding 1. On
the CPU it runs with fp32 GEMMs and with weight-only bf16 GEMMs (``gemm_dtype``: fp32 activations, bf16 weights).

Bytes and FLOPs: :func:`perf.costs.target_forward_cost` (every weight read once, embedding rows gathered, the
request's K/V read per layer and the new K/V written, fp32 logits written; 2 * matmul params per token + 4 * Hq * D
per visible (query, key) pair per layer).
"""

from __future__ import annotations

import pytest
import torch

from dspark_kernels.models import CausalLM, ModelConfig
from dspark_kernels.models.gemm_dtype import cast_gemm_weights
from perf.costs import target_forward_cost
from perf.roofline import record, sync

CONTEXT = 384
NEW_TOKENS = (1, 4, 8, 16)
CFG = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=1e6, qk_norm=True)
DEVICES = [pytest.param("cpu", torch.float32, "torch", None, id="cpu-fp32-torch"),
           pytest.param("cpu", torch.float32, "torch", torch.bfloat16, id="cpu-bf16gemm-torch")]
if torch.cuda.is_available():
    DEVICES.append(pytest.param("cuda", torch.bfloat16, "triton", None, id="cuda-bf16-triton"))


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(device: str, dtype: torch.dtype, gemm_dtype: torch.dtype | None):
        if (device, dtype, gemm_dtype) not in cache:
            torch.manual_seed(0)
            model = CausalLM(CFG)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(1.0, 0.1)
                    else:
                        p.normal_(0.0, 0.05)
            model = model.to(device=device, dtype=dtype).eval()
            cache[(device, dtype, gemm_dtype)] = model if gemm_dtype is None else cast_gemm_weights(model, gemm_dtype)
        return cache[(device, dtype, gemm_dtype)]

    return get


@pytest.mark.parametrize("n_new", NEW_TOKENS)
@pytest.mark.parametrize("device,dtype,impl,gemm_dtype", DEVICES)
def test_target_forward_verify(benchmark, models, device, dtype, impl, gemm_dtype, n_new):
    _bench_forward(benchmark, models(device, dtype, gemm_dtype), impl, gemm_dtype, n_new)


@pytest.mark.parametrize("n_new", NEW_TOKENS)
def test_target_forward_batch_invariant_cpu(benchmark, models, n_new):
    """bf16 GEMMs with the batch-invariant attention (``CausalLM.batch_invariant``): what bit-exact greedy
    speculative decoding costs next to ``cpu-bf16gemm-torch``."""
    model = models("cpu", torch.float32, torch.bfloat16)
    model.batch_invariant = True
    try:
        _bench_forward(benchmark, model, "torch", torch.bfloat16, n_new)
    finally:
        model.batch_invariant = False


def _bench_forward(benchmark, model: CausalLM, impl: str, gemm_dtype: torch.dtype | None, n_new: int) -> None:
    dev, dtype = model.device, model.dtype
    cache = model.new_cache(num_pages=(CONTEXT + max(NEW_TOKENS)) // 16 + 1, page_size=16)
    cache.add_request(0)
    gen = torch.Generator().manual_seed(1)
    ctx_ids = torch.randint(0, CFG.vocab_size, (CONTEXT,), generator=gen)
    model(ctx_ids.to(dev), torch.tensor([0, CONTEXT], dtype=torch.int32, device=dev), [0], cache, impl=impl)
    ids = torch.randint(0, CFG.vocab_size, (n_new,), generator=gen).to(dev)
    cu = torch.tensor([0, n_new], dtype=torch.int32, device=dev)

    def step():
        model(ids, cu, [0], cache, impl=impl, check_inputs=False)
        cache.rollback(0, n_new)  # identical cache state every round
        sync(dev)

    step()
    benchmark.pedantic(step, rounds=30 if dev.type == "cpu" else 100, warmup_rounds=3, iterations=1)
    assert cache.length(0) == CONTEXT
    bytes_moved, flops = target_forward_cost(model, CONTEXT, n_new)
    record(
        benchmark,
        shapes={"new_tokens": n_new, "context": CONTEXT, "hidden": CFG.hidden_size, "layers": CFG.num_hidden_layers,
                "hq": CFG.num_attention_heads, "hkv": CFG.num_key_value_heads, "d": CFG.head_dim,
                "vocab": CFG.vocab_size, "dtype": str(dtype).replace("torch.", ""),
                "gemm_dtype": str(gemm_dtype or dtype).replace("torch.", ""),
                "batch_invariant": model.batch_invariant},
        bytes_moved=bytes_moved,
        flops=flops,
        impl=impl,
    )


def test_target_forward_triton_interpreted_smoke(benchmark, models, interpreted_smoke):
    """The model forward with the Triton attention kernel, interpreted, once (CI mode only: ``interpreted_smoke``)."""
    _bench_forward(benchmark, models("cpu", torch.float32, None), "triton", None, 4)

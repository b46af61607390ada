"""On a CUDA machine: every Triton kernel, compiled for the GPU and run on it, against its PyTorch reference on the CPU.

The per-op parity tests build CPU tensors, so they check the kernels under the CPU interpreter only (which is how CI
runs them); this file runs the same cases on the device the kernels are written for: inputs are made on the CPU by the
per-op helpers, the reference runs there, the kernel runs on copies moved to CUDA, and the outputs come back for the
comparison. Skipped without a GPU (``bash perf/gpu_check.sh`` runs it).

Tolerances: the GPU's ``exp``/``log`` and fp32 division differ from the CPU's in the last bits, so probabilities and
attention outputs are compared within fp32 rounding, and a sampled token may differ where its uniform falls within
such a difference of a CDF boundary (at most one draw in a thousand is allowed to; greedy tokens must all match).
"""

from __future__ import annotations

import pytest
import torch

from dspark_kernels.ops import draft_block_attention, rejection_sample, sequential_head, verify_attention
from tests import test_rejection_sample as rs
from tests import test_sequential_head as sh
from tests.test_draft_block_attention import CASES as BLOCK_CASES
from tests.test_draft_block_attention import make_block_batch
from tests.test_survival import CONFIGS as SURVIVAL_CONFIGS
from tests.test_survival import check_kernels_match_reference
from tests.test_verify_attention import CASES as VERIFY_CASES
from tests.test_verify_attention import assert_close_ratio, make_paged_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


def to_cuda(x):
    """Tensors (also inside tuples, lists, dicts and NamedTuples) moved to the GPU; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(CUDA)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_cuda(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(to_cuda(v) for v in x)
    if isinstance(x, dict):
        return {k: to_cuda(v) for k, v in x.items()}
    return x


def assert_tokens_match(tri: torch.Tensor, ref: torch.Tensor, greedy_rows: torch.Tensor | None = None) -> None:
    """Equal tokens, except at most one sampled draw in a thousand (never a greedy one)."""
    tri = tri.cpu()
    differ = tri != ref
    if greedy_rows is not None:
        assert not bool(differ[greedy_rows].any()), "a greedy token differs between the GPU kernel and the reference"
    assert int(differ.sum()) <= max(1, differ.numel() // 1000), f"{int(differ.sum())} of {differ.numel()} differ"


# ------------------------------------------------------------------------------------------------------ attention
def assert_attention_matches(op, args) -> None:
    """fp32 attention: the kernel on the GPU within fp32 rounding of the reference on the CPU."""
    torch.testing.assert_close(op(*to_cuda(args), impl="triton").cpu(), op(*args, impl="torch"), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page_size", VERIFY_CASES)
def test_verify_attention_on_the_gpu(q_lens, kv_lens, hq, hkv, d, page_size):
    assert_attention_matches(verify_attention, make_paged_batch(q_lens, kv_lens, hq, hkv, d, page_size))


@pytest.mark.parametrize("dtype,ratio", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_verify_attention_half_on_the_gpu(dtype, ratio):
    args = make_paged_batch([3, 1, 8], [40, 9, 70], 8, 2, 64, 16, dtype=dtype)
    ref = verify_attention(*args, impl="torch")
    tri = verify_attention(*to_cuda(args), impl="triton")
    assert tri.dtype == dtype
    assert_close_ratio(ref, tri.cpu(), ratio)


@pytest.mark.parametrize("block_lens,ctx_lens,hq,hkv,d,page_size", BLOCK_CASES)
def test_draft_block_attention_on_the_gpu(block_lens, ctx_lens, hq, hkv, d, page_size):
    assert_attention_matches(draft_block_attention, make_block_batch(block_lens, ctx_lens, hq, hkv, d, page_size))


# ------------------------------------------------------------------------------------------------------- sampling
REJECTION_CASES = [
    pytest.param(dict(lens=[3, 0, 2, 4, 1], v=v, temps=[1.0, 0.7, 0.0, 1.3, 1.0]), id=f"vocab{v}")
    for v in (1023, 1024, 1025, 4097)
] + [
    pytest.param(dict(lens=[2, 1], v=151936, temps=[1.0, 0.0], dtype=torch.bfloat16), id="qwen-vocab-bf16"),
    pytest.param(dict(lens=[0, 3, 0, 1], v=257, temps=[1.0, 0.0, 0.8, 1.0]), id="empty-drafts"),
    pytest.param(dict(lens=[3, 2, 4, 2], v=500, temps=[1.0, 0.5, 2.0, 0.0], top_k=[0, 1, 5, 3],
                      top_p=[0.9, 1.0, 0.5, 0.3]), id="top-k-top-p"),
    pytest.param(dict(lens=[4, 4], v=300, temps=[1.0, 1.0], with_draft_probs=False), id="no-draft-probs"),
]


@pytest.mark.parametrize("case", REJECTION_CASES)
def test_rejection_sample_on_the_gpu(case):
    case = dict(case)
    batch = rs.make_batch(case.pop("lens"), case.pop("v"), **case)
    s = batch["max_spec_len"]
    counters = {name: torch.zeros(s, dtype=torch.int64) for name in ("accept_counter", "draft_counter")}
    ref = rejection_sample(**batch, **counters, impl="torch")
    gpu_counters = to_cuda(counters)
    tri = rejection_sample(**to_cuda(batch), **gpu_counters, impl="triton")
    greedy = (batch["temperature"] == 0)[:, None].expand_as(ref.output_token_ids)
    assert_tokens_match(tri.output_token_ids, ref.output_token_ids, greedy)
    if torch.equal(tri.output_token_ids.cpu(), ref.output_token_ids):
        assert torch.equal(tri.num_accepted.cpu(), ref.num_accepted)
        for name in counters:
            assert torch.equal(gpu_counters[name].cpu(), counters[name])
    rs.check_structure(batch, type(tri)(*(t.cpu() for t in tri)))  # a NamedTuple of tensors


SEQUENTIAL_CASES = [
    pytest.param(dict(lens=[3, 0, 2, 5, 0, 1], v=300, kind=kind, temps=[1.0, 0.7, 0.0, 1.3, 1.0, 0.0]), id=kind)
    for kind in sh.KINDS
] + [
    pytest.param(dict(lens=[3, 2, 4, 0, 2], v=40, kind="rnn", temps=[1.0, 0.5, 2.0, 1.0, 0.0], top_k=[0, 1, 5, 3, 2],
                      top_p=[0.9, 1.0, 0.5, 0.3, 0.8]), id="rnn-top-k-top-p"),
    pytest.param(dict(lens=[2, 0, 3], v=4097, kind="vanilla", r=4, temps=[1.0, 1.0, 0.0]), id="vocab4097"),
    pytest.param(dict(lens=[3, 2], v=130, kind="rnn", d=70, r=35, temps=[1.0, 0.0]), id="large-rank-and-hidden"),
    pytest.param(dict(lens=[3, 2], v=151936, kind="gated", d=64, r=16, temps=[1.0, 0.0]), id="qwen-vocab"),
]


@pytest.mark.parametrize("case", SEQUENTIAL_CASES)
@pytest.mark.parametrize("greedy_only", [False, True])
def test_sequential_head_on_the_gpu(case, greedy_only):
    case = dict(case)
    lens = case.pop("lens")
    if greedy_only:
        case["temps"] = [0.0] * len(lens)
    args = sh.make_args(lens, case.pop("v"), case.pop("kind"), **case)
    if greedy_only:
        args["uniforms"] = None
    ref = sequential_head(**args, impl="torch")
    tri = sequential_head(**to_cuda(args), impl="triton")
    slot_greedy = torch.repeat_interleave(args["temperature"] == 0, torch.tensor(lens))
    assert_tokens_match(tri.tokens, ref.tokens, slot_greedy)
    torch.testing.assert_close(tri.confidence_logits.cpu(), ref.confidence_logits, rtol=1e-5, atol=1e-5)
    if greedy_only:
        assert tri.draft_probs is None
    elif torch.equal(tri.tokens.cpu(), ref.tokens):  # rows after a differing draw condition on another token
        torch.testing.assert_close(tri.draft_probs.cpu(), ref.draft_probs, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------------- survival
@pytest.mark.parametrize("quantized", [False, True], ids=["continuous", "ties"])
@pytest.mark.parametrize("r,gamma", SURVIVAL_CONFIGS)
def test_survival_and_scheduling_on_the_gpu(r, gamma, quantized):
    check_kernels_match_reference(r, gamma, quantized, CUDA)

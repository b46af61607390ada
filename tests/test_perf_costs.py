"""perf/costs.py and perf/roofline.py: the bytes and FLOPs the benches record, counted independently by hand for the
shipped target and DSpark drafter, and the device-peak lookup."""

from pathlib import Path

import pytest

from dspark_kernels.drafters import load_drafter
from dspark_kernels.models import load_model
from perf.costs import decode_flops, draft_block_cost, target_forward_cost
from perf.roofline import peak_for

ASSETS = Path(__file__).resolve().parents[1] / "dspark_kernels" / "assets"
# the shipped target: 6 layers, hidden 256, MLP 768, 4 query heads and 2 KV heads of 64, vocabulary 8192, tied head
LAYER = 256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 768 * 256  # q, k + v, o, gate + up + down
NORMS = 2 * 256 + 2 * 64  # input / post-attention norms, q / k norms
HEAD = 8192 * 256


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def shipped(request):
    target = load_model(ASSETS / "target", gemm_dtype=request.param)
    return target, load_drafter(ASSETS / "drafters" / "dspark", target, gemm_dtype=request.param), request.param


def test_target_forward_cost_counts_the_tied_head(shipped):
    """The LM head is tied to the embedding: it is still read as a GEMM operand every forward (the fp32 verify record
    used to leave it out)."""
    target, _, gemm = shipped
    w = 2 if gemm == "bfloat16" else 4
    ctx, new = 128, 8
    kv_row = 6 * 2 * 2 * 64
    expect_bytes = (w * (6 * LAYER + HEAD) + 4 * (6 * NORMS + 256) + 4 * (new * 256 + kv_row * (ctx + 2 * new))
                    + 4 * new * 8192)
    pairs = sum(ctx + i + 1 for i in range(new))
    expect_flops = 2.0 * (6 * LAYER + HEAD) * new + 4.0 * 6 * 4 * 64 * pairs
    assert target_forward_cost(target, ctx, new) == (expect_bytes, expect_flops)


def test_draft_block_cost_leaves_out_the_context_projection(shipped):
    """Without new context the backbone never runs ``fc`` (768 -> 256) or ``hidden_norm``."""
    _, drafter, gemm = shipped
    w = 2 if gemm == "bfloat16" else 4
    ctx, gamma = 128, 7
    kv_read = 2 * 2 * 2 * 64 * ctx * 4
    expect_bytes = (w * 2 * LAYER + 4 * (2 * NORMS + 256) + w * HEAD + 4 * gamma * 256 + kv_read
                    + 4 * gamma * 8192)
    expect_flops = 2.0 * gamma * (2 * LAYER + HEAD) + 4.0 * 2 * 4 * 64 * gamma * (ctx + gamma)
    assert draft_block_cost(drafter, ctx, gamma) == (expect_bytes, expect_flops)


def test_decode_flops_split_the_layers_and_the_head(shipped):
    target = shipped[0]
    assert decode_flops(target, 62, 48) == 2.0 * (6 * LAYER * 62 + HEAD * 48)  # AR: 15 prompt + 48 new tokens


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", (4.8e12, 989e12)), ("NVIDIA GH200 480GB", None), ("NVIDIA H100 PCIe", (2.0e12, 756e12)),
    ("NVIDIA H100 80GB HBM3", (3.35e12, 989e12)), ("NVIDIA A100-SXM4-40GB", (1.555e12, 312e12)),
    ("NVIDIA L40S", (0.864e12, 362e12)), ("NVIDIA L40", (0.864e12, 181e12)), ("NVIDIA L4", (0.3e12, 121e12)),
    ("Tesla T4", None), (None, None),
])
def test_peak_lookup_takes_the_longest_matching_name(name, peak):
    assert peak_for(name) == peak


def test_record_gives_the_gpu_roofline_to_gpu_benchmarks_only(monkeypatch):
    """On a GPU machine the CPU reference benchmarks (``impl="torch"``) must not be scored against the GPU's peaks."""
    from types import SimpleNamespace

    from perf import roofline

    monkeypatch.setattr(roofline, "device_info", lambda: {"cuda": True, "gpu": "NVIDIA H200", "cpu": "Some CPU"})
    for impl, on_gpu in (("torch", False), ("triton", True)):
        bench = SimpleNamespace(extra_info={}, stats=SimpleNamespace(stats=SimpleNamespace(median=1e-3)))
        roofline.record(bench, shapes={}, bytes_moved=4.8e9, flops=1e9, impl=impl)
        assert bench.extra_info["device"]["ran_on"] == ("NVIDIA H200" if on_gpu else "Some CPU")
        assert ("pct_peak_bw" in bench.extra_info) == on_gpu
        if on_gpu:
            assert bench.extra_info["pct_peak_bw"] == pytest.approx(100.0)  # 4.8 GB in 1 ms on a 4.8 TB/s device

"""The shared reference sampling helpers (``reference/_sampling.py``) against their plain formulas, bit for bit.

The helpers are also the CPU execution path, so they skip passes that cannot change the result (filters no row asks
for, the inverse-CDF fallback when every row has a hit, argmax/one-hot rows in all-stochastic batches). The plain
formulas below apply every mask to every row; the outputs must be identical, including ties, zero rows after
filtering, uniforms at the edges of [0, 1) and mixes of rows that do and do not filter.
"""

from __future__ import annotations

import pytest
import torch

from dspark_kernels.reference._sampling import argmax_rows, first_true, inverse_cdf_ref, target_probs_ref


def _plain_target_probs(logits, temperature, top_k, top_p):
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float() / t[:, None]
    v = scaled.shape[1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if top_k is not None:
        for i in range(scaled.shape[0]):
            k = int(top_k[i])
            if 0 < k < v:
                keep[i] = scaled[i] >= scaled[i].sort(descending=True).values[k - 1]
    e = torch.where(keep, torch.exp(scaled - scaled.max(dim=1, keepdim=True).values), torch.zeros_like(scaled))
    if top_p is not None:
        z = e.sum(dim=1)
        keep = torch.ones_like(e, dtype=torch.bool)
        for i in range(e.shape[0]):
            if float(top_p[i]) < 1:
                desc = e[i].sort(descending=True).values
                first = min(int((desc.cumsum(0) < float(top_p[i]) * z[i]).sum()), v - 1)
                keep[i] = e[i] >= desc[first]
        e = torch.where(keep, e, torch.zeros_like(e))
    return e / e.sum(dim=1, keepdim=True)


def _plain_inverse_cdf(w, u):
    idx = torch.arange(w.shape[1])
    pos = w > 0
    hit = (w.cumsum(dim=1) > (u * w.sum(dim=1))[:, None]) & pos
    last = torch.where(pos, idx, -1).max(dim=1).values
    return torch.where(hit.any(dim=1), hit.int().argmax(dim=1), last)


def _rows(n: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    logits[0, : min(5, v)] = 9.0  # a tie at the top
    if n > 1:
        logits[1] = 0.0  # a flat row
    return logits


@pytest.mark.parametrize("v", [1, 2, 31, 8192])
@pytest.mark.parametrize("filters", ["none", "top_k", "top_p", "mixed"])
def test_target_probs_equal_the_plain_formula(v, filters):
    n = 9
    logits = _rows(n, v, v)
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 0.7, 1.3, 1.0, 0.1])
    top_k = torch.zeros(n, dtype=torch.int64)
    top_p = torch.ones(n)
    if filters in ("top_k", "mixed"):
        top_k = torch.tensor([3, 0, 1, v, v - 1, 2, 0, 7, 5]).clamp(min=0)
    if filters in ("top_p", "mixed"):
        top_p = torch.tensor([0.5, 1.0, 0.9, 1e-6, 0.99, 1.0, 0.3, 0.75, 1.0])
    before = logits.clone()
    got = target_probs_ref(logits, temperature, top_k, top_p)
    assert torch.equal(got, _plain_target_probs(logits, temperature, top_k, top_p))
    assert torch.equal(logits, before)
    assert torch.equal(target_probs_ref(logits, temperature, None, None),
                       _plain_target_probs(logits, temperature, None, None))


def test_inverse_cdf_equals_the_plain_formula():
    g = torch.Generator().manual_seed(0)
    for v in (1, 3, 64, 8192):
        w = torch.rand(50, v, generator=g)
        w[w < 0.6] = 0.0  # sparse rows, with zero weights before and after hits
        w[0] = 0.0
        w[0, v // 2] = 1.0  # one positive weight
        w[1, 0] = 1e-30  # a weight too small to move the sum
        u = torch.rand(50, generator=g)
        u[:3] = torch.tensor([0.0, 1.0 - 2**-24, 0.5])
        for weights in (w, w[w.sum(dim=1) > 0]):
            uu = u[: weights.shape[0]]
            assert torch.equal(inverse_cdf_ref(weights, uu), _plain_inverse_cdf(weights, uu))


def test_inverse_cdf_falls_back_to_the_last_positive_weight():
    # u * sum(w) rounds above the last prefix sum: no hit, so the plain formula's fallback (last positive weight)
    w = torch.tensor([[0.1, 0.2, 0.0, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    u = torch.tensor([1.0, 0.5])
    hit = w.cumsum(dim=1) > (u * w.sum(dim=1))[:, None]
    assert hit.any(dim=1).tolist() == [False, True]
    assert inverse_cdf_ref(w, u).tolist() == [3, 0] == _plain_inverse_cdf(w, u).tolist()


def _argmax_cases():
    """Rows that exercise the lowest-index rule: random, ties, +-inf, NaN (torch counts it as the maximum)."""
    torch.manual_seed(7)
    v = 37
    rows = [torch.randn(v), torch.zeros(v), torch.full((v,), -float("inf"))]
    tied = torch.randn(v)
    tied[[4, 9, 30]] = tied.max() + 1
    rows.append(tied)
    with_inf = torch.randn(v)
    with_inf[[2, 20]] = float("inf")
    rows.append(with_inf)
    with_nan = torch.randn(v)
    with_nan[[11, 25]] = float("nan")
    with_nan[3] = float("inf")
    rows.append(with_nan)
    rounded = torch.randint(-2, 3, (v,)).float()  # many ties at the maximum
    rows.append(rounded)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax(dtype):
    logits = _argmax_cases().to(dtype)
    expected = logits.argmax(dim=1)
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert torch.equal(got, expected)
    assert got.tolist()[:7] == [int(expected[0]), 0, 0, 4, 2, 11, int(expected[6])]


def test_argmax_rows_on_views_grads_inference_and_no_rows():
    logits = _argmax_cases()
    wide = torch.randn(5, 3000)
    wide[:, 1234] = 50.0
    wide[2, 7] = 50.0  # a tie: the lower index wins
    for x in (logits.t().contiguous().t(), logits[:, ::2], logits[::2], wide, wide.t().contiguous().t()):
        assert torch.equal(argmax_rows(x), x.argmax(dim=1))
    leaf = torch.randn(4, 50, requires_grad=True)
    assert torch.equal(argmax_rows(leaf), leaf.argmax(dim=1))
    with torch.inference_mode():
        frozen = torch.randn(3, 60)
        assert torch.equal(argmax_rows(frozen), frozen.argmax(dim=1))
    assert argmax_rows(torch.zeros(0, 9)).shape == (0,)


def test_first_true_equals_torch_bool_max():
    torch.manual_seed(3)
    mask = torch.rand(9, 300) > 0.97
    mask[0] = False  # no True: found False, index 0
    mask[1] = True
    mask[2] = False
    mask[2, -1] = True
    for m in (mask, mask[:, 1:], mask[::2], mask.t().contiguous().t(), torch.zeros(0, 5, dtype=torch.bool)):
        found, first = first_true(m)
        ref_found, ref_first = m.max(dim=1)
        assert found.dtype == torch.bool and first.dtype == torch.int64
        assert torch.equal(found, ref_found) and torch.equal(first, ref_first)
    assert first_true(mask)[1][:3].tolist() == [0, 0, 299]


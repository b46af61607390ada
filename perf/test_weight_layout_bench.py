"""Row-major vs column-major fp32 linear weights (:mod:`dspark_kernels.models.weight_layout`) at SmolLM2-135M's shapes.

``F.linear(x, w)`` with the weight ``[out, in]`` stored row-major hands BLAS a transposed B operand; stored
column-major (the transpose of a contiguous ``[in, out]``), the B operand is plain row-major. Both compute the same
dot products. The CPU models store column-major because the second is 2-4x faster at 8..48 rows here, the rows of a
verify block; at 1 row and from 64 rows the two take the same time. Compare the two layouts' rows of one run.
"""

import pytest
import torch
import torch.nn.functional as F

from perf.roofline import record, sync

SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


@pytest.mark.parametrize("rows", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("layout", ["row_major", "column_major"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_linear_layout(benchmark, bench_device, shape, layout, rows):
    k, n = SHAPES[shape]
    torch.manual_seed(0)
    w = torch.randn(n, k, device=bench_device)
    if layout == "column_major":
        w = w.t().contiguous().t()
    x = torch.randn(rows, k, device=bench_device)

    def run():
        F.linear(x, w)
        sync(bench_device)

    run()
    benchmark(run)
    record(benchmark, shapes={"rows": rows, "in": k, "out": n, "layout": layout},
           bytes_moved=4.0 * (k * n + rows * (k + n)), flops=2.0 * rows * k * n, impl="torch")

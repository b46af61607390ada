"""fp32 vs weight-only bf16 GEMMs (:mod:`dspark_kernels.models.gemm_dtype`) at the shipped target's shapes.

One decode step multiplies 1 row by each weight; a verify block multiplies gamma + 1 rows (8 at gamma 7, 16 at gamma
15). Where an fp32 GEMM over 8 rows costs several times a 1-row one (compute-bound on a CPU core), the bf16 one stays
close to its 1-row cost, which is what makes verifying a draft block cheap. ``bfloat16`` runs the layer as the
models do (from a oneDNN-prepacked weight where the CPU supports it); ``bfloat16_unpacked`` is the plain ``F.linear``
on the same bf16 weight (reordered by oneDNN at every call), for the side-by-side gain. Compare the rows of one run.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark_kernels.models.gemm_dtype import CastGemmLinear
from perf.roofline import record, sync

SHAPES = {"mlp_up": (256, 768), "mlp_down": (768, 256), "lm_head": (256, 8192)}


@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("gemm_dtype", ["float32", "bfloat16", "bfloat16_unpacked"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_linear(benchmark, bench_device, shape, gemm_dtype, rows):
    k, n = SHAPES[shape]
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False).to(bench_device).requires_grad_(False)
    layer = lin if gemm_dtype == "float32" else CastGemmLinear(lin, torch.bfloat16)
    x = torch.randn(rows, k, device=bench_device)

    def run():
        if gemm_dtype == "bfloat16_unpacked":
            F.linear(x.bfloat16(), layer.weight).float()
        else:
            layer(x)
        sync(bench_device)

    with torch.inference_mode():
        run()
        benchmark(run)
    weight_bytes = 4 if gemm_dtype == "float32" else 2
    record(benchmark, shapes={"rows": rows, "in": k, "out": n, "gemm_dtype": gemm_dtype},
           bytes_moved=weight_bytes * k * n + 4.0 * rows * (k + n), flops=2.0 * rows * k * n, impl="torch")

"""Every Triton kernel compiles for a Hopper GPU (sm_90), without a GPU.

The CPU interpreter accepts code the GPU compiler rejects (non-constexpr globals, dtype mixes in tl.dot, ...), so the
parity tests alone cannot prove the kernels build for the device they are written for. This compiles each kernel with
realistic argument types in a subprocess where ``TRITON_INTERPRET`` is unset. (The sequential head has its own check in
``test_sequential_head.py``.) On a GPU machine ``test_gpu_parity.py`` compiles and runs them on the device.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_SCRIPT = r'''
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from perf.kernel_resources import RS_FP32, RS_I32, RS_I64

def build(module, name, types, consts):
    kernel = getattr(importlib.import_module("dspark_kernels.ops." + module), name)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))

for dt in ("bf16", "fp16", "fp32"):
    att = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=64, PAGE_SIZE=16, DOT_F32=False,
               PRECISION="ieee" if dt == "fp32" else "tf32")
    idx = {n: "*i32" for n in ("PT", "CU", "SL", "CL", "TE")}
    parts = {n: "*fp32" for n in ("MS", "LS", "AS")}
    # default, batch-invariant, split-KV, ragged (enumerated tiles) launches
    for aligned, splits, flat in ((False, 1, False), (True, 1, False), (False, 32, False), (False, 1, True),
                                  (True, 1, True)):
        build("verify_attention", "_verify_attention_kernel",
              {**{n: "*" + dt for n in ("Q", "K", "V", "Out")}, **idx, **parts, "qk_scale": "fp32"},
              {**att, "ALIGNED": aligned, "NUM_SPLITS": splits, "FLAT": flat})
    build("_flash", "_merge_splits_kernel", {**parts, "Out": "*" + dt},
          dict(NUM_SPLITS=32, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32))
    for splits, block_m in ((1, 32), (16, 64)):
        build("draft_block_attention", "_draft_block_attention_kernel",
              {**{n: "*" + dt for n in ("Q", "KB", "VB", "KC", "VC", "Out")}, **idx, **parts, "qk_scale": "fp32"},
              {**att, "NUM_SPLITS": splits, "BLOCK_M": block_m})
    rs = {"logits_ptr": "*" + dt, **{n: "*fp32" for n in RS_FP32}, **{n: "*i64" for n in RS_I64},
          **{n: "*i32" for n in RS_I32}}
    build("rejection_sample", "_chunk_stats_kernel", rs, dict(HAS_TOP_K=True, HAS_TOP_P=True, CANDIDATES=64,
                                                             CHUNK_V=8192, BLOCK_V=1024))
    for top_p, row_map in ((False, False), (True, False), (True, True)):
        build("rejection_sample", "_cut_level_kernel", rs,
              dict(TOP_P=top_p, HAS_TOP_K=True, HAS_TOP_P=True, LAST=False, ROW_MAP=row_map, CHUNK_V=8192,
                   BLOCK_V=1024, CHUNKS_P2=32))
    build("rejection_sample", "_last_chunk_sums_kernel", rs, dict(HAS_DRAFT_PROBS=True, CHUNK_V=8192, BLOCK_V=1024))
    build("rejection_sample", "_draw_kernel", rs, dict(HAS_DRAFT_PROBS=True, RESID_EPS=1e-8, CHUNK_V=8192,
                                                      BLOCK_V=1024, CHUNKS_P2=32))
build("rejection_sample", "_row_merge_kernel", rs, dict(CHUNKS_P2=32))
build("rejection_sample", "_cut_candidates_kernel", rs, dict(HAS_TOP_K=True, HAS_TOP_P=True, CANDIDATES=64,
                                                             CHUNKS_P2=32))
build("rejection_sample", "_accept_kernel", rs, dict(HAS_DRAFT_PROBS=True, HAS_ACCEPT_COUNTER=True,
                                                     HAS_DRAFT_COUNTER=True))
build("survival", "_prefix_survival_kernel",
      {"LOGITS": "*fp32", "CU": "*i64", "TEMPS": "*fp32", "BIASES": "*fp32", "OUT": "*fp32"},
      dict(HAS_TEMPS=True, HAS_BIASES=True))
build("survival", "_theta_scan_kernel", {"A_SORTED": "*fp32", "SPS": "*fp64", "THETA": "*fp64", "TAU": "*fp64"},
      dict(BLOCK=1024))
build("survival", "_first_drop_kernel", {"A_SORTED": "*fp32", "TAU": "*fp64", "BEST": "*fp64", "SPS": "*fp64",
                                         "RUN_INDEX": "*i32", "RUNS": "*fp64", "COUNT": "*i32"},
      dict(STEP_AWARE=True, BLOCK=1024))
build("survival", "_scatter_lengths_kernel",
      {"A_SORTED": "*fp32", "REQ_SORTED": "*i64", "POS_SORTED": "*i64", "COUNT": "*i32", "LENS": "*i32"},
      dict(BLOCK=1024))
print("compiled")
'''


def test_all_kernels_compile_for_sm90():
    if torch.cuda.is_available():
        pytest.skip("on a GPU test_gpu_parity.py compiles and runs the kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])  # the repository root: perf is imported from it
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]

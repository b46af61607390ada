"""Registers, spills and shared memory of every Triton kernel at its default launch config, for sm_80 and sm_90,
compiled offline (no GPU): Triton's compiler to PTX, then the ``ptxas`` Triton bundles (the one it picks per
architecture) with ``-v``.

Each row of ``results/kernel_resources.json`` is ``{"kernel", "arch", "config", "regs", "spill_bytes",
"smem_bytes", "async_buffers", "warps_per_sm", "sass_instructions"}``: ``regs`` per thread and ``spill_bytes`` (spill
stores + loads) from ``ptxas -v``, ``smem_bytes`` the shared memory Triton allocates for the kernel (its metadata),
``async_buffers`` the depth of its shallowest ``cp.async`` ring (:func:`async_buffers`), ``warps_per_sm`` the warps an
SM holds (:func:`warps_per_sm`), ``sass_instructions`` its static SASS count (:func:`sass_instructions`). The configs
are the ops' launch defaults (what runs until ``autotune`` stores better for a GPU), with the bf16 activations and the
realistic constexprs of an 8B-class target (head dim 128, GQA group 4; rank 64 for the sequential head).

Arguments are specialized as the JIT specializes them at launch for those shapes: every pointer (torch allocations are
16-byte aligned) is marked ``tt.divisibility = 16``, and so is every integer whose value there (``INT_VALUES``) is a
multiple of 16; an integer equal to 1 becomes a constant. That is what lets Triton vectorize the loads to 16 bytes and
pipeline them through ``cp.async`` (``num_stages``); a compile without it reads 2-byte loads and pipelines nothing,
which no launch would run.

Must run where ``TRITON_INTERPRET`` is unset (the kernels are compiled, not interpreted)::

    python perf/kernel_resources.py --json results/kernel_resources.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARCHS = (80, 90)
# pointer argument types of the rejection-sampling kernels (the logits are bf16)
RS_FP32 = ("temp_ptr", "top_p_ptr", "cmax_ptr", "csum_ptr", "row_max_ptr", "row_z_ptr", "need_ptr", "above_ptr",
           "hist_in_ptr", "hist_out_ptr", "draft_probs_ptr", "accept_u_ptr", "sample_u_ptr", "sums_ptr",
           "cand_ptr")
RS_I64 = ("top_k_ptr", "keep_key_ptr", "keep_bits_ptr", "prefix_ptr", "draft_ids_ptr", "out_ptr", "final_row_ptr",
          "accept_cnt_ptr", "draft_cnt_ptr", "last_ptr", "row_map_ptr")
# integer arguments' values at the report's shapes: the attention strides are multiples of the head dim (the page
# table's of its 256 pages at 4k context); the head's weights are w1 [V, r], w2 [r, V] and the transposed gate_w
# [d + r, r] / rnn_w [2r + d, 3r] (d 4096, r 64); stride_out is the rejection sampler's max_spec_len + 1
INT_VALUES = {"V": 151_936, "D": 4096, "RANK": 64, "s_w1": 64, "s_gw_in": 1, "s_gw_out": 4160, "s_rw_in": 1,
              "s_rw_out": 4224, "s_w2r": 151_936, "s_w2v": 1, "stride_pt": 256, "stride_out": 8}
ATTENTION_STRIDE = 128
RS_I32 = ("row_req_ptr", "carg_ptr", "row_arg_ptr", "cu_ptr", "num_acc_ptr", "resolved_ptr")


def _specs() -> list[tuple[str, str, dict, dict, dict]]:
    """``(module, kernel, arg types, constexprs, launch options)`` of every kernel at its default config."""
    ops = "dspark_kernels.ops."
    va = importlib.import_module(ops + "verify_attention")._DEFAULTS
    dba = importlib.import_module(ops + "draft_block_attention")._DEFAULTS
    rs = importlib.import_module(ops + "rejection_sample")._DEFAULTS
    head_mod = importlib.import_module(ops + "sequential_head")
    sh = head_mod._DEFAULTS
    sv = importlib.import_module(ops + "survival")._DEFAULTS
    att = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, DOT_F32=False, PRECISION="tf32")
    io = {**{n: "*bf16" for n in ("Q", "K", "V", "Out", "KB", "VB", "KC", "VC")},
          **{n: "*i32" for n in ("PT", "CU", "SL", "CL", "TE")}, **{n: "*fp32" for n in ("MS", "LS", "AS")},
          "qk_scale": "fp32"}

    def launch(cfg: dict) -> dict:
        return {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}

    def blocks(cfg: dict) -> dict:
        return {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}

    specs = []
    for bucket, cfg in va.items():
        for splits in (1, 32) if bucket == "decode" else (1,):
            specs.append(("verify_attention", "_verify_attention_kernel", io,
                          {**att, **blocks(cfg), "ALIGNED": False, "NUM_SPLITS": splits,
                           "FLAT": bucket == "prefill"}, launch(cfg)))
    specs.append(("_flash", "_merge_splits_kernel", io, dict(NUM_SPLITS=32, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32),
                  {"num_warps": 4}))
    for block_m in (dba["BLOCK_M"], 32, 64, 128):  # the launcher grows BLOCK_M to a whole block (gamma x group)
        specs.append(("draft_block_attention", "_draft_block_attention_kernel", io,
                      {**att, **blocks(dba), "BLOCK_M": block_m, "NUM_SPLITS": 1,
                       "BLOCK_N": dba["BLOCK_N"] if block_m < 64 else min(dba["BLOCK_N"], 16)},
                      {**launch(dba), "num_warps": dba["num_warps"] if block_m <= 16 else max(dba["num_warps"], 8)}))
    rs_types = {"logits_ptr": "*bf16", **{n: "*fp32" for n in RS_FP32}, **{n: "*i64" for n in RS_I64},
                **{n: "*i32" for n in RS_I32}}
    tiles = {k: rs[k] for k in ("BLOCK_V", "CHUNK_V")}
    chunks = tiles | {"CHUNKS_P2": 32}  # V = 151,936 in 19 chunks of 8192
    filters = dict(HAS_TOP_K=True, HAS_TOP_P=True)
    specs.append(("rejection_sample", "_chunk_stats_kernel", rs_types,
                  {**tiles, **filters, "CANDIDATES": rs["CANDIDATES"]}, launch(rs)))
    specs.append(("rejection_sample", "_cut_candidates_kernel", rs_types,
                  {**filters, "CANDIDATES": rs["CANDIDATES"], "CHUNKS_P2": 32}, {"num_warps": 4}))
    specs.append(("rejection_sample", "_row_merge_kernel", rs_types, {"CHUNKS_P2": 32}, {"num_warps": 1}))
    for top_p, row_map in ((False, False), (True, False), (True, True)):
        specs.append(("rejection_sample", "_cut_level_kernel", rs_types,
                      dict(TOP_P=top_p, HAS_TOP_K=True, HAS_TOP_P=True, LAST=False, ROW_MAP=row_map, **chunks),
                      launch(rs)))
    specs.append(("rejection_sample", "_accept_kernel", rs_types,
                  dict(HAS_DRAFT_PROBS=True, HAS_ACCEPT_COUNTER=True, HAS_DRAFT_COUNTER=True), {"num_warps": 1}))
    specs.append(("rejection_sample", "_last_chunk_sums_kernel", rs_types, dict(HAS_DRAFT_PROBS=True, **tiles),
                  launch(rs)))
    specs.append(("rejection_sample", "_draw_kernel", rs_types, dict(HAS_DRAFT_PROBS=True, RESID_EPS=1e-8, **chunks),
                  launch(rs)))
    head = {"logits_ptr": "*bf16", "hidden_ptr": "*bf16", "anchor_ptr": "*i64", "cu_ptr": "*i32", "w1_ptr": "*bf16",
            "w2_ptr": "*bf16", "gate_w_ptr": "*bf16", "rnn_w_ptr": "*bf16", "conf_w_ptr": "*bf16",
            "tokens_ptr": "*i64", "part_arg_ptr": "*i32", "top_k_ptr": "*i64", "keep_key_ptr": "*i64",
            "keep_bits_ptr": "*i64", "filt_ptr": "*i32", "req_row_ptr": "*i64", "req_key_ptr": "*i64",
            "req_bits_ptr": "*i64", "req_res_ptr": "*i32"}
    fp32 = ("gate_h_ptr", "rnn_h_ptr", "state_ptr", "conf_h_ptr", "lat_ptr", "conf_ptr", "temp_ptr", "ws_ptr",
            "part_ptr", "top_p_ptr", "u_ptr", "row_max_ptr", "row_z_ptr", "cand_ptr", "gcand_ptr", "gmass_ptr",
            "tile_max_ptr", "req_t_ptr", "req_max_ptr", "req_z_ptr")
    head.update({n: "*fp32" for n in fp32})
    for kind in (1, 2, 3):
        specs.append(("sequential_head", "_slot_latent_kernel", head,
                      dict(KIND=kind, HAS_CONF=True, BLOCK_M=sh["BLOCK_M"], BLOCK_R=64, BLOCK_C=32),
                      {"num_warps": 8, "num_stages": head_mod.LATENT_STAGES}))
    group = dict(GROUP_TILES=head_mod.GROUP_V // sh["BLOCK_V"], CANDIDATES=sh["CANDIDATES"])
    for kind in range(4):
        for filtered in (False, True):
            specs.append(("sequential_head", "_slot_vocab_kernel", head,
                          dict(KIND=kind, STORE=True, FILTERED=filtered, CANDIDATES=sh["CANDIDATES"],
                               BLOCK_M=sh["BLOCK_M"], BLOCK_V=sh["BLOCK_V"], BLOCK_R=64, W2_BF16=True, BF16_DOT=True),
                          launch(sh)))
    specs.append(("sequential_head", "_slot_draw_kernel", head,
                  dict(SAMPLE=True, FILTERED=True, BLOCK_T=2048, BLOCK_V=sh["BLOCK_V"]), {"num_warps": 4}))
    specs.append(("sequential_head", "_group_candidates_kernel", head,
                  dict(**group, GROUP_CANDIDATES=head_mod.GROUP_CANDIDATES), {"num_warps": 4}))
    specs.append(("sequential_head", "_group_mass_kernel", head,
                  dict(GROUP_CANDIDATES=head_mod.GROUP_CANDIDATES, GROUP_V=head_mod.GROUP_V, BLOCK_V=sh["BLOCK_V"]),
                  {"num_warps": 4}))
    specs.append(("sequential_head", "_filtered_draw_kernel", head,
                  dict(**group, GROUPS_P2=32, BLOCK_V=sh["BLOCK_V"]), {"num_warps": 4}))
    specs.append(("sequential_head", "_normalise_kernel", head,
                  dict(FILTERED=True, BLOCK_M=sh["BLOCK_M"], BLOCK_V=sh["BLOCK_V"]),
                  {"num_warps": 4}))
    surv = {"LOGITS": "*fp32", "CU": "*i64", "TEMPS": "*fp32", "BIASES": "*fp32", "OUT": "*fp32", "A_SORTED": "*fp32",
            "SPS": "*fp64", "THETA": "*fp64", "TAU": "*fp64", "BEST": "*fp64", "RUN_INDEX": "*i32", "RUNS": "*fp64",
            "COUNT": "*i32", "REQ_SORTED": "*i64", "POS_SORTED": "*i64", "LENS": "*i32"}
    specs.append(("survival", "_prefix_survival_kernel", surv, dict(HAS_TEMPS=True, HAS_BIASES=True),
                  launch(sv["prefix"])))
    for name in ("_theta_scan_kernel", "_scatter_lengths_kernel"):
        specs.append(("survival", name, surv, blocks(sv["scan"]), launch(sv["scan"])))
    for step_aware in (False, True):  # Algorithm 1, the step-aware stop
        specs.append(("survival", "_first_drop_kernel", surv, {**blocks(sv["scan"]), "STEP_AWARE": step_aware},
                      {**launch(sv["scan"]), "enable_fp_fusion": False}))
    return specs


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself assembles ``sm_<arch>`` with (its bundled tools)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


# per-SM limits: resident warps, registers, shared memory (bytes; the runtime reserves 1 KB of it per CTA), CTAs
SM_LIMITS = {80: dict(warps=64, regs=65536, smem=167_936, ctas=32),
             90: dict(warps=64, regs=65536, smem=233_472, ctas=32)}


def warps_per_sm(arch: int, regs: int, smem_bytes: int, num_warps: int) -> int:
    """Resident warps per SM of a kernel using ``regs`` registers a thread and ``smem_bytes`` of shared memory with
    ``num_warps`` warps a CTA: whole CTAs under the warp, register (256 a warp at a time) and shared-memory limits."""
    lim = SM_LIMITS[arch]
    warp_regs = -(-regs * 32 // 256) * 256
    ctas = min(lim["warps"] // num_warps, lim["regs"] // warp_regs // num_warps,
               lim["smem"] // (smem_bytes + 1024), lim["ctas"])
    return ctas * num_warps


def async_buffers(ttgir: str) -> int:
    """Depth of the shallowest ring of ``cp.async`` destinations in a compiled kernel (the leading dimension of its
    mutable shared allocations): 2 means every asynchronously copied tile (and page-id slice) has its next copy
    landing while the current one is computed; 0 when the kernel copies nothing asynchronously."""
    if "async_copy_global_to_local" not in ttgir:
        return 0
    rings = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x[^>]*mutable>", ttgir)
    return min(map(int, rings), default=0)


def sass_instructions(cubin: bytes) -> int:
    """Static count of the SASS instructions in a compiled kernel (the ``nvdisasm`` Triton bundles): each instruction
    once, loops not unrolled. For a kernel whose programs handle one tile without a loop it is what every warp
    issues, so it sets the issue time beside the bytes (an SM issues about 4 warp instructions a clock)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M))


def compile_kernel(module: str, name: str, types: dict, consts: dict, options: dict, arch: int) -> dict:
    """Compile one kernel for ``sm_<arch>``; its PTX through ``ptxas -v``: ``{"regs", "spill_bytes", "smem_bytes",
    "async_buffers", "warps_per_sm", "sass_instructions"}``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module("dspark_kernels.ops." + module), name)
    names = kernel.arg_names
    values = {n: INT_VALUES.get(n, ATTENTION_STRIDE if n.startswith("stride_") else None) for n in names}
    consts = {**consts, **{n: 1 for n, v in values.items() if v == 1 and n not in consts}}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts
             and (sig[n].startswith("*") or (values[n] is not None and values[n] % 16 == 0))}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([_ptxas(arch), "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    usage = {"regs": int(regs.group(1)) if regs else None,
             "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None,
             "smem_bytes": int(compiled.metadata.shared), "async_buffers": async_buffers(compiled.asm["ttgir"])}
    usage["warps_per_sm"] = warps_per_sm(arch, usage["regs"], usage["smem_bytes"], compiled.metadata.num_warps)
    usage["sass_instructions"] = sass_instructions(compiled.asm["cubin"])
    return usage


def report(archs=ARCHS) -> list[dict]:
    rows = []
    for module, name, types, consts, options in _specs():
        for arch in archs:
            usage = compile_kernel(module, name, types, consts, options, arch)
            config = {k: v for k, v in {**consts, **options}.items() if k.isupper() or k.startswith("num_")}
            rows.append({"kernel": f"{module}.{name}", "arch": f"sm_{arch}", "config": config, **usage})
            print(f"{module}.{name:32s} sm_{arch} regs {usage['regs']:4} spill {usage['spill_bytes']:5} "
                  f"smem {usage['smem_bytes']:6} buffers {usage['async_buffers']} warps/SM {usage['warps_per_sm']:2} "
                  f"SASS {usage['sass_instructions']:5}  {config}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--archs", type=int, nargs="+", default=list(ARCHS), help="compute capabilities (80 90)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    rows = report(args.archs)
    if args.json is not None:
        from perf.roofline import device_info

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "kernel_resources", "device": device_info(), "rows": rows},
                                        indent=1) + "\n")
    spilled = [f"{r['kernel']} {r['arch']}" for r in rows if r["spill_bytes"]]
    print(f"{len(rows)} compiles, {len(spilled)} with spills{': ' + ', '.join(spilled) if spilled else ''}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# One-command GPU check for a lent machine with only PyTorch and Triton installed. Run from anywhere:
#   bash perf/gpu_check.sh            # results in ./gpu_results/ (or $GPU_RESULTS/ when set)
# When OUT is set (the device tool's output folder, which returns at most 8 files), the results are also packed into
# $OUT/gpu_results.tgz, with summary.txt beside it.
# Step timeouts sum to 495 s (+5 s kill grace each: 535 s if every step timed out), so the check ends within 9 minutes.
# Steps (each with its own timeout; a failing step is recorded and the next one runs), ~8 minutes in all:
#   env (nvidia-smi, versions) -> kernel tests on the GPU, interpreter off (junit xml) -> perf suite (benchmark json)
#   -> perf table + plot (perf/report.py) -> autotuner (configs into the output folder, copied to autotune/configs/) -> SPS profile of the shipped target
#   and round profile of the shipped DSpark drafter (output folder and autotune/sps/) -> the real target end to end
#   (SmolLM2-135M-Instruct, bf16 GEMMs on the GPU: the demo's AR vs DSpark vs DFlash tokens/s and tau, when its GGUF is
#   in the model cache: the lent machine cannot fetch it) -> summary.txt
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${GPU_RESULTS:-gpu_results}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
unset TRITON_INTERPRET DSPARK_IMPL
# The package as the install would map it (autotune/ and reference/ are its subpackages), without pip: a folder of
# links first on the path, so every step imports this checkout whatever is installed
PKG_DIR=$(mktemp -d)
mkdir -p "$PKG_DIR/dspark_kernels"
for f in "$REPO"/dspark_kernels/*; do ln -s "$f" "$PKG_DIR/dspark_kernels/"; done
ln -s "$REPO/autotune" "$PKG_DIR/dspark_kernels/autotune"
ln -s "$REPO/reference" "$PKG_DIR/dspark_kernels/reference"
export PYTHONPATH="$PKG_DIR:$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-}
if [ -z "$PY" ]; then  # the first interpreter that has torch (python3 on the lent machines)
    for cand in python3 python; do
        if command -v "$cand" >/dev/null && "$cand" -c "import torch" 2>/dev/null; then PY=$cand; break; fi
    done
    PY=${PY:-python3}
fi
SUMMARY="$OUT_DIR/summary.txt"
: > "$OUT_DIR/steps.tsv"
START=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD...: run with a timeout, log to NAME.log, record status and seconds
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "== $name (timeout ${limit}s)"
    timeout --kill-after=5 "$limit" bash -c '"$@"' _ "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    local status=ok
    [ "$rc" -ne 0 ] && status="FAILED rc=$rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMEOUT (${limit}s)"
    printf '%s\t%s\t%ss\n' "$name" "$status" "$dt" >> "$OUT_DIR/steps.tsv"
    echo "   $status in ${dt}s (log: $OUT_DIR/$name.log)"
    tail -n 3 "$OUT_DIR/$name.log" | sed 's/^/   | /'
}

install_pkg() {  # test extras only when missing, tolerating no network (the package itself comes from PKG_DIR)
    for mod_pkg in pytest:pytest pytest_benchmark:pytest-benchmark scipy:scipy hypothesis:hypothesis \
                   pynvml:nvidia-ml-py safetensors:safetensors tokenizers:tokenizers tqdm:tqdm numpy:numpy \
                   transformers:transformers matplotlib:matplotlib; do
        mod=${mod_pkg%%:*}; pkg=${mod_pkg#*:}
        $PY -c "import $mod" 2>/dev/null || timeout 15 $PY -m pip install --retries 0 --timeout 5 "$pkg" || echo "could not install $pkg"
    done
    # autotune/ and reference/ are subpackages only through the install's package mapping: check them explicitly
    $PY -c "import dspark_kernels.autotune, dspark_kernels.reference, pytest; print('import ok')"
}

envinfo() {
    nvidia-smi || echo "nvidia-smi not available"
    $PY - <<'PYEOF'
import platform, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| triton", triton.__version__)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PYEOF
    git -C "$REPO" log -1 --oneline 2>/dev/null || true
}

tune() {
    $PY -m dspark_kernels.autotune --out-dir "$OUT_DIR/autotune_configs"
    local rc=$?
    mkdir -p autotune/configs
    cp -v "$OUT_DIR"/autotune_configs/*.json autotune/configs/ 2>/dev/null || true
    return $rc
}

real_target() {  # the demo on SmolLM2 when its GGUF is cached
    if ! $PY -c "from dspark_kernels.models.registry import resolve_model as r; print(r('smollm2-135m-instruct', fetch=False))"; then
        echo "SmolLM2-135M-Instruct is not in the model cache (\$DSPARK_CACHE): real-target step skipped"
        return 0
    fi
    $PY -m dspark_kernels.demo --gemm-dtype bfloat16 --drafter-gemm-dtype bfloat16 --max-new-tokens 48 \
        --repeats 1 --draft-length fixed --json "$OUT_DIR/demo_smollm2.json"
}

export -f envinfo install_pkg tune real_target
export PY OUT_DIR REPO
step env 15 envinfo
step install 30 install_pkg
# every kernel on the GPU against its CPU reference (the per-op files run the kernels under the CPU interpreter only)
step kernel_tests 130 $PY -m pytest -q -p no:cacheprovider tests/test_gpu_parity.py \
    tests/test_batch_invariant_attention.py --junitxml "$OUT_DIR/kernel_tests.xml"
step perf 90 $PY -m pytest -q -p no:cacheprovider perf --benchmark-only --benchmark-max-time=0.2 \
    --benchmark-min-rounds=3 --benchmark-json "$OUT_DIR/perf.json"
step perf_report 10 $PY perf/report.py "$OUT_DIR/perf.json" --drop-samples
step autotune 120 tune
step sps 45 $PY -m dspark_kernels.engine.sps --max-batch 256 --warmup 2 --repeats 5 \
    --drafter dspark_kernels/assets/drafters/dspark --max-requests 32 --out-dir "$OUT_DIR/sps" --out-dir autotune/sps
step real_target 55 real_target

{
    echo "dspark-kernels GPU check  $(date -u +%Y-%m-%dT%H:%M:%SZ)  total $(( $(date +%s) - START ))s"
    echo "commit: $(git -C "$REPO" log -1 --oneline 2>/dev/null || echo unknown)"
    grep -m1 '^device:' "$OUT_DIR/env.log" || echo "device: (none)"
    grep -m1 '^python' "$OUT_DIR/env.log" || true
    echo
    echo "step            status                  time"
    awk -F'\t' '{printf "%-15s %-23s %s\n", $1, $2, $3}' "$OUT_DIR/steps.tsv"
    echo
    echo "kernel tests: $(grep -E '(passed|failed|error)' "$OUT_DIR/kernel_tests.log" | tail -n 1)"
    echo "perf:         $(grep -E '(passed|failed|error|skipped)' "$OUT_DIR/perf.log" | tail -n 1)"
    echo "autotune:     $(grep -E 'wrote|no candidate' "$OUT_DIR/autotune.log" | tr '\n' ' ')"
    echo "sps:          $(grep -E 'wrote' "$OUT_DIR/sps.log" | tr '\n' ' ')"
    echo "real target:  $(grep -E '^all ' "$OUT_DIR/real_target.log" | tr -s ' ' | tr '\n' ';')"
    echo
    echo "files:"
    (cd "$OUT_DIR" && find . -type f | sort | sed 's/^\.\//  /')
} > "$SUMMARY"
cat "$SUMMARY"
if [ -n "${OUT:-}" ]; then  # the device tool returns at most 8 files: one archive and the summary
    mkdir -p "$OUT"
    tar czf "$OUT/gpu_results.tgz" -C "$OUT_DIR" . && cp "$SUMMARY" "$OUT/summary.txt"
fi
grep -qv $'\tok\t' "$OUT_DIR/steps.tsv" && exit 1
exit 0

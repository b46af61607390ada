"""Autotune: the launch-config store, the tuner's candidate selection, its CLI without a GPU, the GPU check script."""

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_kernels.autotune import store
from dspark_kernels.autotune.tune import Trial, evaluate, forced_config, grid, main, merge_store, pick

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = {"BLOCK_M": 16, "num_warps": 4}
CUDA = torch.device("cuda", 0)  # constructing the device needs no GPU; launch_config only reads its type/index


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(store, "device_name", lambda index=0: "Fake GPU 9000")
    return "Fake GPU 9000"


def _write(dirpath: Path, gpu: str, ops: dict) -> Path:
    path = store.config_path(gpu, dirpath)
    path.write_text(json.dumps({"gpu": gpu, "driver": "1.0", "ops": ops}))
    return path


def test_store_round_trip(tmp_path, fake_gpu):
    data = merge_store(None, fake_gpu, "555.1", {"op": {"decode": {"BLOCK_M": 32}, "default": {"num_warps": 8}}})
    path = store.config_path(fake_gpu, tmp_path)
    assert path.name == "Fake_GPU_9000.json"
    path.write_text(json.dumps(data))
    assert store.load_store(path) == data
    assert store.launch_config("op", DEFAULTS, CUDA, "decode", tmp_path) == {"BLOCK_M": 32, "num_warps": 8}
    assert store.launch_config("op", DEFAULTS, CUDA, "prefill", tmp_path) == {"BLOCK_M": 16, "num_warps": 8}
    assert store.launch_config("other", DEFAULTS, CUDA, "decode", tmp_path) == DEFAULTS


def test_unknown_gpu_and_cpu_get_defaults(tmp_path, fake_gpu):
    _write(tmp_path, "Some Other GPU", {"op": {"default": {"BLOCK_M": 64}}})
    assert store.launch_config("op", DEFAULTS, CUDA, config_dir=tmp_path) == DEFAULTS
    _write(tmp_path, fake_gpu, {"op": {"default": {"BLOCK_M": 64}}})
    assert store.launch_config("op", DEFAULTS, torch.device("cpu"), config_dir=tmp_path) == DEFAULTS


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        ('{"gpu": "x"}', "'ops' object"),
        ('{"ops": {"op": [1]}}', "ops.op must map"),
        ('{"ops": {"op": {"default": {"BLOCK_M": 0}}}}', "positive integers"),
        ('{"ops": {"op": {"default": {"BLOCK_M": 16.0}}}}', "positive integers"),
        ('{"ops": {"op": {"default": {"num_warps": true}}}}', "positive integers"),
    ],
)
def test_malformed_store_rejected(tmp_path, fake_gpu, text, match):
    path = store.config_path(fake_gpu, tmp_path)
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        store.launch_config("op", DEFAULTS, CUDA, config_dir=tmp_path)
    assert str(path) in str(info.value)


def test_merge_store_keeps_other_ops_and_validates():
    old = {"gpu": "G", "driver": "1", "ops": {"a": {"default": {"X": 1}}, "b": {"decode": {"X": 2}}}}
    new = merge_store(old, "G", "2", {"b": {"prefill": {"X": 3}}})
    assert new == {"gpu": "G", "driver": "2",
                   "ops": {"a": {"default": {"X": 1}}, "b": {"decode": {"X": 2}, "prefill": {"X": 3}}}}
    with pytest.raises(ValueError, match="positive integers"):
        merge_store(None, "G", "2", {"b": {"default": {"X": -1}}})


def test_grid_starts_with_defaults_and_dedups():
    cands = grid({"A": 1, "B": 2}, A=(1, 4), B=(2,))
    assert cands == [{"A": 1, "B": 2}, {"A": 4, "B": 2}]


def test_evaluate_rejects_mismatch_and_errors_and_picks_fastest():
    outputs = {1: 10, 2: 11, 3: 10, 4: 10}  # candidate 2 computes the wrong answer; 5 does not compile
    times = {1: 3.0, 2: 0.1, 3: 1.0, 4: 2.0}  # the wrong candidate would be the fastest if it were timed
    timed = []

    def run(cfg):
        if cfg["K"] == 5:
            raise RuntimeError("out of resources: shared memory\nmore lines")
        timed.append(cfg["K"])
        return outputs[cfg["K"]]

    def bench(fn):
        fn()
        return times[timed[-1]]

    trials = evaluate([{"K": k} for k in (1, 2, 3, 4, 5)], run, lambda out: None if out == 10 else f"got {out}",
                      bench)
    assert {t.config["K"]: t.status for t in trials} == {1: "ok", 2: "mismatch", 3: "ok", 4: "ok", 5: "error"}
    assert "got 11" in trials[1].detail and trials[1].ms is None
    assert trials[4].detail == "RuntimeError: out of resources: shared memory"
    assert pick(trials).config == {"K": 3} and pick(trials).ms == 1.0


def test_pick_none_when_nothing_passes_and_first_on_tie():
    assert pick([Trial({"K": 1}, "error"), Trial({"K": 2}, "mismatch")]) is None
    assert pick([Trial({"K": 1}, "ok", 1.0), Trial({"K": 2}, "ok", 1.0)]).config == {"K": 1}


def test_pick_keeps_the_default_unless_another_is_clearly_faster():
    """The grid lists the defaults first: a rival inside the 3% timing noise does not replace them."""
    default = Trial({"K": 1}, "ok", 1.0)
    assert pick([default, Trial({"K": 2}, "ok", 0.98)]) is default
    assert pick([default, Trial({"K": 2}, "ok", 0.9)]).config == {"K": 2}
    assert pick([Trial({"K": 1}, "mismatch"), Trial({"K": 2}, "ok", 1.0), Trial({"K": 3}, "ok", 0.99)]).config == {
        "K": 2}  # the first verified candidate stands in for a default that failed


def test_check_exceptions_count_as_mismatch():
    trials = evaluate([{"K": 1}], lambda cfg: None, lambda out: 1 / 0, lambda fn: 1.0)
    assert trials[0].status == "mismatch" and "ZeroDivisionError" in trials[0].detail


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs the Triton interpreter")
def test_forced_configs_on_a_real_kernel():
    """verify_attention through the tuner's path: valid configs match the reference, a bad block size is an error."""
    from dspark_kernels.ops import verify_attention
    from tests.test_verify_attention import make_paged_batch

    args = make_paged_batch([3, 2], [20, 9], 4, 2, 16, 8)
    ref = verify_attention(*args, impl="torch")
    seen = []
    original = sys.modules["dspark_kernels.ops.verify_attention"].launch_config

    def run(cfg):
        with forced_config("dspark_kernels.ops.verify_attention", cfg):
            seen.append(sys.modules["dspark_kernels.ops.verify_attention"].launch_config("verify_attention", {}, CUDA))
            return verify_attention(*args, impl="triton")

    def check(out):
        return None if torch.allclose(out, ref, atol=1e-4, rtol=1e-4) else "mismatch"

    cands = [{"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 24}]  # 24: not a power of two
    trials = evaluate(cands, run, check, lambda fn: 1.0)
    assert [t.status for t in trials] == ["ok", "error"]
    assert seen[0] == cands[0]
    assert sys.modules["dspark_kernels.ops.verify_attention"].launch_config is original


@pytest.mark.parametrize("bucket", ["prefix", "scan"])
def test_survival_buckets_through_the_tuner(bucket):
    """The survival op's two tunable buckets: every candidate of the sweep, forced onto the launchers (interpreted
    here), gives the reference's output; the forced config is what the launchers read."""
    from dspark_kernels.autotune.tune import _survival_case
    from dspark_kernels.ops.survival import _DEFAULTS

    extra = {"prefix": dict(num_warps=(1, 2)), "scan": dict(BLOCK=(512, 1024), num_warps=(4,))}[bucket]
    case = _survival_case(grid(_DEFAULTS[bucket], **extra), torch.device("cpu"), bucket, r=8, gamma=5)
    run, ref, check = case.make()

    def run_cfg(cfg):
        with forced_config(case.module, cfg):
            return run()

    trials = evaluate(case.candidates, run_cfg, lambda out: check(out, ref), lambda fn: 1.0)
    assert len(trials) >= 2 and all(t.status == "ok" for t in trials), trials


def test_cli_without_gpu_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "dspark_kernels.autotune", "--quick", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_unknown_op():
    proc = subprocess.run([sys.executable, "-m", "dspark_kernels.autotune", "--ops", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown op" in proc.stderr


@pytest.mark.parametrize("ops", ["", " , "])
def test_cli_rejects_an_empty_op_list(ops, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--ops", ops])
    assert exc.value.code == 2 and "--ops names no op" in capsys.readouterr().err


def test_gpu_check_script_syntax():
    script = REPO / "perf" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for needle in ("TRITON_INTERPRET", "--junitxml", "--benchmark-json", "dspark_kernels.autotune",
                   "dspark_kernels.engine.sps", "summary.txt", "autotune/configs", "autotune/sps"):
        assert needle in text
    # within 9 minutes even if every step runs into its timeout (+5 s kill grace each), inside a lent machine's 10
    limits = [int(m) for m in re.findall(r"^step \S+ (\d+) ", text, flags=re.M)]
    assert len(limits) == 8 and sum(limits) + 5 * len(limits) < 540


def test_sps_cli(tmp_path):
    """The SPS profile CLI: exit 2 without a GPU by default; a CPU smoke run writes a loadable profile, keyed by the
    CPU and its thread count as the serving bench keys its CPU profiles."""
    from dspark_kernels.engine.sps import profile_path, read_profile

    cpu = f"cpu-{platform.machine()}-1t"

    cmd = [sys.executable, "-m", "dspark_kernels.engine.sps", "--out-dir", str(tmp_path)]
    if not torch.cuda.is_available():
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd + ["--device", "cpu", "--max-batch", "5", "--context", "16", "--warmup", "0",
                                 "--repeats", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr  # importing the engine package does not import the CLI's module
    prof = read_profile(profile_path(cpu, "dspark-target", tmp_path))
    assert prof.batch_sizes == (1, 2, 3, 4, 5) and prof.source == "measured"
    drafter = REPO / "dspark_kernels" / "assets" / "drafters" / "dspark"
    proc = subprocess.run(cmd + ["--device", "cpu", "--max-batch", "2", "--context", "16", "--warmup", "1",
                                 "--repeats", "1", "--drafter", str(drafter), "--max-requests", "3"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    for tag, slots in (("", 7), ("-w1", 1)):
        rounds = read_profile(profile_path(cpu, f"dspark-target+dspark-rounds{tag}", tmp_path))
        assert rounds.batch_sizes == (1, 2, 3) and f"draft rounds/s at {slots} slot(s)" in proc.stdout
    proc = subprocess.run(cmd + ["--device", "cpu", "--warmup", "0", "--drafter", str(drafter)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "--warmup must be >= 1" in proc.stderr
    # bad values are usage errors before anything is measured or written
    out = tmp_path / "bad"
    for extra, message in [(["--device", "foo"], "--device must name a torch device"),
                           (["--context", "5000"], "exceeds the target's max_position_embeddings (4096)"),
                           (["--drafter", str(tmp_path / "nowhere")], "drafter checkpoint file missing"),
                           (["--drafter", str(drafter), "--gamma", "17"], "gamma must be <= 16")]:
        proc = subprocess.run([sys.executable, "-m", "dspark_kernels.engine.sps", "--out-dir", str(out), "--device",
                               "cpu", "--max-batch", "2", "--context", "16", *extra], capture_output=True, text=True,
                              timeout=120, env=env)
        assert proc.returncode != 0 and message in proc.stderr, (extra, proc.stderr[-500:])
    assert not out.exists()


def test_main_writes_the_store_after_every_bucket(tmp_path, monkeypatch, capsys):
    """With a GPU (faked here), each tuned bucket is merged into ``<gpu>.json`` as soon as it is done, so a run cut
    short by its time limit keeps what it tuned; a malformed existing file is refused before any tuning."""
    import dspark_kernels.autotune.tune as tune

    cases = [tune.Case("verify_attention", b, "dspark_kernels.ops.verify_attention", [{"BLOCK_M": 16}], make=None)
             for b in ("decode", "verify", "prefill")]
    written = []

    def fake_tune(case, quick):
        if case.bucket == "prefill":
            raise KeyboardInterrupt  # the time limit strikes during the third bucket
        path = tmp_path / "Fake_GPU.json"
        written.append(sorted(json.loads(path.read_text())["ops"].get("verify_attention", {})) if path.exists()
                       else [])
        case.trials = [Trial({"BLOCK_M": 16}, "ok", 1.0)]

    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune, "gpu_identity", lambda: ("Fake GPU", "1.0"))
    monkeypatch.setattr(tune, "build_cases", lambda dev, quick: cases)
    monkeypatch.setattr(tune, "tune_case", fake_tune)
    monkeypatch.setattr(tune, "config_path", lambda gpu, out_dir: tmp_path / "Fake_GPU.json")
    with pytest.raises(KeyboardInterrupt):
        tune.main(["--ops", "verify_attention"])
    assert written == [[], ["decode"]]  # the first bucket was on disk before the second was tuned
    stored = json.loads((tmp_path / "Fake_GPU.json").read_text())
    assert stored["gpu"] == "Fake GPU" and sorted(stored["ops"]["verify_attention"]) == ["decode", "verify"]
    (tmp_path / "Fake_GPU.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        tune.main(["--ops", "verify_attention"])

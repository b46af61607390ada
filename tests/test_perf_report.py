"""perf/report.py: a pytest-benchmark JSON becomes a markdown table and a plot (CPU and GPU-shaped records)."""

import json

import pytest

from perf import report


def _bench(name, median, gpu=False):
    info = {"impl": "triton" if gpu else "torch", "shapes": {"R": 4, "V": 8192}, "bytes": 2e6, "flops": 5e6,
            "device": {"gpu": "NVIDIA H200"} if gpu else {"cpu": "x86_64"}}
    if gpu:
        info.update({"achieved_GBps": 2e6 / median / 1e9, "achieved_TFLOPs": 5e6 / median / 1e12,
                     "pct_peak_bw": 41.7, "pct_peak_flops": 0.5})
    return {"name": name, "group": None, "extra_info": info, "stats": {"median": median}}


@pytest.mark.parametrize("gpu", [False, True])
def test_report_writes_table_and_plot(tmp_path, gpu):
    src = tmp_path / "perf.json"
    src.write_text(json.dumps({"benchmarks": [_bench("test_a[R4]", 1e-3, gpu), _bench("test_b[R8]", 2e-5, gpu)]}))
    report.main([str(src)])
    md = (tmp_path / "perf.md").read_text()
    assert "| test_a[R4] | " in md and "| 1.000 |" in md and "| 0.020 |" in md
    assert ("| 41.7 |" in md) == gpu
    assert (tmp_path / "perf.png").stat().st_size > 1000


def test_report_rejects_empty(tmp_path):
    src = tmp_path / "perf.json"
    src.write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(SystemExit, match="no benchmarks"):
        report.main([str(src)])


def test_drop_samples_strips_raw_timings_only(tmp_path):
    src = tmp_path / "perf.json"
    bench = _bench("test_a[R4]", 1e-3)
    bench["stats"].update(data=[1e-3] * 1000, mean=1.1e-3)
    src.write_text(json.dumps({"machine_info": {"cpu": "x"}, "benchmarks": [bench]}))
    report.main([str(src), "--drop-samples"])
    kept = json.loads(src.read_text())
    assert kept["machine_info"] == {"cpu": "x"}
    assert kept["benchmarks"][0]["stats"] == {"median": 1e-3, "mean": 1.1e-3}
    assert "| test_a[R4] | " in (tmp_path / "perf.md").read_text()

"""Turn a perf-suite JSON into a README table and a plot.

    pytest perf --benchmark-only --benchmark-json results/perf_cpu.json
    python perf/report.py results/perf_cpu.json            # writes results/perf_cpu.md and results/perf_cpu.png
    python perf/report.py results/perf_cpu.json --drop-samples   # also strips the raw per-round timings

``--drop-samples`` rewrites the JSON without pytest-benchmark's raw timings (``stats.data``: up to tens of thousands
of numbers per fast benchmark, 15 MB for the CPU suite); every summary statistic stays, and the table and plot need
only those. Use it before committing a run.

The table has one row per benchmark: op, implementation, shapes, median time, the op's bytes and FLOPs (from
``extra_info``, see ``perf/roofline.py``) and, for GPU runs, achieved GB/s, TFLOP/s and % of the device's roofline.
The plot shows each benchmark's median time (log scale) and, on a GPU, the % of peak bandwidth next to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _device_of(device: dict) -> str:
    """Where a benchmark ran: ``ran_on`` (in newer records), else the GPU or the CPU of the machine."""
    return device.get("ran_on") or device.get("gpu") or device.get("cpu", "")


def rows(data: dict) -> list[dict]:
    """One flat dict per benchmark of a pytest-benchmark JSON."""
    out = []
    for b in data.get("benchmarks", []):
        info = b.get("extra_info", {})
        out.append({
            "name": b["name"],
            "group": b.get("group") or b["name"].split("[")[0],
            "impl": info.get("impl", ""),
            "shapes": ", ".join(f"{k}={v}" for k, v in info.get("shapes", {}).items()),
            "median_ms": b["stats"]["median"] * 1e3,
            "bytes": info.get("bytes"),
            "flops": info.get("flops"),
            "gbps": info.get("achieved_GBps"),
            "tflops": info.get("achieved_TFLOPs"),
            "pct_bw": info.get("pct_peak_bw"),
            "pct_flops": info.get("pct_peak_flops"),
            "device": _device_of(info.get("device", {})),
        })
    return out


def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def markdown(table: list[dict]) -> str:
    devices = sorted({r["device"] for r in table if r["device"]})
    lines = [f"Device: {', '.join(devices) or 'unknown'}", "",
             "| benchmark | impl | shapes | median ms | MB moved | MFLOP | GB/s | TFLOP/s | % peak BW | % peak FLOPs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        mb = None if r["bytes"] is None else r["bytes"] / 1e6
        mflop = None if r["flops"] is None else r["flops"] / 1e6
        lines.append(f"| {r['name']} | {r['impl']} | {r['shapes']} | {r['median_ms']:.3f} | {_num(mb, '.2f')} | "
                     f"{_num(mflop, '.1f')} | {_num(r['gbps'], '.1f')} | {_num(r['tflops'], '.2f')} | "
                     f"{_num(r['pct_bw'], '.1f')} | {_num(r['pct_flops'], '.1f')} |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on_gpu = any(r["pct_bw"] is not None for r in table)
    fig, axes = plt.subplots(1, 2 if on_gpu else 1, figsize=(13 if on_gpu else 8, 0.32 * len(table) + 1.5),
                             squeeze=False)
    names = [r["name"] for r in table]
    axes[0][0].barh(names, [r["median_ms"] for r in table], color="tab:blue")
    axes[0][0].set_xscale("log")
    axes[0][0].set_xlabel("median time (ms, log)")
    axes[0][0].invert_yaxis()
    if on_gpu:
        axes[0][1].barh(names, [r["pct_bw"] or 0 for r in table], color="tab:orange")
        axes[0][1].set_xlabel("% of peak memory bandwidth")
        axes[0][1].invert_yaxis()
        axes[0][1].set_yticklabels([])
    fig.suptitle("dspark-kernels perf suite: " + ", ".join(sorted({r["device"] for r in table if r["device"]})))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", type=Path, help="pytest-benchmark JSON (--benchmark-json)")
    p.add_argument("--out", type=Path, default=None, help="output stem (default: next to the JSON)")
    p.add_argument("--drop-samples", action="store_true",
                   help="rewrite the JSON without the raw per-round timings (stats.data); summaries stay")
    args = p.parse_args(argv)
    data = json.loads(args.json.read_text())
    table = rows(data)
    if not table:
        raise SystemExit(f"{args.json}: no benchmarks in the file (was it run with --benchmark-only?)")
    if args.drop_samples:
        for bench in data["benchmarks"]:
            bench.get("stats", {}).pop("data", None)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    stem = args.out or args.json.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.md").write_text(markdown(table))
    plot(table, Path(f"{stem}.png"))
    print(f"wrote {stem}.md and {stem}.png ({len(table)} benchmarks)")


if __name__ == "__main__":
    main()

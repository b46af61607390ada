"""``python -m dspark_kernels.demo`` on one short prompt: the JSON it promises, and exact greedy text per setting."""

import json

import pytest

from dspark_kernels import demo


@pytest.mark.parametrize("gemm_dtype", ["float32", "bfloat16"])
def test_demo_short_run_writes_json_and_matches_ar(tmp_path, gemm_dtype):
    out = tmp_path / "demo.json"
    demo.main(["--prompt", "def add(a, b):\n", "--max-new-tokens", "12", "--gemm-dtype", gemm_dtype,
               "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["settings"]["gemm_dtype"] == gemm_dtype
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"ar", "dspark", "dflash"}
    for name in ("dspark", "dflash"):
        assert runs[name]["identical_to_ar"] is True and runs[name]["new_tokens"] == runs["ar"]["new_tokens"]
        assert 1.0 <= runs[name]["tau"] <= 8.0 and runs[name]["tokens_per_s"] > 0
    assert {r["domain"] for r in data["by_domain"]} == {"custom"}

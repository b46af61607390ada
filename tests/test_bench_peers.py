"""``python -m dspark_kernels.bench peers``: transformers' generate / assisted / prompt-lookup vs our AR and DSpark.

A tiny run (code prompts, 6 new tokens) checks the JSON contract and that greedy decoding agrees across the
implementations: transformers' plain generate and our speculative decode must both reproduce our AR tokens.
"""

import argparse
import json
import time

import pytest

from dspark_kernels.bench import ASSETS, peers


@pytest.mark.parametrize("draft_length", ["adaptive", "fixed"])
def test_peers_tiny_run(tmp_path, draft_length):
    out = tmp_path / "peers.json"
    args = argparse.Namespace(model=ASSETS / "target", assistant=ASSETS / "assistant", drafter_dir=ASSETS / "drafters",
                              drafters=["dspark"], domains=["code"], max_new_tokens=6, gamma=4,
                              draft_length=draft_length, prompt_lookup_tokens=3, impl=None, gemm_dtype="float32",
                              drafter_gemm_dtype="bfloat16", repeats=2, draft_vocab=None, json=out)
    peers.main(args)
    result = json.loads(out.read_text())
    assert result["settings"]["draft_length"] == draft_length and result["settings"]["draft_vocab"] is None
    assert result["settings"]["gemm_dtype"] == "float32" and result["settings"]["drafter_gemm_dtype"] == "bfloat16"
    assert set(result["settings"]["round_costs"]) == ({"dspark"} if draft_length == "adaptive" else set())
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"hf_generate", "hf_assisted", "hf_prompt_lookup", "ar", "dspark"}
    for r in runs.values():
        assert set(r) >= {"method", "tokens_per_s", "new_tokens", "identical_to_ar"}
        assert r["tokens_per_s"] > 0 and r["new_tokens"] == runs["ar"]["new_tokens"]
    assert runs["dspark"]["identical_to_ar"] and runs["hf_generate"]["identical_to_ar"]
    assert result["best_transformers"].startswith("hf_")
    assert out.with_suffix(".md").read_text().count("\n") == 2 + len(runs)


def test_each_method_is_timed_by_its_fastest_decode_of_each_prompt():
    calls = {"slow_first": 0}

    def slow_first(ids, n):  # the first decode of each prompt is slow, later ones fast
        calls["slow_first"] += 1
        if calls["slow_first"] <= 2:
            time.sleep(0.05)
        return ids[:n]

    outputs, seconds = peers.time_methods({"m": slow_first, "fast": lambda ids, n: ids[:n]}, [[1, 2, 3], [4, 5]], 2, 3)
    assert calls["slow_first"] == 6 and outputs["m"] == [[1, 2], [4, 5]] == outputs["fast"]
    assert seconds["m"] < 0.05  # neither slow decode counts


def test_bad_repeats_and_gamma_are_clear_errors():
    args = argparse.Namespace(max_new_tokens=4, repeats=0)
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        peers.main(args)
    args = argparse.Namespace(max_new_tokens=4, repeats=1, gamma=1, draft_length="adaptive")
    with pytest.raises(ValueError, match="--gamma must be in"):
        peers.main(args)


@pytest.mark.parametrize("argv, message", [
    (["ceiling", "--paths", "0"], "argument --paths: must be an int >= 1"),
    (["peers", "--repeats", "0"], "argument --repeats: must be an int >= 1"),
    (["serving", "--repeats", "0"], "argument --repeats: must be an int >= 1"),
    (["serving", "--requests-per-level", "0"], "argument --requests-per-level: must be an int >= 1"),
    (["serving", "--length-range", "1"], "argument --length-range: must be in [0, 1)"),
    (["serving", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["serving", "--concurrency", "4", "0"], "argument --concurrency: must be an int >= 1"),
])
def test_bench_counts_are_usage_errors(argv, message, monkeypatch, capsys):
    """The benches' counts and ranges are argparse types: a bad one ends the command before any work, status 2."""
    from dspark_kernels.bench.__main__ import main

    monkeypatch.setattr("sys.argv", ["bench", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serving", "--policies", "bogus"], "--policies ['bogus']: choose from"),
    (["serving", "--gamma", "100"], "--gamma must be in 1..16"),
    (["serving", "--concurrency", "4", "100000"], "--concurrency must be in 1..1024"),
    (["serving", "--profile", "CORRUPT"], "--profile"),
    (["serving", "--corpus", "data/corpsu"], "--corpus data/corpsu holds no corpus"),
    (["serving", "--prompts", "data/promtps"], "--prompts data/promtps is no prompt set"),
    (["serving", "--draft-vocab", "-1"], "--draft-vocab must be >= 0"),
    (["serving", "--drafter", "nowhere"], "--drafter nowhere: no drafter there"),
    (["ceiling", "--corpus", "data/corpsu"], "--corpus data/corpsu holds no corpus"),
    (["acceptance", "--corpus", "data/corpsu"], "--corpus data/corpsu holds no corpus"),
])
def test_bench_values_that_would_fail_later_are_usage_errors(argv, message, monkeypatch, capsys, tmp_path):
    """Values that pass argparse but would fail (or silently build a corpus at a mistyped path) stop the command
    before any model loads, status 2, naming the option."""
    from dspark_kernels.bench.__main__ import main

    corrupt = tmp_path / "profile.json"
    corrupt.write_text("{not json")
    argv = [str(corrupt) if a == "CORRUPT" else a for a in argv]
    monkeypatch.chdir(tmp_path)  # a relative mistyped corpus path resolves here, where nothing exists
    monkeypatch.setattr("sys.argv", ["bench", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # no corpus was built at the mistyped path

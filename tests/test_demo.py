"""``python -m dspark_kernels.demo`` on one short prompt: the JSON it promises, and exact greedy text per setting.

Most runs use the small shipped target (``--model dspark-target``, fast); one runs the default, SmolLM2-135M-Instruct
with the drafters shipped for it."""

import json

import pytest

from dspark_kernels import demo

SMALL = ["--model", "dspark-target"]


@pytest.mark.parametrize("gemm_dtype,drafter_gemm_dtype,draft_length,invariant", [
    ("float32", "float32", "adaptive", False),
    ("bfloat16", "float32", "adaptive", False),
    ("bfloat16", "bfloat16", "fixed", False),
    ("bfloat16", "float32", "adaptive", True)])
def test_demo_short_run_writes_json_and_matches_ar(tmp_path, gemm_dtype, drafter_gemm_dtype, draft_length, invariant):
    out = tmp_path / "demo.json"
    demo.main([*SMALL, "--prompt", "def add(a, b):\n", "--max-new-tokens", "12", "--gemm-dtype", gemm_dtype,
               "--drafter-gemm-dtype", drafter_gemm_dtype, "--draft-length", draft_length, "--json", str(out)]
              + (["--batch-invariant"] if invariant else []))
    data = json.loads(out.read_text())
    settings = data["settings"]
    assert settings["gemm_dtype"] == gemm_dtype and settings["draft_length"] == draft_length
    assert settings["drafter_gemm_dtype"] == drafter_gemm_dtype
    assert settings["batch_invariant"] is invariant
    assert settings["gamma"] == (15 if draft_length == "adaptive" else 7)
    if draft_length == "adaptive":  # measured at start, per drafter
        assert set(settings["round_costs"]) == {"dspark", "dflash"}
        assert all(c["fixed"] >= 0 and c["per_token"] >= 0 for c in settings["round_costs"].values())
    else:
        assert settings["round_costs"] == {}
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"ar", "dspark", "dflash"}
    for name in ("dspark", "dflash"):
        assert runs[name]["identical_to_ar"] is True and runs[name]["new_tokens"] == runs["ar"]["new_tokens"]
        assert 1.0 <= runs[name]["tau"] <= settings["gamma"] + 1 and runs[name]["tokens_per_s"] > 0
    assert {r["domain"] for r in data["by_domain"]} == {"custom"}


def test_demo_times_each_method_by_its_fastest_repeat(tmp_path, monkeypatch):
    """``--repeats 3`` decodes the prompt three times per method and keeps the fastest time; the tokens and tau come
    from the first (streamed) run."""
    calls = {"ar": 0, "spec": 0}
    real_ar, real_spec = demo._run_ar, demo._run_spec

    def ar(*a, **k):
        calls["ar"] += 1
        res = real_ar(*a, **k)
        res.elapsed_s = 1.0 / calls["ar"]  # later runs "faster": the last one must be the one timed
        return res

    def spec(*a, **k):
        calls["spec"] += 1
        res = real_spec(*a, **k)
        res.elapsed_s = 10.0
        return res

    monkeypatch.setattr(demo, "_run_ar", ar)
    monkeypatch.setattr(demo, "_run_spec", spec)
    out = tmp_path / "demo.json"
    demo.main([*SMALL, "--prompt", "def add(a, b):\n", "--max-new-tokens", "6", "--repeats", "3", "--json",
               str(out)])
    data = json.loads(out.read_text())
    assert calls == {"ar": 1 + 3, "spec": 2 * (1 + 3)}  # one warm-up each, then three decodes per method
    runs = {r["method"]: r for r in data["runs"]}
    assert runs["ar"]["tokens_per_s"] == pytest.approx(runs["ar"]["new_tokens"] / (1.0 / 4))
    assert runs["dspark"]["tokens_per_s"] == pytest.approx(runs["dspark"]["new_tokens"] / 10.0)
    assert data["settings"]["repeats"] == 3
    with pytest.raises(SystemExit):
        demo.main([*SMALL, "--prompt", "x", "--repeats", "0"])
    with pytest.raises(SystemExit):
        demo.main([*SMALL, "--prompt", "x", "--gamma", "17"])
    with pytest.raises(SystemExit):
        demo.main([*SMALL, "--prompt", "x", "--gamma", "1"])  # adaptive needs two lengths to fit its costs


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be in 1..4096"),
    (["--max-new-tokens", "100000"], "--max-new-tokens must be in 1..4096"),
    (["--seed", "-1"], "--seed must be in 0..2**31 - 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--model", "/nonexistent"], "argument --model: '/nonexistent' is not a registry name"),
    (["--drafter", "/nonexistent"], "is not a drafter directory"),
    (["--draft-vocab", "-1"], "--draft-vocab must be >= 0"),
    (["--draft-vocab", "64"], "has no token ranking"),
    (["--json", "/dev/null/demo.json"], "--json /dev/null/demo.json: cannot create its directory"),
])
def test_demo_bad_options_are_usage_errors_before_any_model_loads(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(demo, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exc:
        demo.main([*SMALL, "--prompt", "x", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_demo_triton_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        demo.main([*SMALL, "--prompt", "x", "--impl", "triton"])
    assert exc.value.code == 2 and "--impl triton needs a CUDA GPU" in capsys.readouterr().err


def test_demo_a_target_without_shipped_drafters_needs_drafter(tmp_path, capsys, smollm2_gguf):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--model", str(smollm2_gguf), "--prompt", "x"])
    assert exc.value.code == 2 and "--drafter is required" in capsys.readouterr().err


def test_demo_empty_prompt_decodes_from_bos_alone(tmp_path):
    """``--prompt ""`` is a prompt (the BOS token alone), not a request for the built-in prompts."""
    out = demo.main([*SMALL, "--prompt", "", "--max-new-tokens", "4", "--repeats", "1", "--draft-length", "fixed"])
    assert out["settings"]["prompts"] == 1


def test_demo_reports_every_prompt_alone_and_they_add_up(tmp_path):
    out = tmp_path / "demo.json"
    demo.main([*SMALL, "--max-new-tokens", "6", "--repeats", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    domains = [d for d, texts in demo.TEXT_PROMPTS.items() for _ in texts]
    rows = data["by_prompt"]
    assert [(r["prompt"], r["domain"]) for r in rows if r["method"] == "ar"] == list(enumerate(domains, 1))
    for run in data["runs"]:
        mine = [r for r in rows if r["method"] == run["method"]]
        assert len(mine) == len(domains) and sum(r["new_tokens"] for r in mine) == run["new_tokens"]
        seconds = sum(r["new_tokens"] / r["tokens_per_s"] for r in mine)
        assert run["tokens_per_s"] == pytest.approx(run["new_tokens"] / seconds)
        assert all(1.0 <= r["tau"] <= data["settings"]["gamma"] + 1 for r in mine)

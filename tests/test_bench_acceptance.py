"""Acceptance benchmark outputs: merging split runs, the markdown table and the plot (synthetic results)."""

import json

import pytest

from dspark_kernels.bench import acceptance


def _run(path, drafter, taus, settings=None):
    results = [{"domain": d, "drafter": drafter, "temperature": 1.0, "gamma": 3, "tau": t,
                "acceptance_by_position": [0.5, 0.4, 0.3], "num_prompts": 2, "num_rounds": 10}
               for d, t in zip(("code", "prose"), taus)]
    path.write_text(json.dumps({"benchmark": "acceptance", "settings": settings or {"num_prompts": 2},
                                "results": results}))
    return path


def test_merge_table_and_plot(tmp_path):
    a = _run(tmp_path / "a.json", "dspark", [2.0, 3.0])
    b = _run(tmp_path / "b.json", "eagle", [1.5, 2.5])
    data = acceptance.merge([a, b])
    assert [r["drafter"] for r in data["results"]] == ["dspark", "dspark", "eagle", "eagle"]
    table = acceptance.summary_table(data)
    assert "| dspark | 1 | 3 | 2.00 | 3.00 | 2.50 |" in table and "| eagle | 1 | 3 | 1.50 | 2.50 | 2.00 |" in table
    acceptance.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_merge_rejects_different_settings(tmp_path):
    a = _run(tmp_path / "a.json", "dspark", [2.0, 3.0])
    b = _run(tmp_path / "b.json", "eagle", [1.5, 2.5], settings={"num_prompts": 3})
    with pytest.raises(ValueError, match="settings"):
        acceptance.merge([a, b])


@pytest.mark.parametrize("argv,message", [
    (["--num-prompts", "0"], "argument --num-prompts"), (["--max-new-tokens", "0"], "argument --max-new-tokens"),
    (["--prompt-len", "-3"], "argument --prompt-len"), (["--domains", "bogus"], "--domains ['bogus']"),
    (["--gammas", "0"], "--gammas must lie in"), (["--gammas", "7", "99"], "--gammas must lie in"),
    (["--temperatures", "0", "nan"], "--temperatures must be finite"), (["--temperatures", "-1"], "--temperatures"),
    (["--prompt-len", "100000"], "--prompt-len must be <= 2048"), (["--seed", "-1"], "--seed must be in"),
    (["--drafters", "nope"], "no such drafter"), (["--prompts", "missing.json"], "does not exist"),
    (["--draft-vocab", "-1"], "--draft-vocab must be >= 0"), (["--draft-vocab", "64"], "has no token ranking")])
def test_bad_options_are_usage_errors_before_any_model_loads(argv, message, monkeypatch, capsys):
    from dspark_kernels.bench import __main__ as bench_main

    monkeypatch.setattr("sys.argv", ["bench", "acceptance", *argv])
    monkeypatch.setattr(acceptance, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exc:
        bench_main.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [("not json", "not a readable JSON file"), ("[]", "non-empty JSON list"),
                                             ('[{"id": 1}]', "entry 0"), ('[{"id": 1, "prompt": ""}]', "entry 0")])
def test_a_corrupt_prompts_file_is_a_usage_error(tmp_path, content, message, monkeypatch, capsys):
    from dspark_kernels.bench import __main__ as bench_main

    bad = tmp_path / "prompts.json"
    bad.write_text(content)
    monkeypatch.setattr("sys.argv", ["bench", "acceptance", "--prompts", str(bad)])
    with pytest.raises(SystemExit) as exc:
        bench_main.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_prompts_file_is_chat_templated(tmp_path, smollm2_gguf):
    from dspark_kernels.models.target_tokenizer import load_target_tokenizer

    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "What is 2 + 2?"}]))
    tok = load_target_tokenizer(smollm2_gguf)
    sets = acceptance.chat_benchmark_prompts(tok, path, ["code"], 1)
    assert list(sets) == ["custom"] and sets["custom"] == [tok.encode_chat([{"role": "user", "content": "Say hi."}])]


def test_prompt_length_beyond_every_document_is_a_clear_error(tmp_path):
    from dspark_kernels.bench import ASSETS
    from dspark_kernels.models.target_tokenizer import load_target_tokenizer

    corpus = tmp_path / "corpus"
    (corpus / "code").mkdir(parents=True)
    split = acceptance.DOMAIN_SPLITS["code"]
    (corpus / "code" / f"{split}.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x + 1\n"}) + "\n")
    tokenizer = load_target_tokenizer(ASSETS / "target")
    with pytest.raises(ValueError, match="--prompt-len 100000: no code document"):
        acceptance.benchmark_prompts(tokenizer, corpus, "code", 2, 100000, 0)


def test_a_corrupt_merge_file_is_a_clear_error(tmp_path, monkeypatch):
    from dspark_kernels.bench import __main__ as bench_main

    bad = tmp_path / "run.json"
    bad.write_text("{not json")
    monkeypatch.setattr("sys.argv", ["bench", "acceptance", "--merge", str(bad), "--json", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit, match="--merge"):
        bench_main.main()
    assert not (tmp_path / "out.json").exists()

"""Offline prompt sets: determinism, source-disjoint splits, counts, answers, storage and the command line."""

import ast
import json
import re
from fractions import Fraction

import pytest

from dspark_kernels.train.prompts import (
    CODE_MODULES,
    DOMAINS,
    FIRST_NAMES,
    HELDOUT_MATH_TEMPLATES,
    MAX_PASSAGE_CHARS,
    SPLITS,
    build_prompts,
    heldout_sources,
    read_prompts,
    write_prompts,
)
from dspark_kernels.train.prompts.__main__ import main

SMALL = {"train_per_domain": 300, "heldout_per_domain": 30}
CODE_KINDS = {"signature", "explain", "fix", "type_hints", "docstring", "unit_test", "usage", "review"}


@pytest.fixture(scope="module")
def defaults():
    return build_prompts()


@pytest.fixture(scope="module")
def small():
    return build_prompts(seed=0, **SMALL)


def _ints(text):
    return [int(x) for x in re.findall(r"\d+", text)]


def test_default_counts_and_records(defaults):
    assert set(defaults) == set(DOMAINS)
    for domain in DOMAINS:
        assert set(defaults[domain]) == set(SPLITS)
        for split, expected in (("train", 3000), ("heldout", 300)):
            records = defaults[domain][split]
            assert len(records) == expected
            assert len({r["prompt"] for r in records}) == expected, "duplicate prompts"
            assert [r["id"] for r in records] == [f"{domain}-{split}-{i}" for i in range(expected)]
            for r in records:
                assert set(r) - {"answer"} == {"id", "domain", "kind", "source", "prompt"}
                assert r["domain"] == domain and r["kind"] and r["source"]
                assert r["prompt"].strip() and len(r["prompt"]) < 4000


def test_splits_are_disjoint_by_source_and_text(defaults):
    for domain in DOMAINS:
        train, heldout = defaults[domain]["train"], defaults[domain]["heldout"]
        assert not {r["source"] for r in train} & {r["source"] for r in heldout}, domain
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}, domain
    held_modules = heldout_sources(CODE_MODULES, "code")
    assert {r["source"] for r in defaults["code"]["heldout"]} <= held_modules
    assert not {r["source"] for r in defaults["code"]["train"]} & held_modules


def test_math_templates_and_names_are_split(defaults):
    train_kinds = {r["kind"] for r in defaults["math"]["train"]}
    heldout_kinds = {r["kind"] for r in defaults["math"]["heldout"]}
    assert len(train_kinds) >= 30
    assert heldout_kinds == set(HELDOUT_MATH_TEMPLATES) and not train_kinds & heldout_kinds
    held_names = heldout_sources(FIRST_NAMES, "math-names", fraction=0.2)
    pattern = re.compile(r"\b(" + "|".join(sorted(held_names)) + r")\b")
    assert not any(pattern.search(r["prompt"]) for r in defaults["math"]["train"])
    assert any(pattern.search(r["prompt"]) for r in defaults["math"]["heldout"])


def test_code_kinds_and_fixes(defaults):
    for split in SPLITS:
        assert {r["kind"] for r in defaults["code"][split]} == CODE_KINDS
    fixes = [r for r in defaults["code"]["train"] if r["kind"] == "fix"]
    assert fixes
    for r in fixes:
        buggy = re.search(r"```python\n(.*?)\n```", r["prompt"], re.S).group(1)
        assert ast.unparse(ast.parse(buggy)) == buggy != r["answer"]
        ast.parse(r["answer"])


def test_chat_passages_are_bounded(defaults):
    kinds = {r["kind"] for r in defaults["chat"]["train"]}
    assert {"summarize", "explain_concept", "tips", "write_email", "write_poem", "write_story"} <= kinds
    sources = {r["source"].split(":")[0] for r in defaults["chat"]["train"]}
    assert {"pydoc", "module", "concept", "activity"} <= sources
    for r in defaults["chat"]["train"]:
        if r["kind"] in ("summarize", "key_points", "title"):
            assert len(r["prompt"].split("\n\n", 1)[1]) <= MAX_PASSAGE_CHARS


def test_math_answers_recompute(defaults):
    records = defaults["math"]["train"] + defaults["math"]["heldout"]
    checked = set()
    for r in records:
        kind, nums = r["kind"], _ints(r["prompt"])
        if kind == "linear_equation":
            a, b, c = nums
            assert r["answer"] == f"x = {(c - b) // a}" and (c - b) % a == 0
        elif kind == "percent_of":
            p, n = nums
            assert Fraction(r["answer"]) == Fraction(p * n, 100)
        elif kind == "rectangle_area":
            assert int(r["answer"]) == nums[0] * nums[1]
        elif kind == "average_scores":
            assert Fraction(int(r["answer"])) == Fraction(sum(nums), len(nums))
        elif kind == "fence_posts":
            length, gap = (nums[1], nums[0]) if "Trees" in r["prompt"] else nums
            assert int(r["answer"]) == length // gap + 1
        elif kind == "marble_probability":
            counts = {color: int(n) for n, color in re.findall(r"(\d+) (red|blue|green)", r["prompt"])}
            color = re.search(r"(red|blue)(?: one)?\?$", r["prompt"]).group(1)
            assert Fraction(r["answer"]) == Fraction(counts[color], sum(counts.values()))
        else:
            continue
        checked.add(kind)
    assert checked == {"linear_equation", "percent_of", "rectangle_area", "average_scores", "fence_posts",
                       "marble_probability"}


def test_same_seed_is_byte_identical(small, tmp_path):
    again = build_prompts(seed=0, **SMALL)
    assert again == small
    m1 = write_prompts(small, tmp_path / "a", seed=0)
    m2 = write_prompts(again, tmp_path / "b", seed=0)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 1 + len(DOMAINS) * len(SPLITS)
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    manifest = json.loads(m1.read_text())
    assert m2.read_text() == m1.read_text()
    assert manifest["seed"] == 0 and manifest["counts"]["math"] == {"heldout": 30, "train": 300}


def test_different_seed_differs(small):
    other = build_prompts(seed=1, **SMALL)
    for domain in DOMAINS:
        assert [r["prompt"] for r in other[domain]["train"]] != [r["prompt"] for r in small[domain]["train"]]


def test_read_round_trip_and_missing_file(small, tmp_path):
    write_prompts(small, tmp_path)
    for domain in DOMAINS:
        for split in SPLITS:
            assert read_prompts(tmp_path, domain, split) == small[domain][split]
    with pytest.raises(FileNotFoundError, match=r"heldout\.jsonl.*python -m dspark_kernels\.train\.prompts --out"):
        read_prompts(tmp_path / "missing", "code", "heldout")
    with pytest.raises(ValueError, match="unknown domain"):
        read_prompts(tmp_path, "poetry", "train")


def test_too_many_prompts_names_the_domain():
    with pytest.raises(ValueError, match=r"domain 'chat' can make only \d+ distinct train prompts"):
        build_prompts(train_per_domain=10**6, heldout_per_domain=1, domains=("chat",))


def test_heldout_sources_rule():
    names = [f"name{i}" for i in range(50)]
    held = heldout_sources(names, "family")
    assert len(held) == 5 and held == heldout_sources(reversed(names), "family")
    assert held != heldout_sources(names, "other-family")


@pytest.mark.parametrize("option", ["--train-per-domain", "--heldout-per-domain"])
def test_cli_rejects_bad_counts(option, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), option, "0"])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cli_writes_files_and_manifest(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--train-per-domain", "40", "--heldout-per-domain", "8",
                 "--domains", "math", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "math: train 40, heldout 8" in out and "sample:" in out
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["seed"] == 3 and manifest["counts"] == {"math": {"heldout": 8, "train": 40}}
    assert set(manifest["files"]) == {"math/train.jsonl", "math/heldout.jsonl"}
    assert len(read_prompts(tmp_path, "math", "train")) == 40
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "big"), "--train-per-domain", "1000000", "--domains", "chat"])
    assert exc.value.code == 2 and "'chat' can make only" in capsys.readouterr().err

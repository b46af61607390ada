"""Offline corpus builder and the shipped tokenizer."""

import json
from pathlib import Path

import pytest

from dspark_kernels.train.corpus import build_corpus, default_sources, read_split, split_of
from dspark_kernels.train.tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, SPECIAL_TOKENS, load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "dspark_kernels" / "assets" / "target"


def _small_sources(tmp_path: Path) -> dict:
    """A miniature stdlib + include tree (the real one takes seconds; the logic is the same)."""
    stdlib, include = tmp_path / "lib", tmp_path / "include"
    (stdlib / "pkg").mkdir(parents=True)
    (stdlib / "test").mkdir()
    include.mkdir()
    doc = "A docstring long enough to count as prose. " * 6
    for i in range(30):
        (stdlib / f"mod{i}.py").write_text(f'"""{doc}{i}"""\n\ndef f{i}(x):\n    return x + {i}\n')
    (stdlib / "pkg" / "inner.py").write_text("X = 1\n")
    (stdlib / "test" / "test_skip.py").write_text("SKIPPED = True\n")
    (include / "a.h").write_text("#define A 1\n")
    return {"stdlib": stdlib, "include": include}


def test_corpus_is_deterministic(tmp_path):
    sources = _small_sources(tmp_path)
    m1 = build_corpus(tmp_path / "c1", sources)
    m2 = build_corpus(tmp_path / "c2", sources)
    assert m1 == m2
    assert (tmp_path / "c1" / "manifest.json").read_text() == (tmp_path / "c2" / "manifest.json").read_text()
    sources_seen = {f["source"] for f in m1["files"]}
    assert "stdlib/test/test_skip.py" not in sources_seen  # tests excluded
    assert "stdlib/pkg/inner.py" in sources_seen
    assert any(f["domain"] == "heldout" and f["split"] == "test" for f in m1["files"])
    assert any(s.startswith("pydoc/") for s in sources_seen)
    # docstrings follow their file's split: no validation file contributes training prose
    code_split = {f["source"]: f["split"] for f in m1["files"] if f["domain"] == "code"}
    for f in m1["files"]:
        if f["domain"] == "prose" and "#doc" in f["source"]:
            assert f["split"] == code_split[f["source"].split("#")[0]]


def test_split_assignment_is_stable():
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    splits = [split_of(f"m{i}.py") for i in range(2000)]
    assert 0.85 < splits.count("train") / 2000 < 0.95


def test_corpus_refuses_missing_source(tmp_path):
    sources = _small_sources(tmp_path)
    with pytest.raises(FileNotFoundError, match="'include'"):
        build_corpus(tmp_path / "c", {"stdlib": sources["stdlib"], "include": tmp_path / "nope"})
    with pytest.raises(FileNotFoundError, match="'stdlib'"):
        build_corpus(tmp_path / "c", {"include": sources["include"]})
    with pytest.raises(FileNotFoundError, match="code/validation"):
        read_split(tmp_path / "empty", "code", "validation")


def test_default_sources_exist():
    src = default_sources()
    assert src["stdlib"].is_dir() and src["include"].is_dir()


def test_tokenizer_special_ids_and_vocab():
    tok = load_tokenizer(ASSETS)
    assert tok.get_vocab_size() == 8192
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i
    assert (PAD_ID, BOS_ID, EOS_ID, MASK_ID) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n\treturn x ** 2  # comment\n",
        "Ünïcödé, emoji 🙂🚀, CJK 中文字符, Arabic مرحبا, NUL \x00 and \r\n line ends",
        "    \n\n   trailing spaces   ",
        "",
        "\U0010ffff\u200b zero-width",
    ],
)
def test_tokenizer_round_trips_arbitrary_utf8(text):
    tok = load_tokenizer(ASSETS)
    assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_round_trips_random_text():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tok = load_tokenizer(ASSETS)

    @settings(max_examples=200, deadline=None)
    @given(st.text())
    def check(text):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text

    check()


def test_missing_tokenizer_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        load_tokenizer(tmp_path)


def test_manifest_of_real_corpus_lists_checksums(tmp_path):
    manifest = build_corpus(tmp_path / "corpus")
    assert set(k.split("/")[0] for k in manifest["splits"]) == {"code", "prose", "heldout"}
    data = json.loads((tmp_path / "corpus" / "manifest.json").read_text())
    assert all(len(f["sha256"]) == 64 for f in data["files"])

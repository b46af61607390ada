"""Reproducible offline corpus from text every Python installation carries.

Domains:
    code      the running interpreter's standard-library Python sources (tests, idlelib and site-packages excluded)
    prose     English prose: ``pydoc_data.topics`` (the language reference topics) and the docstrings of those same
              standard-library modules (module, class and function docstrings of at least ``MIN_DOCSTRING`` chars)
    heldout   C headers of the interpreter's include directory; never used for training, only to measure how
              acceptance generalises to an unseen domain

Splits are assigned per source file by a hash of its path relative to its root, so they do not depend on file order or
machine: train 90%, validation 5%, test 5%. A file's docstrings land in the same split as its code, so no validation
text leaks into training through the other domain. ``heldout`` puts everything in ``test``.

Output (``build_corpus(out_dir)``)::

    out_dir/<domain>/<split>.jsonl     one {"source": ..., "text": ...} document per line
    out_dir/manifest.json              sources, Python version, per-file sizes and sha256, per-split totals

CLI: ``python -m dspark_kernels.train.corpus --out data/corpus``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sysconfig
import warnings
from pathlib import Path

DOMAINS = ("code", "prose", "heldout")
SPLITS = ("train", "validation", "test")
MIN_DOCSTRING = 200
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo"}


def default_sources() -> dict[str, Path]:
    paths = sysconfig.get_paths()
    return {"stdlib": Path(paths["stdlib"]), "include": Path(paths["include"])}


def split_of(rel_path: str) -> str:
    """Deterministic split for a source file: sha256 of its relative path, 90/5/5."""
    bucket = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < 90 else ("validation" if bucket < 95 else "test")


def _stdlib_files(stdlib: Path) -> list[Path]:
    files = [p for p in stdlib.rglob("*.py") if not (_EXCLUDED_DIRS & set(p.relative_to(stdlib).parts[:-1]))]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def _docstrings(source: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc and len(doc) >= MIN_DOCSTRING:
            out.append(doc)
    return out


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def collect_documents(sources: dict[str, Path]) -> dict[str, dict[str, list[dict]]]:
    """All documents by domain and split. Raises FileNotFoundError naming a missing source."""
    for name in ("stdlib", "include"):
        if name not in sources or not Path(sources[name]).is_dir():
            raise FileNotFoundError(f"corpus source {name!r} not found at {sources.get(name)}: the corpus needs it")
    stdlib, include = Path(sources["stdlib"]), Path(sources["include"])
    docs = {d: {s: [] for s in SPLITS} for d in DOMAINS}
    code_files = _stdlib_files(stdlib)
    if not code_files:
        raise FileNotFoundError(f"corpus source 'stdlib' at {stdlib} holds no Python files")
    for path in code_files:
        rel = path.relative_to(stdlib).as_posix()
        text = _read(path)
        split = split_of(rel)
        docs["code"][split].append({"source": f"stdlib/{rel}", "text": text})
        for i, doc in enumerate(_docstrings(text)):
            docs["prose"][split].append({"source": f"stdlib/{rel}#doc{i}", "text": doc})
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise FileNotFoundError("corpus source 'pydoc_data.topics' is missing from this Python installation") from e
    for name in sorted(topics):
        docs["prose"][split_of(f"pydoc/{name}")].append({"source": f"pydoc/{name}", "text": topics[name]})
    headers = sorted(include.rglob("*.h"), key=lambda p: p.relative_to(include).as_posix())
    if not headers:
        raise FileNotFoundError(f"corpus source 'include' at {include} holds no C headers (held-out domain)")
    for path in headers:
        rel = path.relative_to(include).as_posix()
        docs["heldout"]["test"].append({"source": f"include/{rel}", "text": _read(path)})
    return docs


def build_corpus(out_dir: Path, sources: dict[str, Path] | None = None) -> dict:
    """Write the corpus and its manifest under ``out_dir``; return the manifest."""
    out_dir = Path(out_dir)
    docs = collect_documents(sources or default_sources())
    manifest = {"python": platform.python_version(), "splits": {}, "files": []}
    for domain in DOMAINS:
        for split in SPLITS:
            items = docs[domain][split]
            if not items:
                continue
            target = out_dir / domain / f"{split}.jsonl"
            target.parent.mkdir(parents=True, exist_ok=True)
            body = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in items)
            target.write_text(body, encoding="utf-8")
            manifest["splits"][f"{domain}/{split}"] = {
                "documents": len(items),
                "chars": sum(len(d["text"]) for d in items),
                "sha256": hashlib.sha256(body.encode()).hexdigest(),
            }
            for d in items:
                manifest["files"].append(
                    {
                        "domain": domain,
                        "split": split,
                        "source": d["source"],
                        "chars": len(d["text"]),
                        "sha256": hashlib.sha256(d["text"].encode()).hexdigest(),
                    }
                )
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_split(corpus_dir: Path, domain: str, split: str) -> list[str]:
    """Texts of one domain/split of a built corpus."""
    path = Path(corpus_dir) / domain / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"corpus split {domain}/{split} not found at {path}: run dspark_kernels.train.corpus")
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/corpus"),
                        help="directory the corpus (JSONL splits per domain, manifest) is written to")
    args = parser.parse_args(argv)
    manifest = build_corpus(args.out)
    for key, info in manifest["splits"].items():
        print(f"{key:24s} {info['documents']:6d} docs {info['chars'] / 1e6:8.2f} M chars")


if __name__ == "__main__":
    main()

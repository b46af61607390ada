"""argparse ``type`` functions shared by the command-line tools: a bad value is a usage error naming the option."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["DEFAULT_CORPUS", "DRAFT_VOCAB_HELP", "check_corpus", "draft_vocab_choice", "fraction_below_one",
           "missing_inputs_are_usage_errors", "model_source",
           "non_negative_float", "non_negative_int", "positive_float", "positive_int"]

DEFAULT_CORPUS = Path("data/corpus")


def positive_int(text: str) -> int:
    """Counts that must be >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """Counts that may be 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """Finite values > 0 (speeds, rates, learning rates)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """Finite values >= 0 (loss weights)."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def fraction_below_one(text: str) -> float:
    """Values in ``[0, 1)`` (relative spreads)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def model_source(text: str) -> str:
    """``--model``: a registry name (``python -m dspark_kernels.assets list``), a Hugging Face model directory or a
    GGUF file. Checked without loading or fetching anything; a named model that is not cached is fetched when loaded."""
    from .models.gguf_reader import is_gguf_file
    from .models.registry import REGISTRY

    if text in REGISTRY:
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"model directory {text!r} has no config.json")
        return text
    if path.is_file():
        if not is_gguf_file(path):
            raise argparse.ArgumentTypeError(f"{text!r} is neither a model directory nor a GGUF file")
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a registry name ({', '.join(sorted(REGISTRY))}), a model "
                                     f"directory or a GGUF file")


@contextmanager
def missing_inputs_are_usage_errors(parser: argparse.ArgumentParser) -> Iterator[None]:
    """A missing input file or directory inside the block (``FileNotFoundError``, whose message names it and what to
    run to make it) ends the tool as ``parser``'s usage error, status 2, instead of a traceback."""
    try:
        yield
    except FileNotFoundError as e:
        parser.error(str(e))


def check_corpus(parser: argparse.ArgumentParser, corpus: Path) -> bool:
    """Whether ``--corpus`` must be built before the run: only the default directory (``data/corpus``) is built when
    missing; another path must already hold a corpus (a mistyped path is a usage error, not a new corpus there)."""
    corpus = Path(corpus)
    if (corpus / "manifest.json").is_file():
        return False
    if corpus == DEFAULT_CORPUS and not corpus.exists():
        return True
    parser.error(f"--corpus {corpus} holds no corpus (no manifest.json); build one there with "
                 f"`python -m dspark_kernels.train.corpus --out {corpus}`, or leave --corpus at its default "
                 f"({DEFAULT_CORPUS}, built on first use)")
    return False


DRAFT_VOCAB_HELP = ("draft over the K most frequent tokens of the drafters' token ranking (lossless); 0 drafts over "
                    "the whole vocabulary (default: the registry's choice for a registry target's shipped drafters, "
                    "8192 for SmolLM2; else the whole vocabulary)")


def draft_vocab_choice(value: int | None, model: object, shipped: bool, drafter_dirs: list[Path]) -> int | None:
    """The draft vocabulary a tool's ``--draft-vocab`` asks for (None: the whole vocabulary), checked before any model
    loads: ``value`` >= 0 (0: the whole vocabulary), None takes the registry's ``draft_vocab`` of ``model`` when the
    drafters are the ones shipped for it; every drafter directory must then hold its token ranking. ValueError names
    the option."""
    from .drafters.draft_vocab import RANKING_FILE
    from .models.registry import REGISTRY

    if value is not None and value < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {value}")
    if value is None and shipped and isinstance(model, str) and model in REGISTRY:
        value = REGISTRY[model].draft_vocab
    if not value:
        return None
    unranked = [str(d) for d in drafter_dirs if not (Path(d) / RANKING_FILE).is_file()]
    if unranked:
        raise ValueError(f"--draft-vocab: {', '.join(unranked)} has no token ranking ({RANKING_FILE}; build it with "
                         "python -m dspark_kernels.train.token_ranking)")
    return value

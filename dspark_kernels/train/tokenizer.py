"""Byte-level BPE tokenizer trained with ``tokenizers`` on the corpus's training split.

Special tokens take the first ids: ``<|pad|>`` 0, ``<|bos|>`` 1, ``<|eos|>`` 2 and ``<|mask|>`` 3 (the parallel
drafter's MASK input). Byte-level pre-tokenisation means any UTF-8 text round-trips, including text outside the corpus.

CLI: ``python -m dspark_kernels.train.tokenizer --corpus data/corpus --out dspark_kernels/assets/target``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .corpus import read_split

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>")
PAD_ID, BOS_ID, EOS_ID, MASK_ID = range(4)
TRAIN_DOMAINS = ("code", "prose")


def train_tokenizer(corpus_dir: Path, vocab_size: int = 8192):
    """Train the tokenizer on the train split of the training domains; return a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [t for d in TRAIN_DOMAINS for t in read_split(corpus_dir, d, "train")]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def load_tokenizer(path: Path):
    """Load ``tokenizer.json`` from a file or a model directory; clear error when it is missing."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"tokenizer not found: expected {file}")
    return Tokenizer.from_file(str(file))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"),
                        help="corpus the tokenizer is trained on")
    parser.add_argument("--out", type=Path, default=Path("dspark_kernels/assets/target"),
                        help="directory tokenizer.json is written to")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="vocabulary size of the byte-level BPE")
    args = parser.parse_args(argv)
    tok = train_tokenizer(args.corpus, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    print(f"vocab {tok.get_vocab_size()} -> {args.out / 'tokenizer.json'}")


if __name__ == "__main__":
    main()

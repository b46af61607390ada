"""A target's tokenizer with what decoding needs besides the vocabulary: BOS, the EOS ids to stop at, the chat
template, and streaming detokenization.

:func:`load_target_tokenizer` reads it from any model source :func:`.registry.resolve_model` takes:

- a GGUF file: the tokenizer, special tokens and chat template in its metadata (:mod:`.gguf_tokenizer`);
- a Hugging Face directory: ``tokenizer.json``, and the special ids from ``special_tokens.json`` (the shipped
  target's ``pad``/``bos``/``eos``) or ``generation_config.json`` / ``config.json``, the chat template from
  ``tokenizer_config.json``.

A raw-text prompt is ``[bos] + ids`` when the model expects BOS in front (``add_bos``: the shipped target, trained on
``<|bos|>``-led documents) and ``ids`` otherwise; a chat prompt is the rendered template's ids (the template writes any
BOS itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_reader import open_gguf
from .gguf_tokenizer import StreamDecoder, render_chat, tokenizer_from_gguf, tokenizer_info
from .registry import resolve_model

__all__ = ["TargetTokenizer", "load_target_tokenizer", "stop_token_ids"]


@dataclass(frozen=True)
class TargetTokenizer:
    """``tokenizer`` (a ``tokenizers.Tokenizer``), ``bos_token_id`` (None if the model has none), ``eos_token_ids``
    (generation stops at any), ``add_bos`` (prepend BOS to raw-text prompts) and the ``chat_template`` (None if the
    model has none) with the strings it refers to as ``bos_token`` / ``eos_token``."""

    tokenizer: Any
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def prefix(self) -> list[int]:
        """The ids a raw-text prompt starts with: ``[bos]`` when :attr:`add_bos`, else none."""
        return [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []

    def encode(self, text: str) -> list[int]:
        """A raw-text prompt's ids, :attr:`prefix` first."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.prefix + self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text alone, without :attr:`prefix` (for slicing windows out of documents)."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` rendered with the chat template (ValueError when the model has none)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; encode a raw-text prompt instead")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of ``messages`` rendered with the chat template (its special tokens kept whole)."""
        return self.tokenizer.encode(self.render_chat(messages, add_generation_prompt),
                                     add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids of a prompt: ``text`` as the user's message through the chat template when there is one, else the
        raw text with the tokenizer's prefix (:meth:`encode`)."""
        if self.chat_template is None:
            return self.encode(text)
        return self.encode_chat([{"role": "user", "content": text}])

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A decoder that turns ids pushed as they are generated into valid UTF-8 pieces."""
        return StreamDecoder(self.tokenizer, skip_special_tokens)


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _ids(value: Any, where: str) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where} must be token ids (ints >= 0), got {value!r}")
    return tuple(ids)


def _directory_specials(path: Path) -> tuple[tuple[int, ...], tuple[int, ...], bool, dict]:
    """``(bos ids, eos ids, add_bos, tokenizer_config)`` of an HF directory, from ``special_tokens.json`` (the
    shipped target) or ``generation_config.json`` / ``config.json`` / ``tokenizer_config.json``."""
    shipped = _json(path / "special_tokens.json")
    generation, config, tok_config = (_json(path / n) for n in
                                      ("generation_config.json", "config.json", "tokenizer_config.json"))
    if shipped:
        bos = _ids(shipped.get("bos"), f"{path / 'special_tokens.json'}: bos")
        eos = _ids(shipped.get("eos"), f"{path / 'special_tokens.json'}: eos")
        return bos, eos, True, tok_config
    source = generation if "eos_token_id" in generation else config
    bos = _ids(source.get("bos_token_id", config.get("bos_token_id")), f"{path}: bos_token_id")
    eos = _ids(source.get("eos_token_id"), f"{path}: eos_token_id")
    return bos, eos, bool(tok_config.get("add_bos_token", False)), tok_config


def _from_directory(path: Path) -> TargetTokenizer:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer not found: expected {file}")
    tokenizer = Tokenizer.from_file(str(file))
    bos, eos, add_bos, tok_config = _directory_specials(path)
    vocab = tokenizer.get_vocab_size()
    bad = [i for i in (*bos, *eos) if i >= vocab]
    if bad:
        raise ValueError(f"{path}: special token id {bad[0]} is outside the tokenizer's {vocab} tokens")
    template = tok_config.get("chat_template")

    def text(key: str) -> str:
        value = tok_config.get(key)
        return value if isinstance(value, str) else (value or {}).get("content", "") if isinstance(value, dict) else ""

    return TargetTokenizer(tokenizer, bos[0] if bos else None, eos, add_bos,
                           template if isinstance(template, str) and template else None,
                           text("bos_token"), text("eos_token"))


def stop_token_ids(source: str | Path) -> tuple[int, ...]:
    """The EOS ids generation with the model at ``source`` stops at, read without building its tokenizer."""
    path = resolve_model(source)
    return tokenizer_info(open_gguf(path)).eos_token_ids if path.is_file() else _directory_specials(path)[1]


def _from_gguf(path: Path) -> TargetTokenizer:
    f = open_gguf(path)
    info = tokenizer_info(f)
    return TargetTokenizer(tokenizer_from_gguf(f), info.bos_token_id, info.eos_token_ids, info.add_bos_token,
                           info.chat_template, info.bos_token or "", info.eos_token or "")


def load_target_tokenizer(source: str | Path) -> TargetTokenizer:
    """The tokenizer of the model at ``source`` (a registry name, an HF directory or a GGUF file)."""
    path = resolve_model(source)
    return _from_gguf(path) if path.is_file() else _from_directory(path)

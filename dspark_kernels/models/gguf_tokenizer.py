"""The tokenizer, chat template and stop tokens stored in a GGUF file, as a ``tokenizers.Tokenizer``.

:func:`tokenizer_from_gguf` rebuilds the byte-level BPE tokenizer (``tokenizer.ggml.model == 'gpt2'``) from the
vocabulary, merges and token types, splitting text before BPE the way llama.cpp does for the file's
``tokenizer.ggml.pre``. Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both are matched whole in the text. :func:`tokenizer_info` gathers the special ids (``eos_token_ids``
includes the end-of-turn tokens a chat model stops at), :func:`render_chat` renders the chat template as transformers'
``apply_chat_template`` does, :class:`StreamDecoder` turns generated ids into text piece by piece, and
:func:`save_hf_tokenizer_files` writes the files ``transformers.AutoTokenizer`` loads.

Every problem in the file raises :class:`~.gguf_reader.GGUFError` naming the key and the value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from .gguf_reader import GGUFError, GGUFFile

__all__ = [
    "GGUFTokenizerInfo",
    "StreamDecoder",
    "SUPPORTED_PRE_TYPES",
    "render_chat",
    "save_hf_tokenizer_files",
    "tokenizer_from_gguf",
    "tokenizer_info",
]

# llama.cpp's token types: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_TYPE_UNDEFINED, _TYPE_NORMAL, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_BYTE = 0, 1, 3, 4, 6

# llama.cpp's regexes, one per pre-tokenizer family; they are applied in turn, each splitting every piece the previous
# one left, and the text between matches stays a piece of its own.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# pre-tokenizer family -> the tokenizer.ggml.pre names llama.cpp maps to it ('llama3' also ignores merges for a piece
# that is a token already, and adds BOS unless the file says otherwise)
_PRE_FAMILIES = {
    "digits_gpt2": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
    "gpt2": ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"),
    "qwen2": ("qwen2",),
    "llama3": ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
    "default": ("default",),
}
_PRE_TYPES = {name: family for family, names in _PRE_FAMILIES.items() for name in names}
SUPPORTED_PRE_TYPES: tuple[str, ...] = tuple(sorted(_PRE_TYPES))
_SUPPORTED_MODELS = ("gpt2",)

# control tokens that end a turn in common chat formats; llama.cpp stops generation at them too
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>",
                       "<|end|>")


# --------------------------------------------------------------------------------------------------- byte alphabet
@lru_cache(maxsize=1)
def _bytes_to_chars() -> tuple[str, ...]:
    """The printable character GPT-2's byte-level BPE writes for each byte value (index = byte, 256 entries)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return tuple(chars[b] for b in range(256))


def _byte_level_spelling(text: str) -> str:
    """``text`` as byte-level BPE spells it: one alphabet character per UTF-8 byte."""
    table = _bytes_to_chars()
    return "".join(table[b] for b in text.encode("utf-8"))


# --------------------------------------------------------------------------------------------------- metadata
def _pre_type(file: GGUFFile) -> str:
    """``tokenizer.ggml.pre`` (llama.cpp reads a missing key as 'default'), checked to be supported."""
    pre = file.get("tokenizer.ggml.pre", "str", "default")
    if pre not in _PRE_TYPES:
        raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.pre {pre!r} is not supported; supported pre-tokenizer "
                        f"types: {', '.join(SUPPORTED_PRE_TYPES)}")
    return pre


def _check_model(file: GGUFFile) -> None:
    model = file.get("tokenizer.ggml.model", "str")
    if model not in _SUPPORTED_MODELS:
        raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.model {model!r} is not supported; supported tokenizer "
                        f"models: {', '.join(_SUPPORTED_MODELS)} (byte-level BPE)")


def _tokens_and_types(file: GGUFFile) -> tuple[list[str], list[int]]:
    """The vocabulary (``tokenizer.ggml.tokens``) and one token type per token (all normal when the key is absent)."""
    tokens = file.get("tokenizer.ggml.tokens", "str_list")
    if not tokens:
        raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.tokens is empty")
    types = file.get("tokenizer.ggml.token_type", "int_list", None)
    if types is None:
        return tokens, [_TYPE_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.token_type has {len(types)} entries but "
                        f"tokenizer.ggml.tokens has {len(tokens)}")
    unknown = sorted({t for t in types if not _TYPE_UNDEFINED <= t <= _TYPE_BYTE})
    if unknown:
        raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.token_type holds unknown token types {unknown[:5]} "
                        f"(known: 0 undefined .. 6 byte)")
    return tokens, types


def _token_id(file: GGUFFile, key: str, n_tokens: int) -> int | None:
    """The token id at metadata ``key`` (None when absent), checked to be inside the vocabulary."""
    token_id = file.get(key, "int", None)
    if token_id is not None and not 0 <= token_id < n_tokens:
        raise GGUFError(f"GGUF file {file.path}: {key} = {token_id} is outside the vocabulary of {n_tokens} tokens")
    return token_id


def _add_bos_default(pre: str) -> bool:
    """llama.cpp's default for a byte-level vocabulary without ``tokenizer.ggml.add_bos_token``."""
    return _PRE_TYPES[pre] == "llama3"


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """Special tokens and chat template of a GGUF tokenizer.

    ``eos_token_ids`` holds ``tokenizer.ggml.eos_token_id`` first, then the end-of-turn ids (``eot``/``eom`` keys and
    the control tokens ``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``, ... present in the vocabulary), without
    repeats: generation stops at any of them. Token strings are None where the id is absent.
    """

    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    unk_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    special_tokens: tuple[str, ...]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    vocab_size: int


def _read_vocabulary(file: GGUFFile) -> tuple[str, list[str], list[int]]:
    """The checked pre type, tokens and token types of ``file``'s byte-level BPE tokenizer."""
    _check_model(file)
    pre = _pre_type(file)
    tokens, types = _tokens_and_types(file)
    return pre, tokens, types


def tokenizer_info(file: GGUFFile) -> GGUFTokenizerInfo:
    """Special ids and strings, the add-BOS/EOS flags and the chat template of ``file``'s tokenizer."""
    return _info(file, *_read_vocabulary(file))


def _info(file: GGUFFile, pre: str, tokens: list[str], types: list[int]) -> GGUFTokenizerInfo:
    n = len(tokens)
    ids = {name: _token_id(file, f"tokenizer.ggml.{name}_token_id", n)
           for name in ("bos", "eos", "padding", "unknown", "eot", "eom")}
    control = {tokens[i]: i for i in range(n) if types[i] == _TYPE_CONTROL}
    stops = [ids["eos"], ids["eot"], ids["eom"], *(control.get(t) for t in _END_OF_TURN_TOKENS)]
    eos_ids = tuple(dict.fromkeys(i for i in stops if i is not None))
    template = file.get("tokenizer.chat_template", "str", None)

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokens[token_id]

    return GGUFTokenizerInfo(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], eos_token_ids=eos_ids, pad_token_id=ids["padding"],
        unk_token_id=ids["unknown"], bos_token=text(ids["bos"]), eos_token=text(ids["eos"]),
        pad_token=text(ids["padding"]), unk_token=text(ids["unknown"]), special_tokens=tuple(control),
        add_bos_token=file.get("tokenizer.ggml.add_bos_token", "bool", _add_bos_default(pre)),
        add_eos_token=file.get("tokenizer.ggml.add_eos_token", "bool", False),
        chat_template=template or None, vocab_size=n)


# --------------------------------------------------------------------------------------------------- tokenizer
def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer that splits text as llama.cpp does for pre type ``pre``."""
    family = _PRE_TYPES[pre]
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits_gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    patterns = {"qwen2": (_QWEN2,), "llama3": (_LLAMA3,), "default": _DEFAULT}[family]
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _vocab(file: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, int]:
    """BPE vocabulary: normal tokens in byte-level spelling (respelled where the file stores plain UTF-8), control and
    user-defined tokens as their literal text; a repeated spelling keeps its first id."""
    alphabet = set(_bytes_to_chars())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (_TYPE_CONTROL, _TYPE_USER_DEFINED) and not set(token) <= alphabet:
            token = _byte_level_spelling(token)
        vocab.setdefault(token, i)
    return vocab


def _merges(file: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` ("left right" strings) as pairs, each side and the result checked to be tokens."""
    pairs = []
    for rank, merge in enumerate(file.get("tokenizer.ggml.merges", "str_list")):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.merges[{rank}] = {merge!r} is not two tokens "
                            f"separated by one space")
        for piece in (parts[0], parts[1], parts[0] + parts[1]):
            if piece not in vocab:
                raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.merges[{rank}] = {merge!r} uses {piece!r}, "
                                f"which is not in tokenizer.ggml.tokens")
        pairs.append((parts[0], parts[1]))
    return pairs


def _post_processor(info: GGUFTokenizerInfo, file: GGUFFile) -> processors.PostProcessor | None:
    """A template adding BOS / EOS around each sequence when the file asks for them, else None."""
    if not (info.add_bos_token or info.add_eos_token):
        return None
    ends: dict[str, tuple[str, int]] = {}
    for flag, which, token, token_id in (("add_bos_token", "bos", info.bos_token, info.bos_token_id),
                                         ("add_eos_token", "eos", info.eos_token, info.eos_token_id)):
        if getattr(info, flag):
            if token_id is None or token is None:
                raise GGUFError(f"GGUF file {file.path}: tokenizer.ggml.{flag} is true but there is no "
                                f"tokenizer.ggml.{which}_token_id")
            ends[which] = (token, token_id)
    head = f"{ends['bos'][0]}:0 " if "bos" in ends else ""
    tail = f" {ends['eos'][0]}:0" if "eos" in ends else ""
    head_b = f"{ends['bos'][0]}:1 " if "bos" in ends else ""
    tail_b = f" {ends['eos'][0]}:1" if "eos" in ends else ""
    return processors.TemplateProcessing(single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail} {head_b}$B:1{tail_b}",
                                         special_tokens=list(dict.fromkeys(ends.values())))


def tokenizer_from_gguf(file: GGUFFile) -> Tokenizer:
    """The byte-level BPE tokenizer that ``file`` describes, pre-tokenizing as llama.cpp does for its pre type.

    Pre type 'smollm' (and its family) splits off every numeric character before the GPT-2 regex, as llama.cpp and
    SmolLM2's own ``tokenizer.json`` do; transformers' GGUF loader skips that split, so its ids differ on a whitespace
    run before a digit and around non-ASCII numerals. Raises GGUFError for an unsupported ``tokenizer.ggml.model``
    (only 'gpt2') or ``tokenizer.ggml.pre`` (see :data:`SUPPORTED_PRE_TYPES`), a missing vocabulary or merges, token
    types that do not match the vocabulary, and merges naming tokens outside it.
    """
    pre, tokens, types = _read_vocabulary(file)
    info = _info(file, pre, tokens, types)
    vocab = _vocab(file, tokens, types)
    model = BPE(vocab=vocab, merges=_merges(file, vocab), dropout=None, continuing_subword_prefix="",
                end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                ignore_merges=_PRE_TYPES[pre] == "llama3")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, kind in zip(tokens, types) if kind == _TYPE_CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind in zip(tokens, types) if kind == _TYPE_USER_DEFINED])
    post = _post_processor(info, file)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer


# --------------------------------------------------------------------------------------------------- chat template
def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts with str 'role' and 'content', got "
                         f"{type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content', got "
                             f"{type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a str, got {type(message.get(key)).__name__}")


@lru_cache(maxsize=16)
def _compiled_template(template: str) -> Any:
    """``template`` compiled in a sandbox with the globals and filters chat templates expect."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "", **extra: Any) -> str:
    """``messages`` (dicts with str 'role' and 'content') rendered with the jinja chat ``template``.

    Renders as transformers' ``apply_chat_template(..., tokenize=False)``: a sandboxed environment with
    ``trim_blocks``/``lstrip_blocks``, the ``raise_exception`` and ``strftime_now`` globals and a ``tojson`` filter
    that does not escape HTML. ``tools`` and ``documents`` are None unless given in ``extra``, which is passed to the
    template as further variables. Raises ValueError naming ``messages`` when they are malformed.
    """
    if not isinstance(template, str) or not template:
        raise ValueError("template must be a non-empty jinja chat template string")
    _check_messages(messages)
    variables = {"tools": None, "documents": None, **extra}
    return _compiled_template(template).render(messages=[dict(m) for m in messages],
                                               add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                                               eos_token=eos_token, **variables)


# --------------------------------------------------------------------------------------------------- streaming
class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class StreamDecoder:
    """Turns token ids, pushed as they are generated, into text pieces whose concatenation (with :meth:`flush`) is
    ``tokenizer.decode(all_ids, skip_special_tokens=...)``.

    A character split over several byte-level tokens is held back until it is complete (a lone part decodes to
    U+FFFD); everything before it is released at once. Only the last ``window`` ids are decoded again, so each push
    costs O(window + len(token_ids)).
    """

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = False, *, window: int = 8):
        if window < 4:
            raise ValueError(f"window must be at least 4 ids (an incomplete character spans up to 3), got {window}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.window = window
        self._ids: list[int] = []
        self._sent = 0  # characters of decode(self._ids) already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """The text completed by ``token_ids`` (possibly empty), given everything pushed before."""
        new = list(token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in new):
            raise ValueError(f"token_ids must be non-negative ints, got {new[:8]!r}")
        if not new:
            return ""
        self._ids.extend(new)
        text = self._decode(self._ids)
        # the last character stays unsent while it is U+FFFD: it may be the start of a character still arriving
        stable = len(text) - 1 if text.endswith("\ufffd") else len(text)
        piece = text[self._sent:stable] if stable > self._sent else ""
        self._sent = max(self._sent, stable)
        if len(self._ids) > self.window:
            self._trim(held=text[self._sent:])
        return piece

    def _trim(self, held: str) -> None:
        """Drop the ids before the last ``window`` whose text is all sent. A held character's bytes (at most 3, each
        id carrying at least one unless it decodes to nothing) lie in the last 3 ids that decode to something."""
        start = len(self._ids) - self.window
        if held:
            cover, carrying = len(self._ids), 0
            while cover > 0 and carrying < 3:
                cover -= 1
                carrying += bool(self._decode([self._ids[cover]]))
            start = min(start, cover)
        if start <= 0:
            return
        kept = self._ids[start:]
        kept_text = self._decode(kept)
        if kept_text.endswith(held):
            self._ids, self._sent = kept, len(kept_text) - len(held)

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD); the decoder starts afresh."""
        rest = self._decode(self._ids)[self._sent:] if self._ids else ""
        self._ids, self._sent = [], 0
        return rest


# --------------------------------------------------------------------------------------------------- HF files
def save_hf_tokenizer_files(file: GGUFFile, out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for ``file``'s tokenizer
    into ``out_dir`` (created if needed), loadable by ``transformers.AutoTokenizer.from_pretrained(out_dir)``."""
    out_dir = Path(out_dir)
    tokenizer = tokenizer_from_gguf(file)
    info = tokenizer_info(file)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {name: value for name, value in (("bos_token", info.bos_token), ("eos_token", info.eos_token),
                                               ("unk_token", info.unk_token), ("pad_token", info.pad_token))
               if value is not None}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                              "add_bos_token": info.add_bos_token, "add_eos_token": info.add_eos_token,
                              "clean_up_tokenization_spaces": False}
    arch = file.get("general.architecture", "str", None)
    context = file.get(f"{arch}.context_length", "int", None) if arch else None
    if context is not None:
        config["model_max_length"] = context
    if info.chat_template is not None:
        config["chat_template"] = info.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")

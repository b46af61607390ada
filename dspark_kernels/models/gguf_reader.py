"""Checked access to a GGUF file (llama.cpp's model format) through the ``gguf`` package's reader.

:class:`GGUFFile` opens a file, checks that every tensor's bytes lie inside it, and offers typed metadata reads
(:meth:`GGUFFile.get`) and dequantized tensors (:meth:`GGUFFile.tensor`). Every problem raises :class:`GGUFError`
naming the file and the key or tensor: a missing or truncated file, a metadata value of the wrong type, a missing
tensor, a quantization type that ``gguf`` cannot dequantize.

Tensor layout: GGUF lists a tensor's dimensions fastest-first (``ne[0]`` is the row length), so a linear weight of
``[out, in]`` in PyTorch is stored with shape ``(in, out)``; :meth:`GGUFFile.tensor` returns the PyTorch order.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import CheckpointError

__all__ = ["GGUFError", "GGUFFile", "is_gguf_file", "open_gguf"]

_MAGIC = b"GGUF"
_MISSING = object()
# metadata kind -> (check, description)
_KINDS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str_list": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "an array of strings"),
    "int_list": (lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
                 "an array of integers"),
}


class GGUFError(CheckpointError):
    """A GGUF file is unreadable, truncated, or lacks what the runtime needs (the message names it)."""


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


class GGUFFile:
    """A parsed GGUF file: ``path``, ``fields`` (metadata key -> raw field) and ``tensors`` (name -> reader tensor)."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        if not is_gguf_file(self.path):
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        try:
            reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError / IndexError / struct errors on short or bad files
            raise GGUFError(f"cannot read GGUF file {self.path} (truncated or corrupt?): {type(e).__name__}: {e}") \
                from e
        self.fields = reader.fields
        self.tensors = {t.name: t for t in reader.tensors}
        for t in reader.tensors:
            if t.data.nbytes != int(t.n_bytes):
                raise GGUFError(f"GGUF file {self.path} is truncated: tensor {t.name!r} needs {int(t.n_bytes)} bytes, "
                                f"{t.data.nbytes} are present")

    # ------------------------------------------------------------------ metadata
    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, kind: str, default: Any = _MISSING) -> Any:
        """The metadata value at ``key``, checked to be of ``kind`` (one of ``str``, ``int``, ``float``, ``bool``,
        ``str_list``, ``int_list``); ``default`` when absent, else :class:`GGUFError`."""
        check, what = _KINDS[kind]
        if key not in self.fields:
            if default is _MISSING:
                raise GGUFError(f"GGUF file {self.path} has no metadata key {key!r}")
            return default
        try:
            value = self.fields[key].contents()
        except Exception as e:
            raise GGUFError(f"GGUF file {self.path}: cannot decode metadata key {key!r}: {e}") from e
        if not check(value):
            shown = f"{type(value).__name__} {value!r}"[:80]
            raise GGUFError(f"GGUF file {self.path}: metadata key {key!r} must be {what}, got {shown}")
        return value

    # ------------------------------------------------------------------ tensors
    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32, in PyTorch's dimension order (GGUF's reversed)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if name not in self.tensors:
            raise GGUFError(f"GGUF file {self.path} has no tensor {name!r}")
        t = self.tensors[name]
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            values = dequantize(t.data, qtype)
        except NotImplementedError as e:
            raise GGUFError(f"GGUF file {self.path}: tensor {name!r} has quantization type {qtype.name}, which the "
                            f"gguf package cannot dequantize") from e
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = np.array(values, dtype=np.float32, copy=True).reshape(shape)  # own the bytes, not the file's map
        return torch.from_numpy(values)


def open_gguf(path: str | Path) -> GGUFFile:
    """The :class:`GGUFFile` of ``path``, shared by every caller while the file keeps its size and mtime: parsing a
    model file's metadata and tensor table takes seconds, and a model, its tokenizer and its stop tokens are read
    from the same file. (:meth:`GGUFFile.tensor` returns copies, so sharing is safe.)"""
    path = Path(path).resolve()
    if not path.is_file():
        return GGUFFile(path)  # raises, naming the path
    st = path.stat()
    return _open_unchanged(path, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _open_unchanged(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)

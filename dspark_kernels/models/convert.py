"""Convert a GGUF model into a Hugging Face directory: ``python -m dspark_kernels.models.convert SRC OUT_DIR``.

``SRC`` is a GGUF file or a registry name (``smollm2-135m-instruct`` is fetched on first use). ``OUT_DIR`` receives
``config.json``, ``model.safetensors`` (dequantized weights in ``--dtype``; a tied LM head is not stored twice),
``tokenizer.json``, ``tokenizer_config.json`` (with the chat template), ``special_tokens_map.json`` and
``generation_config.json`` (BOS, every EOS id the model stops at, PAD). Both :func:`~.transformer.load_model` and
``transformers``' Auto classes load the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from .gguf_reader import open_gguf
from .gguf_tokenizer import save_hf_tokenizer_files, tokenizer_info
from .gguf_weights import gguf_config_dict, load_gguf_state_dict
from .registry import resolve_model

__all__ = ["convert_gguf", "converted_directory", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "generation_config.json")


def convert_gguf(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                 overwrite: bool = False) -> Path:
    """Write the Hugging Face directory for the GGUF model ``src`` to ``out_dir``; return ``out_dir``.

    Refuses (``FileExistsError``) to replace files already in ``out_dir`` unless ``overwrite``."""
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    clash = [n for n in OUTPUT_FILES if (out / n).exists()]
    if clash and not overwrite:
        raise FileExistsError(f"{out} already holds {clash[0]}: pass overwrite=True (--force) to replace it")
    path = resolve_model(src)
    if path.is_dir():
        raise ValueError(f"{src} is already a Hugging Face directory ({path}); convert takes a GGUF file")
    f = open_gguf(path)
    config = gguf_config_dict(f)
    cfg, sd = load_gguf_state_dict(path, dtype=dtype)
    info = tokenizer_info(f)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["eos_token_id"] = list(info.eos_token_ids) if len(info.eos_token_ids) > 1 else info.eos_token_ids[0]
    if info.pad_token_id is not None:
        config["pad_token_id"] = info.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.contiguous() for k, v in sd.items() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": info.bos_token_id, "eos_token_id": list(info.eos_token_ids),
                  "pad_token_id": info.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_hf_tokenizer_files(f, out)
    return out


def converted_directory(source: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A Hugging Face directory for ``source``: itself when it is one, else its GGUF converted once (float32) into
    ``<cache>/converted/<file stem>`` (the cache of :mod:`dspark_kernels.assets.fetch`) and reused after."""
    from ..assets.fetch import default_cache_dir

    path = resolve_model(source)
    if path.is_dir():
        return path
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = out / "converted" / path.stem
    if all((out / n).is_file() for n in OUTPUT_FILES) and (out / "model.safetensors").stat().st_mtime >= \
            path.stat().st_mtime:
        return out
    partial = out.with_name(out.name + ".partial")  # converted whole, then renamed: never a half-written directory
    shutil.rmtree(partial, ignore_errors=True)
    convert_gguf(path, partial)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_kernels.models.convert", description=__doc__.split("\n")[0])
    p.add_argument("src", help="GGUF file, or a registry name such as smollm2-135m-instruct")
    p.add_argument("out_dir", type=Path, help="directory to write the Hugging Face checkpoint into")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of the stored weights (dequantized values are exact in float32)")
    p.add_argument("--force", action="store_true", help="replace checkpoint files already in OUT_DIR")
    args = p.parse_args(argv)
    if args.out_dir.exists() and not args.out_dir.is_dir():
        p.error(f"OUT_DIR {args.out_dir} exists and is not a directory")
    try:
        out = convert_gguf(args.src, args.out_dir, DTYPES[args.dtype], overwrite=args.force)
    except (OSError, ValueError, RuntimeError) as e:  # missing / clashing files, bad GGUF, failed fetch
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(OUTPUT_FILES)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

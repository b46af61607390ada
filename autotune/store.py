"""Launch-config store: ``configs/<gpu-name>.json`` keyed by op and shape bucket, with safe defaults.

File layout::

    {"gpu": "NVIDIA H200", "driver": "...", "ops": {"<op>": {"<bucket>": {"BLOCK_M": 64, "num_warps": 4, ...}}}}

``launch_config(op, defaults, device, bucket)`` returns ``defaults`` updated with the stored entry for the device's
GPU (exact bucket first, then the op's ``"default"`` bucket). Unknown GPUs and CPU tensors get the defaults.
A malformed file raises ``ValueError`` naming the file and the problem.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_INT_KEYS_OK = (int,)


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


@lru_cache(maxsize=None)
def device_name(index: int = 0) -> str:
    """The GPU's marketing name via nvidia-ml-py (falls back to torch); ``"cpu"`` without a GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # NVML missing or not permitted: torch still knows the name
        return torch.cuda.get_device_name(index)


def config_path(gpu: str, config_dir: Path = CONFIG_DIR) -> Path:
    return Path(config_dir) / f"{_sanitize(gpu)}.json"


def _check_store(data: object, path: Path) -> dict:
    if not isinstance(data, dict) or not isinstance(data.get("ops"), dict):
        raise ValueError(f"autotune config {path}: expected an object with an 'ops' object")
    for op, buckets in data["ops"].items():
        if not isinstance(buckets, dict):
            raise ValueError(f"autotune config {path}: ops.{op} must map bucket names to configs")
        for bucket, cfg in buckets.items():
            if not isinstance(cfg, dict) or not all(
                isinstance(k, str) and isinstance(v, _INT_KEYS_OK) and not isinstance(v, bool) and v > 0
                for k, v in cfg.items()
            ):
                raise ValueError(
                    f"autotune config {path}: ops.{op}.{bucket} must map parameter names to positive integers"
                )
    return data


@lru_cache(maxsize=None)
def load_store(path: Path) -> dict:
    """Read and validate one config file; a missing file is an empty store."""
    if not path.exists():
        return {"ops": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"autotune config {path} is not valid JSON: {e}") from e
    return _check_store(data, path)


def launch_config(
    op: str, defaults: dict[str, int], device: torch.device, bucket: str = "default", config_dir: Path = CONFIG_DIR
) -> dict[str, int]:
    """Launch parameters for ``op`` on ``device``: stored values over ``defaults``."""
    cfg = dict(defaults)
    if device.type != "cuda":
        return cfg
    store = load_store(config_path(device_name(device.index or 0), config_dir))
    entries = store["ops"].get(op, {})
    cfg.update(entries.get("default", {}))
    cfg.update(entries.get(bucket, {}))
    return cfg

"""Per-GPU launch configurations for the Triton ops (JSON files under ``configs/``, committed) and their loader."""

from .store import config_path, device_name, launch_config, load_store

__all__ = ["config_path", "device_name", "launch_config", "load_store"]

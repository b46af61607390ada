"""Model files: the demo models shipped in this folder, and the cache of models fetched on first use.

The shipped data (``target/``, ``assistant/``, ``drafters/``) is described in ``README.md`` here. Fetched models are
listed in :mod:`dspark_kernels.models.registry`; :mod:`dspark_kernels.assets.fetch` downloads and checks them, and
``python -m dspark_kernels.assets fetch`` does it from the command line.
"""

from .fetch import FetchError, default_cache_dir, fetch_model, is_cached, model_path

__all__ = ["FetchError", "default_cache_dir", "fetch_model", "is_cached", "model_path"]

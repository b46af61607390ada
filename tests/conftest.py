"""Test setup: Triton runs in its CPU interpreter when there is no GPU; every test is seeded."""

import os
import random

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (i.e. before dspark_kernels.ops is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The tests run many tiny ops (interpreted kernels, per-request loops): one intra-op thread is faster for them and
# immune to the catastrophic slow-down of oversubscribed OpenMP threads when the machine is busy.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_impl_override(monkeypatch):
    """Tests choose the implementation explicitly; a DSPARK_IMPL in the environment must not leak in."""
    monkeypatch.delenv("DSPARK_IMPL", raising=False)
    yield


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def smollm2_gguf():
    """The real target's GGUF, fetched into the cache on first use (CI fetches it before the tests; later lookups read
    the cache in well under a millisecond)."""
    from dspark_kernels.models.registry import resolve_model

    return resolve_model("smollm2-135m-instruct")

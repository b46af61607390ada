"""dspark-kernels: Triton kernels, each paired with a plain PyTorch reference, for DSpark-style speculative decoding.

Public ops live in :mod:`dspark_kernels.ops`; their PyTorch twins in :mod:`dspark_kernels.reference`; per-GPU launch
configs in :mod:`dspark_kernels.autotune`; the target runtime in :mod:`dspark_kernels.models`.
"""

__version__ = "0.1.0"

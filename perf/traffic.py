"""Count what a kernel does to global memory, under the Triton interpreter: bytes, programs, serial depth.

A GPU run times a kernel; this counts its structure on any machine, so a kernel's distance from the roofline shows
before a GPU does. Inside :func:`count_traffic` (Triton must run interpreted: ``TRITON_INTERPRET=1`` set before any
``@triton.jit`` function is defined), every ``tl.load`` and ``tl.store`` of every program is recorded:

* ``bytes_moved``: the bytes of the elements each load/store touches (its mask's true lanes times the element size),
  summed over every program of every launch. Every read counts, re-reads included: this is the traffic with no cache,
  what an op moves when its working set does not fit in L2 (a vocabulary-sized row per request does not).
* ``programs``: the grid size of each launch (``launches`` lists them in order).
* ``dependent_chain``: per launch, the most load/store instructions one program issues (a program issues its memory
  instructions in order, each a tile), summed over the launches (they run one after another): the serial depth of
  the op. A loop over ``V / BLOCK_V`` tiles in one program is ``V / BLOCK_V`` deep; the same tiles spread over a grid
  of programs are 1 deep.

PyTorch work in the op's launcher (allocations that are filled, copies, host-side reductions) is counted apart, as
``torch_bytes``: the input and output bytes of every aten op that reads or writes device memory (views and shape
queries excluded), so a launcher's memset of an ``[N, V]`` buffer shows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Traffic", "count_traffic"]


@dataclass
class Launch:
    programs: int
    instructions: list[int] = field(default_factory=list)  # per program (in grid order): loads + stores issued
    bytes: int = 0


@dataclass
class Traffic:
    """What :func:`count_traffic` saw (see the module docstring)."""

    launches: list[Launch] = field(default_factory=list)
    torch_bytes: int = 0

    @property
    def kernel_bytes(self) -> int:
        return sum(launch.bytes for launch in self.launches)

    @property
    def bytes_moved(self) -> int:
        return self.kernel_bytes + self.torch_bytes

    @property
    def programs(self) -> list[int]:
        return [launch.programs for launch in self.launches]

    @property
    def dependent_chain(self) -> int:
        return sum(max(launch.instructions, default=0) for launch in self.launches)


_VIEW_OPS = {"view", "_unsafe_view", "as_strided", "expand", "t", "transpose", "permute", "reshape", "squeeze",
             "unsqueeze", "select", "slice", "detach", "alias", "unbind", "split", "split_with_sizes", "chunk",
             "narrow", "lift_fresh", "empty", "empty_like", "empty_strided", "sym_size",
             "sym_stride", "sym_numel", "is_contiguous", "numel", "size", "stride", "dim", "_local_scalar_dense"}


class _TorchBytes(TorchDispatchMode):
    """Sums the bytes of every aten op's tensor inputs and outputs (views and allocations without a fill
    excluded)."""

    def __init__(self, traffic: Traffic, state: dict) -> None:
        super().__init__()
        self.traffic, self.state = traffic, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.state["in_kernel"] and func.__name__.split(".")[0] not in _VIEW_OPS:
            seen = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.traffic.torch_bytes += sum(t.numel() * t.element_size() for t in seen)
        return out


@contextlib.contextmanager
def count_traffic(torch_ops: bool = True):
    """Yield a :class:`Traffic` filled by every interpreted Triton launch (and, with ``torch_ops``, every aten op)
    inside the block."""
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    traffic = Traffic()
    saved = {name: getattr(builder_cls, name) for name in
             ("set_grid_dim", "set_grid_idx", "create_masked_load", "create_masked_store")}
    run_grid = interpreter.GridExecutor.__call__
    state = {"program": 0, "in_kernel": False}

    def grid_call(self, *args, **kwargs):  # the interpreter's own host copies of the arguments are not the op's
        state["in_kernel"] = True
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            state["in_kernel"] = False

    def set_grid_dim(self, x, y, z):
        traffic.launches.append(Launch(programs=x * y * z, instructions=[0] * (x * y * z)))
        state["program"] = -1
        return saved["set_grid_dim"](self, x, y, z)

    def set_grid_idx(self, x, y, z):
        state["program"] += 1
        return saved["set_grid_idx"](self, x, y, z)

    def record(ptrs, mask):
        launch = traffic.launches[-1]
        launch.instructions[state["program"]] += 1
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        launch.bytes += int(np.count_nonzero(mask.data)) * itemsize

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        record(ptrs, mask)
        return saved["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        record(ptrs, mask)
        return saved["create_masked_store"](self, ptrs, value, mask, cache_policy)

    for name, fn in (("set_grid_dim", set_grid_dim), ("set_grid_idx", set_grid_idx),
                     ("create_masked_load", create_masked_load), ("create_masked_store", create_masked_store)):
        setattr(builder_cls, name, fn)
    interpreter.GridExecutor.__call__ = grid_call
    try:
        with _TorchBytes(traffic, state) if torch_ops else contextlib.nullcontext():
            yield traffic
    finally:
        for name, fn in saved.items():
            setattr(builder_cls, name, fn)
        interpreter.GridExecutor.__call__ = run_grid

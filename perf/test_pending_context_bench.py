"""Engine host bookkeeping: the drafter's deferred context (:class:`~dspark_kernels.engine.rounds.PendingContext`).

Per round of R requests, each keeping 1-3 tokens with fp32 features ``[T, 3 * 256]`` (the shipped drafter's three
target layers): ``plain`` hands the round's kept tokens over only (a step with the draft gate closed), ``drafting``
hands them over and takes them back for the next draft (a batch that drafts every round: one whole round in its
order, returned without a copy), ``backlog`` takes 8 deferred rounds at once (a probe after plain steps: every chunk
sliced and concatenated). Bytes: the features and token ids a take copies (0 for ``plain`` and ``drafting``);
FLOPs 0. CPU only: the work is host indexing, whatever the device.
"""

import pytest
import torch

from dspark_kernels.engine.rounds import PendingContext
from perf.roofline import record

FEATURES = 3 * 256
ROUNDS = 8


def _rounds(r: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(r)
    out = []
    for _ in range(ROUNDS):
        rows = torch.randint(1, 4, (r,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)]).to(torch.int32)
        t = int(cu[-1])
        out.append((torch.randint(0, 8192, (t,), generator=gen), torch.randn(t, FEATURES, generator=gen), cu))
    return out


@pytest.mark.parametrize("r", [8, 64])
@pytest.mark.parametrize("scenario", ["plain", "drafting", "backlog"])
def test_pending_context(benchmark, scenario, r):
    rids, rounds, cpu = list(range(r)), _rounds(r), torch.device("cpu")

    def step():
        pending = PendingContext()
        for kept in rounds:
            pending.add(rids, kept)
            if scenario == "drafting":
                pending.take(rids, cpu)
        if scenario == "backlog":
            pending.take(rids, cpu)

    benchmark(step)
    rows = sum(int(kept[2][-1]) for kept in rounds)
    record(benchmark, shapes={"R": r, "rounds": ROUNDS, "features": FEATURES, "scenario": scenario},
           bytes_moved=2.0 * rows * (FEATURES * 4 + 8) if scenario == "backlog" else 0.0, flops=0.0, impl="torch")

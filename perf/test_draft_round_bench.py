"""Cost of the sequential head inside a draft round, with the shipped target and DSpark drafter (CPU path).

Times one draft-verify round at batch 1 and gamma 7, side by side in one run: the drafter's backbone pass, the
sequential head op with the shipped Markov head (vanilla, rank 64) as the drafter runs it (``head_vanilla``: with the
module's kept bias rows, :class:`~dspark_kernels.ops.sequential_head.MarkovBiasRows`, which hold this round's previous
tokens after the first call) and without them (``head_vanilla_product``: every slot's bias multiplied out), the same op
with no Markov bias (kind "none": the sampling a DFlash drafter needs anyway), and the target's verify forward. The
head's overhead on the round is ``(head_vanilla - head_none) / (backbone + head_vanilla + verify)`` (goal: <= 5% on the
CPU path; the paper reports <= 1.3% on GPU). Every part runs with fp32 and with weight-only bf16 GEMMs (the demo's
default).
"""

from pathlib import Path

import pytest
import torch

from dspark_kernels.drafters import load_drafter
from dspark_kernels.models import load_model
from dspark_kernels.ops import sequential_head
from dspark_kernels.ops.sequential_head import SequentialHeadWeights
from perf.costs import draft_block_cost, target_forward_cost
from perf.roofline import record

ASSETS = Path(__file__).resolve().parents[1] / "dspark_kernels" / "assets"
GAMMA, CTX = 7, 128


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request):
    """The shipped target and drafter with fp32 or weight-only bf16 GEMMs (``gemm_dtype``), one request prefilled."""
    target = load_model(ASSETS / "target", gemm_dtype=request.param)
    drafter = load_drafter(ASSETS / "drafters" / "dspark", target, gemm_dtype=request.param)
    ids = torch.randint(4, 8192, (CTX,), generator=torch.Generator().manual_seed(0))
    tcache = target.new_cache(CTX // 16 + 4, 16)
    tcache.add_request(0)
    out = target(ids, torch.tensor([0, CTX], dtype=torch.int32), [0], tcache, hidden_layers=drafter.feature_layers)
    dcache = drafter.new_state(CTX // 16 + 4, 16)
    dcache.add_request(0)
    feats = torch.cat([out.hidden_states[i] for i in drafter.feature_layers], -1)
    drafter.extend(dcache, [0], ids, feats, torch.tensor([0, CTX], dtype=torch.int32))
    anchor = torch.tensor([int(out.logits[-1].argmax())])
    prop = drafter.propose(dcache, [0], anchor, GAMMA)
    return target, drafter, tcache, dcache, anchor, prop


def _head(setup, weights):
    _, _, _, _, anchor, prop = setup
    zero = torch.zeros(1)
    return lambda: sequential_head(prop.base_logits, prop.hidden, anchor, prop.cu, weights, zero,
                                   torch.zeros(1, dtype=torch.int32), torch.ones(1), None, check_inputs=False)


def _parts(setup):
    target, drafter, tcache, dcache, anchor, prop = setup
    with torch.inference_mode():  # as BlockDrafter.draft asks for them
        w = drafter.head.weights()
    none = SequentialHeadWeights("none", conf_w=w.conf_w[: prop.hidden.shape[1]], conf_b=w.conf_b)
    block = torch.cat([anchor, torch.randint(4, 8192, (GAMMA,))])
    cu = torch.tensor([0, GAMMA + 1], dtype=torch.int32)

    def verify():
        target(block, cu, [0], tcache, hidden_layers=drafter.feature_layers, check_inputs=False)
        tcache.rollback(0, GAMMA + 1)

    return {
        "backbone": lambda: drafter.propose(dcache, [0], anchor, GAMMA),
        "head_vanilla": _head(setup, w),
        "head_vanilla_product": _head(setup, w._replace(bias_rows=None)),
        "head_none": _head(setup, none),
        "verify": verify,
    }


def _cost(setup, part: str) -> tuple[float, float]:
    """Each part's own bytes and FLOPs: the backbone and the verify forward as model passes (:mod:`perf.costs`), the
    head variants as vocabulary-row passes over the gamma slots (kind "none" at T = 0 is one argmax pass over the
    base logits)."""
    target, drafter = setup[0], setup[1]
    v, r = target.config.vocab_size, drafter.config.markov_rank
    if part == "backbone":
        return draft_block_cost(drafter, CTX, GAMMA)
    if part == "verify":
        return target_forward_cost(target, CTX, GAMMA + 1)
    rows = {"head_vanilla_product": r + 2, "head_vanilla": 3, "head_none": 1}[part]  # V-wide rows per slot
    return 4.0 * GAMMA * rows * v, (2.0 * GAMMA * r * v if part == "head_vanilla_product" else GAMMA * v)


@pytest.mark.parametrize("part", ["backbone", "head_vanilla", "head_vanilla_product", "head_none", "verify"])
def test_draft_round_part(benchmark, setup, part):
    fn = _parts(setup)[part]
    with torch.inference_mode():
        fn()
        benchmark(fn)
    v, r = setup[0].config.vocab_size, setup[1].config.markov_rank
    gemm = str(setup[0].lm_head.weight.dtype).removeprefix("torch.")
    bytes_moved, flops = _cost(setup, part)
    record(benchmark, shapes={"gamma": GAMMA, "ctx": CTX, "V": v, "rank": r, "part": part, "gemm_dtype": gemm},
           bytes_moved=bytes_moved, flops=flops, impl="torch")

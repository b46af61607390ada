"""End-to-end decode: the shipped target alone (AR) vs speculative decoding with each shipped block/chain drafter.

``dspark_adaptive`` is DSpark with the adaptive draft length (at most 15 a round; round costs measured when the case
starts, :mod:`dspark_kernels.engine.draft_length`); the other drafters draft ``GAMMA`` every round.

Batch 1, greedy, one code prompt, ``NEW`` tokens, the same process and the same thread count for every method, so the
records compare side by side. ``extra_info`` adds the measured tokens/s, the target forwards (steps) and tau; the
roofline figures are the target's weights read once per forward (``bytes``) and its matmul FLOPs (``flops``:
``2 * params`` per token through the decoder layers and per LM-head row, :func:`perf.costs.decode_flops`; a prefill
computes the logits of its last token only, and AR never feeds its last token back), which is what bounds the decode
on a GPU. Every method runs with fp32 and with
weight-only bf16 GEMMs (``gemm_dtype``, the demo's default) in the target; compare methods within one setting. The
drafters' own layers run fp32 GEMMs in both settings, as in the demo (``--drafter-gemm-dtype``).
"""

from pathlib import Path

import pytest
import torch

from dspark_kernels.drafters import load_drafter
from dspark_kernels.engine.draft_length import AdaptiveDraftLength, measure_round_costs
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate, load_model
from dspark_kernels.train.tokenizer import BOS_ID, EOS_ID, load_tokenizer
from perf.costs import decode_flops
from perf.roofline import record

ASSETS = Path(__file__).resolve().parents[1] / "dspark_kernels" / "assets"
NEW, GAMMA, ADAPTIVE_MAX = 48, 7, 15
DRAFTER_GEMM_DTYPE = "float32"  # the drafters' own layers in both target settings, as in the demo
PROMPT = "import os\n\n\ndef list_python_files(root):\n"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def models(request):
    target = load_model(ASSETS / "target", gemm_dtype=request.param)
    ids = [BOS_ID] + load_tokenizer(ASSETS / "target").encode(PROMPT).ids
    return target, ids, request.param


@pytest.mark.parametrize("method", ["ar", "dspark", "dspark_adaptive", "dflash", "eagle"])
def test_decode(benchmark, models, method):
    target, ids, gemm_dtype = models
    # weights read per forward: everything but the embedding table (the LM head counts, tied or not)
    read = [p for n, p in target.named_parameters(remove_duplicate=False) if n != "model.embed_tokens.weight"]
    weight_bytes = sum(p.numel() * p.element_size() for p in read)
    gamma, schedule = GAMMA, None
    if method == "ar":
        def run():
            return generate(target, [ids], NEW, eos_token_id=EOS_ID)
    else:
        drafter = load_drafter(ASSETS / "drafters" / method.removesuffix("_adaptive"), target,
                               gemm_dtype=DRAFTER_GEMM_DTYPE)
        if method.endswith("_adaptive"):  # measure_round_costs warms the drafter up itself
            gamma = ADAPTIVE_MAX
            schedule = AdaptiveDraftLength(measure_round_costs(target, drafter, ids, gamma))

        def run():
            return speculative_generate(target, drafter, [ids], NEW, gamma, eos_token_id=EOS_ID, draft_length=schedule)

    res = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    steps = res.steps
    if method == "ar":  # the prompt, then every generated token but the last; one LM-head row per forward
        through_layers, lm_head_rows = len(ids) + res.num_generated - 1, steps
    else:  # the prompt, then every round's anchor and verified drafts, each with its logits row
        verified = sum((l_r + 1) * n for l_r, row in enumerate(res.round_hist) for n in row)
        through_layers, lm_head_rows = len(ids) + verified, 1 + verified
    record(benchmark, shapes={"method": method, "new_tokens": NEW, "gamma": gamma, "batch": 1,
                              "gemm_dtype": gemm_dtype, "drafter_gemm_dtype": DRAFTER_GEMM_DTYPE},
           bytes_moved=steps * weight_bytes, flops=decode_flops(target, through_layers, lm_head_rows), impl="torch")
    benchmark.extra_info.update({"steps": steps, "tau": getattr(res, "tau", 1.0), "threads": torch.get_num_threads()})
    if benchmark.stats is not None:  # None under --benchmark-disable (the CI smoke run)
        benchmark.extra_info["tokens_per_s"] = res.num_generated / benchmark.stats.stats.median

"""Weight-only bf16 GEMMs (``gemm_dtype``): what is swapped, what is kept, and that decoding stays exact/lossless.

Within one GEMM setting every method must produce the target's own greedy text (T = 0) and the target's distribution
(T > 0); the target's text may differ between settings, which is why the demo runs every method in the same one.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark_kernels.drafters import load_drafter
from dspark_kernels.drafters.sequential_head import SequentialHead
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import gemm_dtype as gemm_dtype_mod
from dspark_kernels.models import generate, load_model
from dspark_kernels.models.gemm_dtype import CastGemmLinear, cast_gemm_weights, parse_gemm_dtype
from dspark_kernels.reference._tensor_key import tensor_key
from tests.lossless import assert_follows_target
from tests.test_chain_drafter import make_drafter as make_chain_drafter
from tests.test_drafter_engine import make_drafter
from tests.tiny_models import save_tiny_qwen3

VOCAB = 96


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def bf16_pair(target_dir, tmp_path_factory):
    """(fp32 target, bf16-GEMM target, bf16-GEMM DSpark drafter saved from a random fp32 one)."""
    fp32 = load_model(target_dir)
    out = tmp_path_factory.mktemp("drafter")
    make_drafter(fp32).save(out)
    bf16 = load_model(target_dir, gemm_dtype="bfloat16")
    return fp32, bf16, load_drafter(out, bf16, gemm_dtype=torch.bfloat16)


def test_cast_linear_matches_a_bf16_gemm_and_keeps_the_activation_dtype():
    torch.manual_seed(1)
    lin = nn.Linear(40, 24, bias=True)
    cast = CastGemmLinear(lin, torch.bfloat16)
    x = torch.randn(5, 40)
    y = cast(x)
    assert y.dtype == torch.float32 and y.shape == (5, 24)
    assert cast.weight.dtype == torch.bfloat16 and not cast.weight.requires_grad
    expected = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()).float()
    assert torch.equal(y, expected)
    torch.testing.assert_close(y, lin(x), rtol=0.05, atol=0.05)  # close to fp32, not equal


def test_swaps_every_linear_but_the_skipped_and_unties_the_lm_head(bf16_pair):
    fp32, bf16, drafter = bf16_pair
    assert not any(isinstance(m, nn.Linear) for m in bf16.modules())
    assert bf16.lm_head.weight.dtype == torch.bfloat16 and bf16.model.embed_tokens.weight.dtype == torch.float32
    assert bf16.dtype == torch.float32  # activations and the KV cache stay fp32
    assert torch.equal(bf16.lm_head.weight.float(), fp32.lm_head.weight.bfloat16().float())
    heads = [m for m in drafter.modules() if isinstance(m, SequentialHead)]
    assert len(heads) == 1 and all(p.dtype == torch.float32 for p in heads[0].parameters())
    assert isinstance(drafter.fc, CastGemmLinear) and drafter.dtype == torch.float32
    unchanged = cast_gemm_weights(nn.Sequential(nn.Linear(4, 4)), "float32")
    assert isinstance(unchanged[0], nn.Linear)  # already in that dtype: nothing to do


def test_bad_gemm_dtype_is_a_clear_error(target_dir):
    for bad in ("fp8", torch.float16, 3):
        with pytest.raises(ValueError, match="gemm_dtype must be one of"):
            parse_gemm_dtype(bad)
    with pytest.raises(ValueError, match="gemm_dtype"):
        load_model(target_dir, gemm_dtype="int8")


def test_greedy_speculative_equals_target_greedy_with_bf16_gemms(bf16_pair):
    _, bf16, drafter = bf16_pair
    prompts = [[1, 5, 9, 13], [1, 40], [1] + list(range(20, 45))]
    ar = generate(bf16, prompts, 24, temperature=0.0)
    for gamma in (1, 4, 7):
        spec = speculative_generate(bf16, drafter, prompts, 24, gamma, temperature=0.0)
        assert spec.tokens == ar.tokens, gamma
        assert spec.rounds > 0


@pytest.mark.parametrize("target_gemm,drafter_gemm", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_drafter_gemm_dtype_apart_from_the_target(target_dir, bf16_pair, tmp_path, target_gemm, drafter_gemm):
    """The drafter's own layers follow its ``gemm_dtype``, its LM head stays the target's; greedy output is still the
    target's."""
    make_drafter(bf16_pair[0]).save(tmp_path)
    target = load_model(target_dir, gemm_dtype=target_gemm)
    drafter = load_drafter(tmp_path, target, gemm_dtype=drafter_gemm)
    assert drafter.fc.weight.dtype == parse_gemm_dtype(drafter_gemm)
    assert target.lm_head.weight.dtype == parse_gemm_dtype(target_gemm)
    prompts = [[1, 5, 9, 13], [1] + list(range(20, 45))]
    for gamma in (1, 5):
        spec = speculative_generate(target, drafter, prompts, 20, gamma, temperature=0.0)
        assert spec.tokens == generate(target, prompts, 20, temperature=0.0).tokens, gamma


@pytest.mark.parametrize("name,steps", [("eagle", 4), ("mtp1", 1)])
def test_chain_drafters_with_bf16_gemms_equal_target_greedy(target_dir, bf16_pair, tmp_path, name, steps):
    fp32, bf16, _ = bf16_pair
    make_chain_drafter(fp32, max_steps=steps, name=name).save(tmp_path)
    drafter = load_drafter(tmp_path, bf16, gemm_dtype="bfloat16")
    assert isinstance(drafter.fc, CastGemmLinear) and drafter.dtype == torch.float32
    prompts = [[1, 5, 9, 13], [1] + list(range(20, 45))]
    spec = speculative_generate(bf16, drafter, prompts, 20, steps, temperature=0.0)
    assert spec.tokens == generate(bf16, prompts, 20, temperature=0.0).tokens


def test_sampled_speculative_with_bf16_gemms_is_lossless(bf16_pair):
    _, bf16, drafter = bf16_pair
    prompt, n, steps = [1, 11, 12], 3000, 3
    spec = speculative_generate(bf16, drafter, [prompt] * n, steps, 3, temperature=1.0, seeds=list(range(n)))
    assert 0 < sum(spec.accept_hist[1:]) and spec.accept_hist[0] > 0
    assert_follows_target(bf16, prompt, spec.tokens, 1.0, steps)


needs_onednn_bf16 = pytest.mark.skipif(not gemm_dtype_mod._ONEDNN_BF16, reason="no oneDNN bf16 support on this CPU")


@needs_onednn_bf16
@pytest.mark.parametrize("shape", [(0, 40), (1, 40), (8, 40), (120, 40), (3, 5, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_bf16_gemm_is_bit_identical_to_the_plain_one(shape, with_bias):
    torch.manual_seed(2)
    weight = torch.randn(24, 40).bfloat16()
    bias = torch.randn(24).bfloat16() if with_bias else None
    x = torch.randn(*shape)
    pack = gemm_dtype_mod.PackedWeight()
    with torch.no_grad():
        y = gemm_dtype_mod.low_precision_linear(x, weight, bias, pack)
    assert pack.packed is not None  # the packed path ran
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x.bfloat16(), weight, bias).float())


@needs_onednn_bf16
def test_prepacked_weight_follows_in_place_updates_and_replacement():
    torch.manual_seed(3)
    lin = CastGemmLinear(nn.Linear(16, 8, bias=False), torch.bfloat16)
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2)  # in place: the version changes, the pack is redone
        assert torch.equal(lin(x), F.linear(x.bfloat16(), lin.weight).float())
        assert not torch.equal(lin(x), before)
        lin.weight = nn.Parameter(torch.ones(8, 16, dtype=torch.bfloat16), requires_grad=False)
        assert torch.equal(lin(x), F.linear(x.bfloat16(), lin.weight).float())
        lin.weight.data = torch.full((8, 16), 3.0, dtype=torch.bfloat16)  # same object, new storage
        assert torch.equal(lin(x), F.linear(x.bfloat16(), lin.weight).float())
    assert lin._pack.key == tensor_key(lin.weight)  # only the current weight's pack is kept


def test_plain_gemm_where_packing_does_not_apply():
    torch.manual_seed(4)
    weight = torch.randn(8, 16).bfloat16()
    x = torch.randn(3, 16)
    pack = gemm_dtype_mod.PackedWeight()
    y = gemm_dtype_mod.low_precision_linear(x, weight, None, pack)  # autograd on: plain F.linear
    with torch.inference_mode():
        frozen = torch.randn(8, 16).bfloat16()  # an inference tensor has no version counter
        z = gemm_dtype_mod.low_precision_linear(x, frozen, None, pack)
    fp32 = gemm_dtype_mod.low_precision_linear(x, weight.float(), None, pack)
    assert pack.packed is None
    assert torch.equal(y, F.linear(x.bfloat16(), weight).float())
    assert torch.equal(z, F.linear(x.bfloat16(), frozen).float())
    assert torch.equal(fp32, F.linear(x, weight.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_single_row_gemms_give_a_row_the_bits_it_gets_among_others(dtype):
    """``pad_single_row_gemms`` (the batch-invariant mode): a row alone and the same row among 2..9 others come out
    with the same bits, through plain and fused layers; the layers keep their weights (a tied one stays shared)."""
    from dspark_kernels.models.fused_linear import FusedLinear
    from dspark_kernels.models.gemm_dtype import pad_single_row_gemms

    torch.manual_seed(3)
    emb = nn.Embedding(4096, 576)
    model = nn.Sequential(nn.Linear(576, 1536), nn.Linear(1536, 576, bias=False), nn.Linear(576, 4096, bias=False))
    model[2].weight = emb.weight
    cast_gemm_weights(model, dtype)
    fused = FusedLinear([model[0], nn.Linear(576, 64).to(model[0].weight.dtype)])
    pad_single_row_gemms(model)
    fused.min_rows = 2
    assert all(isinstance(m, CastGemmLinear) and m.min_rows == 2 for m in model)
    if dtype == torch.float32:
        assert model[2].weight.data_ptr() == emb.weight.data_ptr()
    x = torch.randn(9, 576) * 3
    with torch.no_grad():
        for rows in (1, 2, 9):
            for i in range(rows):
                h = model[0](x[:rows])
                assert torch.equal(model[0](x[i:i + 1]), h[i:i + 1])
                assert torch.equal(fused.output(x[i:i + 1]), fused.output(x[:rows])[i:i + 1])
                h2 = model[1](h)
                assert torch.equal(model[1](h[i:i + 1]), h2[i:i + 1])
                assert torch.equal(model[2](h2[i:i + 1]), model[2](h2)[i:i + 1])

"""The model forward's inference-time work: fused q/k/v and gate/up projections (same outputs, same state dict, no
extra weight memory) and one attention plan per forward."""

import pytest
import torch
from torch import nn

from dspark_kernels.models import CausalLM, generate, load_model
from dspark_kernels.models.fused_linear import FusedLinear
from dspark_kernels.models.gemm_dtype import cast_gemm_weights
from tests.tiny_models import save_tiny_qwen3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"), vocab_size=96, peak=1.0)


def unfused_copy(model: CausalLM, gemm_dtype=None) -> CausalLM:
    """The same weights in a freshly built model whose projections run one by one."""
    plain = CausalLM(model.config)
    plain.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return cast_gemm_weights(plain.eval().requires_grad_(False), gemm_dtype)


def forward_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Prefill all but the last 3 tokens, then a 3-token verify chunk: logits of both calls, concatenated."""
    cache = model.new_cache(8, 4)
    cache.add_request(0)
    out = []
    for chunk in (ids[:-3], ids[-3:]):
        t = torch.tensor(chunk)
        out.append(model(t, torch.tensor([0, len(chunk)], dtype=torch.int32), [0], cache).logits)
    return torch.cat(out)


def test_state_dict_names_and_weight_memory_are_unchanged(target_dir):
    model = load_model(target_dir)
    assert model.state_dict().keys() == CausalLM(model.config).state_dict().keys()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = attn.fused_qkv.weight
    assert fused.shape[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    # the layers' weights are views of the fused one: no second copy
    row = fused.stride(0) * fused.element_size()
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused.data_ptr() + attn.q_proj.out_features * row
    assert mlp.up_proj.weight.data_ptr() == mlp.fused_gate_up.weight.data_ptr() + mlp.gate_proj.out_features * (
        mlp.fused_gate_up.weight.stride(0) * mlp.fused_gate_up.weight.element_size())
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("gemm_dtype,tol", [(None, 1e-5), ("bfloat16", 2e-2)])
def test_fused_projections_compute_what_the_separate_ones_do(target_dir, gemm_dtype, tol):
    fused = load_model(target_dir, gemm_dtype=gemm_dtype)
    plain = unfused_copy(fused, gemm_dtype)
    assert fused.model.layers[0].self_attn.fused_qkv is not None and plain.model.layers[0].self_attn.fused_qkv is None
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.testing.assert_close(forward_logits(fused, ids), forward_logits(plain, ids), rtol=tol, atol=tol)
    if gemm_dtype is None:  # same greedy text
        assert generate(fused, [ids[:4]], 12).tokens == generate(plain, [ids[:4]], 12).tokens


def test_parts_from_first_on_use_only_their_rows():
    torch.manual_seed(2)
    layers = [nn.Linear(8, 3), nn.Linear(8, 5), nn.Linear(8, 2)]
    x = torch.randn(4, 8)
    expected = [layer(x) for layer in layers]
    fused = FusedLinear(layers)
    for got, want in zip(fused(x), expected):
        torch.testing.assert_close(got, want)
    tail = fused(x, first=1)
    assert [t.shape[1] for t in tail] == [5, 2]
    for got, want in zip(tail, expected[1:]):
        torch.testing.assert_close(got, want)


def test_keys_values_alone_match_the_unfused_layer(target_dir):
    fused = load_model(target_dir)
    plain = unfused_copy(fused)
    x = torch.randn(5, fused.config.hidden_size)
    cos, sin = fused._rope(torch.arange(5), x.dtype)
    for a, b in zip(fused.model.layers, plain.model.layers):
        for got, want in zip(a.self_attn.keys_values(x, cos, sin), b.self_attn.keys_values(x, cos, sin)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_weight_replaced_after_fusion_is_caught(target_dir):
    model = load_model(target_dir)
    attn = model.model.layers[1].self_attn
    attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match="replaced after fusion"):
        forward_logits(model, [1, 2, 3, 4, 5])


def test_mismatched_layers_are_refused():
    with pytest.raises(ValueError, match="input size"):
        FusedLinear([nn.Linear(4, 3), nn.Linear(5, 3)])
    with pytest.raises(ValueError, match="all have a bias"):
        FusedLinear([nn.Linear(4, 3), nn.Linear(4, 3, bias=False)])


def test_a_forward_plans_its_attention_once_for_every_layer(target_dir, monkeypatch):
    """The CPU reference path plans the attention's index work once per forward, not once per layer."""
    import importlib

    import dspark_kernels.models.transformer as transformer

    op = importlib.import_module("dspark_kernels.ops.verify_attention")  # the package attribute is the function

    plans, unplanned = [], []
    real_plan, real_ref = transformer.plan_verify_attention, op.verify_attention_ref
    monkeypatch.setattr(transformer, "plan_verify_attention", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(op, "verify_attention_ref",
                        lambda *a: unplanned.append(a[-1] is None) or real_ref(*a))
    model = load_model(target_dir)
    forward_logits(model, [1, 2, 3, 4, 5, 6])  # two forwards
    assert len(plans) == 2 and len(unplanned) == 2 * model.config.num_hidden_layers and not any(unplanned)


def test_kept_qk_norm_weights_follow_updates(target_dir):
    """The fused path keeps the concatenated q/k norm weights between forwards; an in-place update or a replaced
    weight is seen by the next forward (it matches an unfused copy of the updated model)."""
    model = load_model(target_dir)
    attn = model.model.layers[0].self_attn
    forward_logits(model, [1, 2, 3, 4, 5])
    kept = attn._qk_norm_weights()
    assert attn._qk_norm_weights() is kept  # unchanged weights: no new concatenation
    with torch.no_grad():
        attn.k_norm.weight.mul_(1.5)
    assert attn._qk_norm_weights() is not kept
    ids, tol = [1, 2, 3, 4, 5], dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(forward_logits(model, ids), forward_logits(unfused_copy(model), ids), **tol)
    attn.q_norm.weight = nn.Parameter(attn.q_norm.weight * 0.5, requires_grad=False)
    torch.testing.assert_close(forward_logits(model, ids), forward_logits(unfused_copy(model), ids), **tol)


def test_column_major_weights_keep_values_and_row_count_invariance():
    """:func:`column_major_weights` changes only the memory order (same shape, values, names; fused parts stay
    column-major), a tied LM head gets its own copy, and from two rows on a row's output bits do not depend on how
    many rows share the GEMM (what batch-invariant decoding relies on)."""
    import torch.nn.functional as F

    from dspark_kernels.models.weight_layout import column_major_weights, is_column_major

    torch.manual_seed(0)
    emb = nn.Embedding(300, 64)
    head = nn.Linear(64, 300, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "proj": nn.Linear(64, 96)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    column_major_weights(model)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert is_column_major(model["head"].weight) and is_column_major(model["proj"].weight)
    assert model["emb"].weight.is_contiguous() and model["head"].weight is not model["emb"].weight
    fused = FusedLinear([nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)])
    assert not is_column_major(fused.weight)
    parts = column_major_weights(nn.ModuleList([nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)]))
    assert is_column_major(FusedLinear(list(parts)).weight)
    x = torch.randn(40, 64)
    w = model["proj"].weight
    full = F.linear(x, w)
    for rows in (2, 3, 8, 17, 33):
        assert torch.equal(F.linear(x[:rows], w), full[:rows])

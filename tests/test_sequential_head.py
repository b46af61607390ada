"""sequential_head: Triton (interpreted on CPU) vs reference parity for every head kind, train/inference consistency
of the module, statistical check that the emitted draft probabilities are what the tokens were drawn from, the
degenerate kinds, and input validation."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from scipy import stats

import dspark_kernels.reference.sequential_head as ref_module
from dspark_kernels.drafters.sequential_head import SequentialHead
from dspark_kernels.noise import uniform_noise
from dspark_kernels.ops import sequential_head
from dspark_kernels.ops.sequential_head import SequentialHeadWeights
from dspark_kernels.reference._sampling import inverse_cdf_ref, target_probs_ref

KINDS = ["none", "vanilla", "gated", "rnn"]

# ----------------------------------------------------------------------------------------------------------- helpers


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)


def make_weights(kind: str, v: int, d: int, r: int, scale: float = 0.5) -> SequentialHeadWeights:
    """Random weights in the op's layout, large enough that the bias moves the samples."""
    if kind == "none":
        return SequentialHeadWeights("none", conf_w=torch.randn(d) * 0.1, conf_b=torch.tensor(0.3))
    fields = dict(
        w1=torch.randn(v, r) * scale, w2=torch.randn(r, v) * scale,
        conf_w=torch.randn(d + r) * 0.1, conf_b=torch.tensor(-0.2),
    )
    if kind == "gated":
        fields.update(gate_w=torch.randn(d + r, r) * 0.3, gate_b=torch.randn(r) * 0.1)
    if kind == "rnn":
        fields.update(rnn_w=torch.randn(2 * r + d, 3 * r) * 0.3, rnn_b=torch.randn(3 * r) * 0.1)
    return SequentialHeadWeights(kind, **fields)


def make_args(
    lens: list[int],
    v: int,
    kind: str = "vanilla",
    *,
    d: int = 12,
    r: int = 8,
    temps: list[float] | None = None,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """A random ragged batch as keyword arguments of ``sequential_head``."""
    n, num_req = sum(lens), len(lens)
    temps = temps if temps is not None else [1.0] * num_req
    return dict(
        base_logits=(torch.randn(n, v) * 2).to(dtype),
        hidden=torch.randn(n, d),
        anchor_tokens=torch.randint(0, v, (num_req,)),
        cu_num_draft_tokens=_cu(lens),
        weights=make_weights(kind, v, d, r),
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64) if top_k is not None else None,
        top_p=torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None,
        uniforms=torch.rand(n).clamp(1e-7, 1 - 1e-7),
    )


def run_both(args: dict):
    """Run Triton and the reference: tokens bit-equal, probabilities and confidences fp32-close; return the ref."""
    tri = sequential_head(**args, impl="triton")
    ref = sequential_head(**args, impl="torch")
    assert torch.equal(tri.tokens, ref.tokens)
    if args["uniforms"] is None:  # all greedy: no distributions are written
        assert tri.draft_probs is None and ref.draft_probs is None
    else:
        torch.testing.assert_close(tri.draft_probs, ref.draft_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tri.confidence_logits, ref.confidence_logits, rtol=1e-5, atol=1e-5)
    check_structure(args, ref)
    return ref


def check_structure(args: dict, res) -> None:
    """Dtypes, rows summing to 1, the token inside its row's support, one-hot rows for greedy requests (without
    uniforms: the tokens are the rows' argmax and there are no rows)."""
    n, v = args["base_logits"].shape
    if args["uniforms"] is None:
        assert res.tokens.dtype == torch.int64 and res.tokens.shape == (n,) and res.draft_probs is None
        return
    assert res.tokens.dtype == torch.int64 and res.draft_probs.dtype == torch.float32
    assert res.confidence_logits.dtype == torch.float32 and res.draft_probs.shape == (n, v)
    if n == 0:
        return
    torch.testing.assert_close(res.draft_probs.sum(dim=1), torch.ones(n), rtol=0, atol=1e-5)
    assert bool((res.draft_probs.gather(1, res.tokens[:, None]) > 0).all())
    cu = args["cu_num_draft_tokens"]
    slot_temp = torch.repeat_interleave(args["temperature"], cu[1:] - cu[:-1])
    greedy_rows = res.draft_probs[slot_temp == 0]
    assert bool(((greedy_rows == 0) | (greedy_rows == 1)).all())


# ----------------------------------------------------------------------------------------------------- parity tests


@pytest.mark.parametrize("kind", KINDS)
def test_parity_ragged_mixed(kind):
    args = make_args([3, 0, 2, 5, 0, 1], 300, kind, temps=[1.0, 0.7, 0.0, 1.3, 1.0, 0.0])
    run_both(args)


@pytest.mark.parametrize("kind", KINDS)
def test_parity_all_greedy_without_uniforms(kind):
    args = make_args([4, 1, 0, 3], 200, kind, temps=[0.0] * 4)
    args["uniforms"] = None
    res = run_both(args)
    with_uniforms = sequential_head(**{**args, "uniforms": torch.full((8,), 0.5)}, impl="torch")
    assert torch.equal(res.tokens, with_uniforms.tokens)  # the same argmax drafts as a greedy row with uniforms
    assert bool((with_uniforms.draft_probs.max(dim=1).values == 1).all())


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_parity_top_k_top_p(kind):
    args = make_args(
        [3, 2, 4, 0, 2], 40, kind,
        temps=[1.0, 0.5, 2.0, 1.0, 0.0], top_k=[0, 1, 5, 3, 2], top_p=[0.9, 1.0, 0.5, 0.3, 0.8],
    )
    res = run_both(args)
    assert bool(((res.draft_probs[3:5] > 0).sum(dim=1) == 1).all())  # request 1 has top-k 1


def test_parity_filtered_rows_by_candidates_and_by_radix_select(monkeypatch):
    """Filtered rows over several candidate groups: rows whose tile candidates settle the cuts (random rows, small
    k) and rows they cannot (a top-k set crowded into one tile, a flat row under top-p), which take the radix select;
    both kinds must occur, and every token and row matches the reference."""
    op = importlib.import_module("dspark_kernels.ops.sequential_head")
    monkeypatch.setattr(op, "GROUP_V", 1024)  # 1100 columns in 2 groups of 8 tiles
    seen = []
    radix = op.radix_cuts

    def spy(values, row_map, row_req, temp, top_k, top_p, stats, cfg):
        seen.append((temp > 0) & (stats.by_candidates == 0))
        seen.append((temp > 0) & (stats.by_candidates != 0))
        radix(values, row_map, row_req, temp, top_k, top_p, stats, cfg)

    monkeypatch.setattr(op, "radix_cuts", spy)
    args = make_args([2, 3, 2, 1], 1100, "vanilla", r=4, temps=[1.0, 0.8, 1.0, 1.0], top_k=[5, 40, 0, 3],
                     top_p=[1.0, 0.9, 0.6, 0.95])
    args["base_logits"][2:5, 600:640] += 30.0  # request 1: its top-40 set in one 128-column tile
    args["base_logits"][5:7] = 0.0  # request 2: a flat row under top-p 0.6
    args["weights"] = args["weights"]._replace(w2=args["weights"].w2 * 0.01)
    run_both(args)
    unresolved, resolved = torch.stack(seen[0::2]), torch.stack(seen[1::2])
    assert bool(unresolved[:, 1].any()) and bool(unresolved[:, 2].any())
    assert bool(resolved[:2, 0].all()) and bool(resolved[:1, 3].all())  # every slot of requests 0 (2) and 3 (1)


@pytest.mark.parametrize("v", [1023, 1025, 4097])
def test_parity_vocab_edges(v):
    run_both(make_args([2, 0, 3], v, "vanilla", r=4, temps=[1.0, 1.0, 0.0]))


def test_parity_large_rank_and_hidden_tiles():
    run_both(make_args([3, 2], 130, "rnn", d=70, r=35, temps=[1.0, 0.0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parity_half_base_logits(dtype):
    args = make_args([3, 1, 2], 257, "gated", temps=[1.0, 0.0, 0.6], dtype=dtype)
    args["hidden"] = args["hidden"].to(dtype)
    run_both(args)


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_parity_bf16_weights(kind):
    """A bf16 checkpoint's weights: the vocab launch multiplies ``lat @ w2`` as three bf16 pieces of ``lat``
    (``_split_bf16_dot``), at float32 accuracy, with ``top_k`` / ``top_p`` rows among them. A vanilla latent is a
    bf16 row of ``w1`` (its lower pieces are zero); the rnn latent needs all three (the hi piece alone fails)."""
    args = make_args([3, 1, 2], 300, kind, d=20, r=16, temps=[1.0, 0.0, 0.7], top_k=[0, 0, 40], top_p=[1.0, 1.0, 0.9])
    w = args["weights"]
    args["weights"] = w._replace(**{name: t.to(torch.bfloat16) for name, t in w._asdict().items()
                                    if isinstance(t, torch.Tensor)})
    assert args["weights"].w2.dtype == torch.bfloat16
    run_both(args)


def test_no_requests_and_no_slots():
    for lens in ([], [0, 0]):
        args = make_args(lens, 50, "rnn")
        for impl in ("triton", "torch"):
            res = sequential_head(**args, impl=impl)
            assert res.tokens.shape == (0,) and res.draft_probs.shape == (0, 50)


# --------------------------------------------------------------------------------------------- degenerate kinds


def test_kind_none_is_plain_filtered_sampling():
    args = make_args([3, 2, 4], 60, "none", temps=[1.0, 0.5, 0.0], top_k=[0, 7, 0], top_p=[0.9, 1.0, 1.0])
    res = run_both(args)
    slot_req = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 2, 4]))
    probs = target_probs_ref(
        args["base_logits"], args["temperature"][slot_req], args["top_k"][slot_req], args["top_p"][slot_req]
    )
    sampled = inverse_cdf_ref(probs, args["uniforms"])
    greedy = args["temperature"][slot_req] == 0
    assert torch.equal(res.tokens, torch.where(greedy, args["base_logits"].argmax(dim=1), sampled))
    torch.testing.assert_close(res.draft_probs[~greedy], probs[~greedy], rtol=0, atol=0)
    h = args["hidden"]
    torch.testing.assert_close(res.confidence_logits, h @ args["weights"].conf_w + args["weights"].conf_b)


def test_greedy_is_argmax_of_base_plus_bias():
    args = make_args([4], 90, "vanilla", temps=[0.0])
    res = run_both(args)
    w = args["weights"]
    prev = torch.cat([args["anchor_tokens"], res.tokens[:-1]])
    logits = args["base_logits"] + w.w1[prev] @ w.w2
    assert torch.equal(res.tokens, logits.argmax(dim=1))
    assert not torch.equal(res.tokens, args["base_logits"].argmax(dim=1))  # the bias matters here


def test_greedy_ties_take_lowest_index_across_tiles():
    args = make_args([2], 1100, "vanilla", temps=[0.0])
    args["weights"] = args["weights"]._replace(w2=torch.zeros_like(args["weights"].w2))
    args["base_logits"] = torch.zeros(2, 1100)
    args["base_logits"][:, [700, 1030, 520]] = 5.0
    res = run_both(args)
    assert res.tokens.tolist() == [520, 520]


# ----------------------------------------------------------------------------------- module (train / inference)


def _random_module(kind: str, v: int, d: int, rank: int) -> SequentialHead:
    head = SequentialHead(v, d, rank, kind="vanilla" if kind == "none" else kind)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    return head


@pytest.mark.parametrize("kind, impl", [*[(k, "torch") for k in KINDS], ("rnn", "triton"), ("gated", "triton")])
def test_teacher_forced_matches_sampling(kind, impl):
    """Replaying the sampled block with its own tokens as ``prev_tokens`` reproduces draft probs and confidences."""
    b, g, v, d = 5, 4, 70, 10
    head = _random_module(kind, v, d, 0 if kind == "none" else 6)
    base, hidden = torch.randn(b, g, v) * 2, torch.randn(b, g, d)
    anchor = torch.randint(0, v, (b,))
    temp = torch.tensor([1.0, 0.0, 0.7, 1.0, 0.0])
    top_k, top_p = torch.tensor([0, 0, 5, 0, 0]), torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0])
    res = head.sample(
        base.reshape(b * g, v), hidden.reshape(b * g, d), anchor, _cu([g] * b), temp, top_k, top_p,
        torch.rand(b * g), impl=impl,
    )
    tokens = res.tokens.reshape(b, g)
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    logits, conf = head.teacher_forced(base, hidden, prev)
    assert logits.dtype == torch.float32 and logits.shape == (b, g, v)
    rep = lambda t: t.repeat_interleave(g)  # noqa: E731
    probs = target_probs_ref(logits.detach().reshape(b * g, v), rep(temp), rep(top_k), rep(top_p))
    stochastic = rep(temp) > 0
    torch.testing.assert_close(res.draft_probs[stochastic], probs[stochastic], rtol=1e-5, atol=1e-6)
    assert torch.equal(res.tokens[~stochastic], logits.detach().reshape(b * g, v)[~stochastic].argmax(dim=1))
    torch.testing.assert_close(res.confidence_logits, conf.detach().reshape(-1), rtol=1e-5, atol=1e-5)


def test_module_init_bias_is_zero_and_trainable():
    head = SequentialHead(50, 8, 4, kind="rnn")
    base, hidden = torch.randn(2, 3, 50, dtype=torch.bfloat16), torch.randn(2, 3, 8)
    logits, conf = head.teacher_forced(base, hidden, torch.randint(0, 50, (2, 3)))
    assert torch.equal(logits, base.float())
    (logits.logsumexp(-1).sum() + conf.sum()).backward()
    assert all(p.grad is not None for p in head.parameters())


def test_module_rank_zero_is_none_with_confidence_on_hidden():
    head = SequentialHead(30, 8, 0, kind="gated")
    w = head.weights()
    assert head.kind == "none" and w.kind == "none" and w.w1 is None and w.conf_w.shape == (8,)
    base, hidden = torch.randn(1, 2, 30), torch.randn(1, 2, 8)
    logits, conf = head.teacher_forced(base, hidden, torch.zeros(1, 2, dtype=torch.int64))
    assert torch.equal(logits, base)
    torch.testing.assert_close(conf, head.confidence(hidden).squeeze(-1))


def test_module_weights_follow_parameter_updates():
    """``weights().w2`` is a cached row-major copy: it must be refreshed by in-place updates and loads."""
    head = _random_module("vanilla", 30, 8, 4)
    first = head.weights().w2
    assert first.is_contiguous() and torch.equal(first, head.w2.weight.t())
    assert head.weights().w2 is first  # unchanged weight: no new copy
    with torch.no_grad():
        head.w2.weight.add_(1.0)
    assert torch.equal(head.weights().w2, head.w2.weight.t())
    head.load_state_dict(_random_module("vanilla", 30, 8, 4).state_dict())
    assert torch.equal(head.weights().w2, head.w2.weight.t())
    with torch.inference_mode():  # parameters made here are inference tensors, without a version counter
        fresh = _random_module("vanilla", 30, 8, 4)
        assert torch.equal(fresh.weights().w2, fresh.w2.weight.t()) and fresh.weights().w2.is_contiguous()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows, v", [(1, 64), (3, 96), (2, 97)])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_reference_markov_bias_matches_plain_product(threads, rows, v, layout):
    """The reference's thread-chunked bias GEMM equals ``logits + lat @ w2`` for any thread count, vocab (divisible
    or not) and ``w2`` layout, and leaves its inputs alone."""
    r = 5
    w2 = torch.randn(r, v) if layout == "rows" else torch.randn(v, r).t()
    logits, lat = torch.randn(rows, v), torch.randn(rows, r)
    before = logits.clone()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ref_module._MarkovBias(w2).add(logits, lat)
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(out, logits + lat @ w2)
    assert torch.equal(logits, before)


def test_module_without_confidence_gives_zero_logits():
    head = _random_module("vanilla", 30, 8, 4)
    head.confidence = None
    res = head.sample(torch.randn(3, 30), torch.randn(3, 8), torch.tensor([1]), _cu([3]), torch.tensor([1.0]),
                      uniforms=torch.rand(3))
    assert torch.equal(res.confidence_logits, torch.zeros(3))


# ----------------------------------------------------------------------------------- draft probs are the sampler


def _fixed_block(kind: str, num_req: int, gamma: int, v: int, top_k: int) -> dict:
    """``num_req`` identical requests (same anchor, logits, hidden) with per-request seeded uniforms, so the slots'
    draft distributions depend only on the sampled prefix."""
    d, r = 6, 4
    gen = torch.Generator().manual_seed(1)
    weights = make_weights(kind, v, d, r, scale=1.0)
    seeds = torch.arange(num_req)
    return dict(
        base_logits=torch.randn(gamma, v, generator=gen).repeat(num_req, 1),
        hidden=torch.randn(gamma, d, generator=gen).repeat(num_req, 1),
        anchor_tokens=torch.full((num_req,), 2),
        cu_num_draft_tokens=_cu([gamma] * num_req),
        weights=weights,
        temperature=torch.full((num_req,), 0.9),
        top_k=torch.full((num_req,), top_k),
        top_p=None,
        uniforms=uniform_noise(seeds, torch.zeros_like(seeds), (gamma,)).reshape(-1),
    )


def slot_p_values(res, gamma: int) -> list[float]:
    """Per slot: group the rows by their (exactly equal) draft distribution and pool a chi-square test of each
    group's token counts against it (cells expecting < 5 merged); tokens of zero probability fail outright."""
    v = res.draft_probs.shape[1]
    p_values = []
    for k in range(gamma):
        probs, tokens = res.draft_probs[k::gamma], res.tokens[k::gamma]
        rows, group = torch.unique(probs, dim=0, return_inverse=True)
        stat, dof = 0.0, 0
        for gi, p in enumerate(rows):
            counts = torch.bincount(tokens[group == gi], minlength=v).double()
            size = counts.sum()
            expected = p.double() * size
            assert bool((counts[p == 0] == 0).all()), "a token of zero draft probability was sampled"
            big = expected >= 5
            obs = torch.cat([counts[big], counts[~big].sum()[None]])
            exp = torch.cat([expected[big], expected[~big].sum()[None]])
            keep = exp > 0
            if int(keep.sum()) < 2:
                continue
            stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
            dof += int(keep.sum()) - 1
        p_values.append(float(stats.chi2.sf(stat, dof)))
    return p_values


@pytest.mark.parametrize("kind, top_k", [("vanilla", 0), ("rnn", 4), ("gated", 0)])
def test_tokens_follow_emitted_draft_probs(kind, top_k):
    gamma = 3
    args = _fixed_block(kind, 30_000, gamma, 6, top_k)
    res = sequential_head(**args, impl="torch", check_inputs=False)
    assert min(slot_p_values(res, gamma)) > 1e-3


def test_chi_square_catches_a_wrong_draw(monkeypatch):
    """Mutation check: drawing from a sharpened row while emitting the true one must fail the test above."""
    gamma = 3
    args = _fixed_block("vanilla", 30_000, gamma, 6, 0)
    monkeypatch.setattr(ref_module, "inverse_cdf_ref", lambda w, u: inverse_cdf_ref(w**2, u))
    res = sequential_head(**args, impl="torch", check_inputs=False)
    assert max(slot_p_values(res, gamma)) < 1e-6


# ------------------------------------------------------------------------------------------------------- bad input


def _set(key, value):
    return lambda a: a.__setitem__(key, value(a) if callable(value) else value)


def _weight(field, value):
    return lambda a: a.__setitem__("weights", a["weights"]._replace(**{field: value(a["weights"])}))


def _nan(key, value):
    return _set(key, lambda a: a[key].index_fill(0, torch.tensor([1]), value))


BAD_INPUTS = [
    ("base_logits", _set("base_logits", lambda a: a["base_logits"].double())),
    ("base_logits", _set("base_logits", lambda a: a["base_logits"][None])),
    ("base_logits", _nan("base_logits", float("nan"))),
    ("base_logits", _nan("base_logits", float("-inf"))),
    ("hidden", _set("hidden", lambda a: a["hidden"][:-1])),
    ("hidden", _set("hidden", lambda a: a["hidden"].long())),
    ("anchor_tokens", _set("anchor_tokens", lambda a: torch.full_like(a["anchor_tokens"], 20))),
    ("anchor_tokens", _set("anchor_tokens", lambda a: torch.full_like(a["anchor_tokens"], -1))),
    ("anchor_tokens", _set("anchor_tokens", lambda a: a["anchor_tokens"][:-1])),
    ("anchor_tokens", _set("anchor_tokens", lambda a: a["anchor_tokens"].float())),
    ("cu_num_draft_tokens", _set("cu_num_draft_tokens", torch.tensor([0, 3, 2, 5]))),
    ("cu_num_draft_tokens", _set("cu_num_draft_tokens", torch.tensor([0, 1, 2, 4]))),
    ("cu_num_draft_tokens", _set("cu_num_draft_tokens", torch.tensor([1, 2, 3, 5]))),
    ("weights", _set("weights", lambda a: tuple(a["weights"]))),
    ("weights.kind", _weight("kind", lambda w: "lstm")),
    ("weights.w1", _weight("w1", lambda w: w.w1[:-1])),
    ("weights.w1", _weight("w1", lambda w: None)),
    ("weights.w2", _weight("w2", lambda w: w.w2[:, :-1])),
    ("weights.w2", _weight("w2", lambda w: w.w2[:-1])),
    ("weights.gate_w", _weight("gate_w", lambda w: w.gate_w[:-1])),
    ("weights.gate_w", _weight("gate_w", lambda w: None)),
    ("weights.gate_b", _weight("gate_b", lambda w: w.gate_b.long())),
    ("weights.conf_w", _weight("conf_w", lambda w: w.conf_w[:-1])),
    ("weights.conf_b", _weight("conf_b", lambda w: w.conf_b[None])),
    ("weights.conf_w", _weight("conf_b", lambda w: None)),
    ("temperature", _set("temperature", torch.tensor([1.0, -0.5, 1.0]))),
    ("temperature", _set("temperature", torch.tensor([1.0, float("nan"), 1.0]))),
    ("temperature", _set("temperature", torch.tensor([1.0, 1.0]))),
    ("temperature 1e-38 is too small for base_logits row 2", _set("temperature", torch.tensor([1.0, 1.0, 1e-38]))),
    ("hidden contains NaN", _set("hidden", lambda a: a["hidden"].index_fill(0, torch.tensor([1]), float("nan")))),
    ("weights.w1 contains NaN", _weight("w1", lambda w: w.w1.index_fill(0, torch.tensor([3]), float("nan")))),
    ("weights.gate_b contains NaN", _weight("gate_b", lambda w: torch.full_like(w.gate_b, float("inf")))),
    ("top_k", _set("top_k", torch.tensor([1, -1, 0]))),
    ("top_k", _set("top_k", torch.tensor([1.0, 1.0, 0.0]))),
    ("top_p", _set("top_p", torch.tensor([0.5, 0.0, 1.0]))),
    ("top_p", _set("top_p", torch.tensor([0.5, 1.5, 1.0]))),
    ("uniforms", _set("uniforms", None)),
    ("uniforms", _set("uniforms", lambda a: torch.zeros_like(a["uniforms"]))),
    ("uniforms", _set("uniforms", lambda a: a["uniforms"][:-1])),
]


@pytest.mark.parametrize("name, mutate", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input(name, mutate):
    args = make_args([2, 0, 3], 20, "gated", top_k=[0, 1, 2], top_p=[1.0, 0.5, 0.9])
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=name.replace(".", r"\.")):
        sequential_head(**args, impl="torch")


def test_bad_rnn_weights_name_the_hidden_size():
    args = make_args([2, 1], 20, "rnn")
    args["hidden"] = torch.randn(3, 13)
    with pytest.raises(ValueError, match=r"weights\.rnn_w.*hidden size"):
        sequential_head(**args, impl="torch")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_inputs_unchanged(impl):
    args = make_args([3, 0, 2], 64, "rnn", temps=[1.0, 0.5, 0.0], top_k=[0, 3, 0], top_p=[0.9, 1.0, 1.0])
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    weights_before = [t.clone() if t is not None else None for t in args["weights"][1:]]
    sequential_head(**args, impl=impl)
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k
    for t, t0 in zip(args["weights"][1:], weights_before):
        assert (t is None and t0 is None) or torch.equal(t, t0)


# --------------------------------------------------------------------------------------------- GPU compilation

_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
op = importlib.import_module("dspark_kernels.ops.sequential_head")

INT64 = ("tokens_ptr", "part_arg_ptr", "top_k_ptr", "keep_key_ptr", "keep_bits_ptr", "req_row_ptr", "req_key_ptr",
         "req_bits_ptr")
INT32 = ("cu_ptr", "anchor_ptr", "filt_ptr", "req_res_ptr")

def build(kernel, consts, types=None):
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else ("*i64" if n in INT64 else "*i32" if n in INT32 else "*fp32")
           if n.endswith("_ptr") else "i32" for n in names}
    if "part_arg_ptr" in sig:
        sig["part_arg_ptr"] = "*i32"
    sig.update(types or {})
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))

for kind in (1, 2, 3):
    build(op._slot_latent_kernel, dict(KIND=kind, HAS_CONF=True, BLOCK_M=16, BLOCK_R=64, BLOCK_C=32))
for kind in range(4):
    for store, filtered in ((True, True), (True, False), (False, False)):
        for w2_bf16 in (True, False):
            build(op._slot_vocab_kernel, dict(KIND=kind, STORE=store, FILTERED=filtered, CANDIDATES=16, BLOCK_M=16,
                                              BLOCK_V=128, BLOCK_R=64, W2_BF16=w2_bf16, BF16_DOT=True),
                  {"w2_ptr": "*bf16" if w2_bf16 else "*fp32"})
for sample, filtered in ((True, True), (True, False), (False, False)):
    build(op._slot_draw_kernel, dict(SAMPLE=sample, FILTERED=filtered, BLOCK_T=2048, BLOCK_V=128))
build(op._group_candidates_kernel, dict(CANDIDATES=16, GROUP_TILES=64, GROUP_CANDIDATES=64))
build(op._group_mass_kernel, dict(GROUP_CANDIDATES=64, GROUP_V=8192, BLOCK_V=128))
build(op._filtered_draw_kernel, dict(CANDIDATES=16, GROUP_TILES=64, GROUPS_P2=32, BLOCK_V=128))
for filtered in (True, False):
    build(op._normalise_kernel, dict(FILTERED=filtered, BLOCK_M=16, BLOCK_V=128))
print("compiled")
"""


def test_kernel_compiles_for_cuda():
    """The interpreter accepts code that the GPU compiler rejects (e.g. non-constexpr globals): compile every kind
    for sm_90 in a subprocess without ``TRITON_INTERPRET`` (needs no GPU)."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("on a GPU test_gpu_parity.py compiles and runs the kernel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------- kept bias rows (vanilla)


def _single_row_bias(w: SequentialHeadWeights, token: int) -> torch.Tensor:
    v = w.w2.shape[1]
    return ref_module._MarkovBias(w.w2).add(torch.zeros(1, v), w.w1[token: token + 1])[0]


@pytest.mark.parametrize("max_bytes", [64 << 20, 3 * 4 * 70, 1])
def test_markov_bias_rows_are_each_tokens_single_row_product(max_bytes):
    """Every row read back is the token's one-row product, whatever was kept before it, including when the table
    starts over (room for three rows) or cannot hold a call's tokens at all (one row)."""
    from dspark_kernels.ops.sequential_head import MarkovBiasRows

    torch.manual_seed(0)
    w = make_weights("vanilla", 70, 8, 6)
    rows = MarkovBiasRows(w.w1, w.w2, max_bytes=max_bytes)
    for tokens in ([3], [3, 3, 9], [9, 60, 3, 61], [0], [69, 68, 67, 66, 0]):
        got = rows.rows(torch.tensor(tokens))
        assert torch.equal(got, torch.stack([_single_row_bias(w, t) for t in tokens]))
        assert rows.used <= rows.capacity


@pytest.mark.parametrize("temps", [[0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.7, 1.0, 1.3]])
def test_op_with_kept_bias_rows_matches_the_product_path(temps):
    """Kept rows change only how each slot's bias is summed: tokens equal, probabilities within fp32 rounding, and
    each request's drafts do not depend on the requests drafted with it."""
    from dspark_kernels.ops.sequential_head import MarkovBiasRows

    torch.manual_seed(1)
    args = make_args([4, 7, 1, 7, 7], 90, "vanilla", temps=temps)
    if all(t == 0 for t in temps):
        args["uniforms"] = None
    kept = dict(args, weights=args["weights"]._replace(bias_rows=MarkovBiasRows(args["weights"].w1,
                                                                                  args["weights"].w2)))
    plain, fast = sequential_head(**args, impl="torch"), sequential_head(**kept, impl="torch")
    tri = sequential_head(**kept, impl="triton")  # the kernel multiplies out every slot (it ignores the kept rows)
    assert torch.equal(fast.tokens, plain.tokens) and torch.equal(tri.tokens, fast.tokens)
    assert torch.equal(fast.confidence_logits, plain.confidence_logits)
    if plain.draft_probs is not None:
        torch.testing.assert_close(fast.draft_probs, plain.draft_probs, rtol=1e-5, atol=1e-6)
    cu = args["cu_num_draft_tokens"].tolist()
    for i in range(5):  # request i alone: bit for bit its rows of the batched call
        rows = slice(cu[i], cu[i + 1])
        alone = dict(kept, base_logits=args["base_logits"][rows], hidden=args["hidden"][rows],
                     anchor_tokens=args["anchor_tokens"][i: i + 1], cu_num_draft_tokens=_cu([cu[i + 1] - cu[i]]),
                     temperature=args["temperature"][i: i + 1],
                     uniforms=None if args["uniforms"] is None else args["uniforms"][rows])
        solo = sequential_head(**alone, impl="torch")
        assert torch.equal(solo.tokens, fast.tokens[rows])
        if solo.draft_probs is not None:
            assert torch.equal(solo.draft_probs, fast.draft_probs[rows])


def test_module_keeps_its_bias_rows_until_the_weights_change():
    head = _random_module("vanilla", 30, 8, 4)
    with torch.no_grad():
        first = head.weights().bias_rows
        assert first is not None and head.weights().bias_rows is first
        first.rows(torch.tensor([1, 2]))
        head.w2.weight.add_(1.0)
        second = head.weights().bias_rows
        assert second is not first and second.used == 0
        head.load_state_dict(_random_module("vanilla", 30, 8, 4).state_dict())
        assert head.weights().bias_rows is not second
        w = head.weights()
        assert torch.equal(w.bias_rows.rows(torch.tensor([5]))[0], _single_row_bias(w, 5))
    assert head.weights().bias_rows is None  # with autograd on (training): the product path
    assert _random_module("gated", 30, 8, 4).weights().bias_rows is None


def test_kept_bias_rows_of_other_weights_or_kinds_are_rejected():
    from dspark_kernels.ops.sequential_head import MarkovBiasRows

    args = make_args([3, 2], 40, "vanilla")
    w = args["weights"]
    stale = MarkovBiasRows(w.w1, w.w2)
    w.w2.add_(0.5)  # the rows no longer belong to w2
    with pytest.raises(ValueError, match="bias_rows must be a MarkovBiasRows made from these"):
        sequential_head(**dict(args, weights=w._replace(bias_rows=stale)))
    gated = make_args([3, 2], 40, "gated")
    gw = gated["weights"]
    with pytest.raises(ValueError, match="bias_rows is for kind 'vanilla' only"):
        sequential_head(**dict(gated, weights=gw._replace(bias_rows=MarkovBiasRows(gw.w1, gw.w2))))


@pytest.mark.parametrize("max_bytes", [64 << 20, 3 * 4 * 70, 1])
def test_greedy_host_scan_equals_the_tensor_path(monkeypatch, max_bytes):
    """The CPU's host scan for all-greedy batches (kind "none", or vanilla with kept rows) against the per-slot tensor
    path, bit for bit: ragged and empty drafts, no requests, argmax ties (integer logits), half-precision base logits,
    and kept-row tables that start over mid-scan (room for three rows) or hold one row."""
    from dspark_kernels.ops.sequential_head import MarkovBiasRows

    g = torch.Generator().manual_seed(5)
    host_slots = ref_module.HOST_SLOTS
    for case in range(120):
        kind = ("none", "vanilla")[case % 2]
        r = int(torch.randint(0, 6, (), generator=g))
        lens = torch.randint(0, 9, (r,), generator=g).tolist()
        v = 70 if case % 3 else int(torch.randint(1, 6, (), generator=g))
        args = make_args(lens, v, kind, temps=[0.0] * r)
        args["uniforms"] = None
        if case % 4 == 1:  # ties: integer logits, a bias that is all zeros or integer too
            args["base_logits"] = torch.randint(0, 3, args["base_logits"].shape, generator=g).float()
        if case % 5 == 2:
            args["base_logits"] = args["base_logits"].to(torch.bfloat16)
        w = args["weights"]
        if kind == "vanilla":
            if case % 4 == 1:
                w = w._replace(w1=torch.randint(-1, 2, w.w1.shape, generator=g).float(),
                               w2=torch.randint(-1, 2, w.w2.shape, generator=g).float())
            # fresh rows for each path: the host scan and the tensor path each fill their own table
            args["weights"] = w._replace(bias_rows=MarkovBiasRows(w.w1, w.w2, max_bytes=max_bytes))
        monkeypatch.setattr(ref_module, "HOST_SLOTS", host_slots)
        host = sequential_head(**args, impl="torch")
        if kind == "vanilla":
            args["weights"] = w._replace(bias_rows=MarkovBiasRows(w.w1, w.w2, max_bytes=max_bytes))
        monkeypatch.setattr(ref_module, "HOST_SLOTS", 0)
        tensor = sequential_head(**args, impl="torch")
        assert host.draft_probs is None and tensor.draft_probs is None
        assert host.tokens.dtype == torch.int64 and torch.equal(host.tokens, tensor.tokens), case
        assert torch.equal(host.confidence_logits, tensor.confidence_logits), case


def test_greedy_host_scan_reads_each_tokens_single_row():
    """``MarkovBiasRows.host_row`` is the token's one-row product, also after ``rows`` kept others and after the table
    started over (room for two rows)."""
    from dspark_kernels.ops.sequential_head import MarkovBiasRows

    torch.manual_seed(2)
    w = make_weights("vanilla", 70, 8, 6)
    rows = MarkovBiasRows(w.w1, w.w2, max_bytes=2 * 4 * 70)
    for token in (3, 3, 9, 60, 3):
        rows.rows(torch.tensor([61]))
        assert np.array_equal(rows.host_row(token), _single_row_bias(w, token).numpy())
        assert rows.used <= rows.capacity

"""Chain drafter (EAGLE-style, MTP-1) on a tiny random target.

* the cached chain (extend in chunks, draft, roll back) reproduces the teacher-forced training forward;
* T = 0: speculative output == the target's greedy output, token for token (reference and Triton paths);
* T > 0: the generated tokens follow the target's distribution (chi-square against the exact marginals);
* training reduces the loss; save/load round trip; mismatch errors.
"""

import dataclasses
import random

import pytest
import torch

from dspark_kernels.drafters.chain_drafter import ChainDrafter, ChainDrafterConfig, load_chain_drafter
from dspark_kernels.drafters.draft_vocab import DraftVocab
from dspark_kernels.engine.draft_length import AdaptiveDraftLength, RoundCosts
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate, load_model
from dspark_kernels.train.chain_drafter import chain_loss, make_chain_batch
from dspark_kernels.train.drafter_data import forward_outputs, target_logits
from dspark_kernels.train.rollouts import Rollouts
from tests.lossless import assert_follows_target
from tests.tiny_models import save_tiny_qwen3

VOCAB = 96


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    return load_model(save_tiny_qwen3(tmp_path_factory.mktemp("target"), vocab_size=VOCAB))


def make_drafter(target, max_steps=4, seed=1, name="eagle", input_norm=False):
    torch.manual_seed(seed)
    cfg = ChainDrafterConfig(feature_layer=-1, vocab_size=VOCAB, hidden_size=64, max_steps=max_steps, name=name,
                             input_norm=input_norm)
    drafter = ChainDrafter(cfg, target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return drafter.eval()


PROMPTS = [[1] + [random.Random(i).randrange(4, VOCAB) for _ in range(3)] for i in range(48)]


def train_drafter(target, max_steps, iters=100):
    """A few teacher-forced steps on the target's own sampled rollouts: a drafter that is often accepted."""
    rng = random.Random(0)
    ro = Rollouts(PROMPTS, generate(target, PROMPTS, 20, temperature=1.0, seeds=list(range(len(PROMPTS)))).tokens,
                  [1.0] * len(PROMPTS), [0] * len(PROMPTS))
    drafter = make_drafter(target, max_steps).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(iters):
        loss = chain_loss(drafter, make_chain_batch(target, ro, rng.sample(range(len(PROMPTS)), 16), 2), max_steps)
        opt.zero_grad()
        loss.total.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def trained(target):
    return {"eagle": train_drafter(target, 3), "mtp1": train_drafter(target, 1)}


@pytest.mark.parametrize("input_norm", [False, True])
def test_cached_chain_matches_full_recompute_and_rolls_back(target, input_norm):
    drafter = make_drafter(target, input_norm=input_norm)
    assert drafter.feature_layers == (2,)  # -1 resolves to the last non-final layer
    seqs = [[random.randrange(4, VOCAB) for _ in range(18)], [random.randrange(4, VOCAB) for _ in range(13)]]
    gamma = 4
    feats, tokens = [], []
    for s in seqs:
        out = forward_outputs(target, [s], drafter.feature_layers)
        f, t = out.features, out.tokens
        feats.append(f[0])
        tokens.append(t[0])
    state = drafter.new_state(16, 4)
    for i in range(2):
        drafter.add_request(state, i)
    greedy = torch.zeros(2)

    def extend(chunks):  # chunks[i] = (start, end) of request i
        cu = [0]
        for a, b in chunks:
            cu.append(cu[-1] + b - a)
        drafter.extend(state, [0, 1], torch.cat([tokens[i][a:b] for i, (a, b) in enumerate(chunks)]),
                       torch.cat([feats[i][a:b] for i, (a, b) in enumerate(chunks)]), torch.tensor(cu))

    extend([(0, 5), (0, 3)])
    drafter.chain(state, [0, 1], torch.tensor([seqs[0][5], seqs[1][3]]), gamma, greedy)  # drafts, then rolls back
    assert [state.num_pairs(i) for i in (0, 1)] == [4, 2]
    extend([(5, 11), (3, 3)])  # request 1 extends nothing this round
    assert [state.num_pairs(i) for i in (0, 1)] == [10, 2]
    anchors = [11, 3]
    forced = torch.tensor([seqs[0][12:12 + gamma], seqs[1][4:4 + gamma]])
    out = drafter.chain(state, [0, 1], torch.tensor([seqs[0][11], seqs[1][3]]), gamma, greedy, forced_tokens=forced)
    assert [state.num_pairs(i) for i in (0, 1)] == [10, 2]  # only committed pairs stay
    with torch.no_grad():
        for i, a in enumerate(anchors):
            logits, hidden = drafter.forward_train(feats[i][None], tokens[i][None], gamma)
            for k in range(1, gamma + 1):  # step k from anchor a sits at position a + k - 2
                torch.testing.assert_close(out.logits[i, k - 1], logits[0, k - 1, a + k - 2], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(out.hidden[i, k - 1], hidden[0, k - 1, a + k - 2], rtol=1e-4, atol=1e-4)
    # the unforced draft feeds its own tokens: first step equal, and draft returns the protocol's shapes
    res = drafter.draft(state, [0, 1], torch.tensor([seqs[0][11], seqs[1][3]]), gamma, greedy, torch.zeros(2,
                        dtype=torch.int32), torch.ones(2), None)
    assert res.tokens.shape == (2 * gamma,) and res.draft_probs is None  # greedy, no uniforms: no rows
    assert res.confidence_logits is None
    assert res.tokens.view(2, gamma)[:, 0].tolist() == out.logits[:, 0].argmax(-1).tolist()


@pytest.mark.parametrize("before", [None, [(0, 5), (0, 3)]])
def test_context_in_the_first_step_equals_extend_first(target, before):
    """``chain(context=...)`` commits the context's pairs inside its first step: the same committed pairs, K/V and
    drafts as ``extend`` then ``chain``, ragged, with a request that has no new tokens (and, with ``before=None``,
    with nothing extended before)."""
    drafter = make_drafter(target)
    seqs = [[random.randrange(4, VOCAB) for _ in range(18)], [random.randrange(4, VOCAB) for _ in range(13)]]
    feats, tokens = [], []
    for seq in seqs:
        out = forward_outputs(target, [seq], drafter.feature_layers)
        f, t = out.features, out.tokens
        feats.append(f[0])
        tokens.append(t[0])

    def chunk(chunks):
        cu = torch.tensor([0, *[b - a for a, b in chunks]]).cumsum(0).to(torch.int32)
        return (torch.cat([tokens[i][a:b] for i, (a, b) in enumerate(chunks)]),
                torch.cat([feats[i][a:b] for i, (a, b) in enumerate(chunks)]), cu)

    new = [(5, 11), (3, 4)] if before else [(0, 11), (0, 4)]
    forced = torch.tensor([seqs[0][12:15], seqs[1][5:8]])
    anchors = torch.tensor([seqs[0][11], seqs[1][4]])
    states, outs = [], []
    for fused in (False, True):
        state = drafter.new_state(16, 4)
        for i in range(2):
            drafter.add_request(state, i)
        if before:
            drafter.extend(state, [0, 1], *chunk(before))
            drafter.extend(state, [0, 1], *chunk([(5, 5), (3, 3)]))  # nothing new: a no-op
        if not fused:
            drafter.extend(state, [0, 1], *chunk(new))
        outs.append(drafter.chain(state, [0, 1], anchors, 3, torch.zeros(2), forced_tokens=forced,
                                  context=chunk(new) if fused else None))
        states.append(state)
    assert [states[1].num_pairs(i) for i in (0, 1)] == [states[0].num_pairs(i) for i in (0, 1)] == [10, 3]
    for i in (0, 1):
        torch.testing.assert_close(states[1].pending[i], states[0].pending[i])
    torch.testing.assert_close(states[1].cache.k[0], states[0].cache.k[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1].hidden, outs[0].hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,gamma", [("eagle", 1), ("eagle", 3), ("eagle", 5), ("mtp1", 1), ("random", 3)])
def test_greedy_speculative_equals_target_greedy(target, trained, name, gamma):
    drafter = trained[name] if name in trained else make_drafter(target)
    prompts = [PROMPTS[0], [1, 40], [1] + list(range(20, 45)), PROMPTS[5]]
    ar = generate(target, prompts, 20, temperature=0.0)
    spec = speculative_generate(target, drafter, prompts, 20, gamma, temperature=0.0)
    assert spec.tokens == ar.tokens
    assert spec.rounds > 0 and 1.0 <= spec.tau <= gamma + 1
    if name != "random":
        assert spec.accept_hist[-1] > 0  # trained: whole chains get accepted (multi-step rollback exercised)


@pytest.mark.parametrize("name", ["eagle", "random"])
def test_greedy_adaptive_draft_length_equals_target_greedy(target, trained, name):
    drafter = trained[name] if name in trained else make_drafter(target)
    prompts = [PROMPTS[0], [1, 40], [1] + list(range(20, 45)), PROMPTS[5]]
    ar = generate(target, prompts, 20, temperature=0.0)
    sched = AdaptiveDraftLength(RoundCosts(0.3, 0.05), decay=0.7)
    spec = speculative_generate(target, drafter, prompts, 20, 4, temperature=0.0, draft_length=sched)
    assert spec.tokens == ar.tokens
    assert sum(1 for row in spec.round_hist if sum(row)) >= 2  # chains of more than one length (or plain steps)


def test_greedy_with_eos_and_triton_path(target, trained):
    drafter = trained["eagle"]
    prompts = [PROMPTS[1], [1, 30, 31, 32]]
    ar = generate(target, prompts, 10, temperature=0.0, eos_token_id=17)
    spec = speculative_generate(target, drafter, prompts, 10, 3, temperature=0.0, eos_token_id=17, impl="triton")
    assert spec.tokens == ar.tokens and spec.finish_reasons == ar.finish_reasons


@pytest.mark.parametrize("name,gamma,temperature", [("eagle", 3, 1.0), ("mtp1", 1, 0.8)])
def test_sampled_speculative_is_lossless(target, trained, name, gamma, temperature):
    prompt, n, steps = PROMPTS[0], 3000, 3
    spec = speculative_generate(target, trained[name], [prompt] * n, steps, gamma, temperature=temperature,
                                seeds=list(range(n)))
    assert sum(spec.accept_hist[1:]) > 0.1 * n and spec.accept_hist[0] > 0.1 * n  # both paths exercised
    assert_follows_target(target, prompt, spec.tokens, temperature, steps)


def test_seeded_runs_reproduce_and_do_not_depend_on_batching(target, trained):
    a = speculative_generate(target, trained["eagle"], [PROMPTS[2], PROMPTS[3]], 12, 3, temperature=1.0, seeds=[3, 4])
    b = speculative_generate(target, trained["eagle"], [PROMPTS[3]], 12, 3, temperature=1.0, seeds=[4])
    assert a.tokens[1] == b.tokens[0]


@pytest.mark.parametrize("max_steps,positions", [(3, 0), (3, 8), (1, 0)])
def test_training_steps_reduce_loss(target, max_steps, positions):
    drafter = make_drafter(target, max_steps).train()
    rng = random.Random(0)
    ro = Rollouts([[1, 5, 6, 7]] * 4, [[rng.randrange(4, VOCAB) for _ in range(20)] for _ in range(4)], [1.0] * 4,
                  [0] * 4)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    batch = make_chain_batch(target, ro, [0, 1, 2, 3], drafter.config.feature_layer)
    first = None
    for _ in range(12):
        loss = chain_loss(drafter, batch, max_steps, positions=positions).total
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first
    if positions:  # subsampled positions estimate the same loss as evaluating every position
        full = chain_loss(drafter, batch, max_steps).total.item()
        sub = [chain_loss(drafter, batch, max_steps, positions=positions).total.item() for _ in range(20)]
        assert abs(sum(sub) / len(sub) - full) < 0.15 * full


@pytest.mark.parametrize("max_steps", [1, 3])
def test_draft_vocab_loss_reads_the_recorded_log_sum_exp(target, max_steps):
    """Over a draft vocabulary the loss takes the target's log-sum-exp recorded with the rollouts (K logits computed)
    and equals the loss that reduces the whole logits of a forward."""
    drafter = make_drafter(target, max_steps)
    drafter.draft_vocab = DraftVocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:30], VOCAB)
    rng = random.Random(3)
    ro = Rollouts([[1, 5, 6, 7]] * 3, [[rng.randrange(4, VOCAB) for _ in range(12)] for _ in range(3)], [1.0] * 3,
                  [0] * 3)
    forward = make_chain_batch(target, ro, [0, 1, 2], drafter.config.feature_layer)
    assert forward.logsumexp is None
    lse = target_logits(target, forward.last_hidden).logsumexp(-1)
    recorded = dataclasses.replace(forward, logsumexp=lse.masked_fill(torch.arange(lse.shape[1]) < 3, float("nan")))
    want = chain_loss(drafter, forward, max_steps, generator=torch.Generator().manual_seed(4), positions=6)
    got = chain_loss(drafter, recorded, max_steps, generator=torch.Generator().manual_seed(4), positions=6)
    assert got.l1 == pytest.approx(want.l1, rel=1e-5) and got.ce == pytest.approx(want.ce, rel=1e-5)
    assert got.per_step_l1 == pytest.approx(want.per_step_l1, rel=1e-5)


@pytest.mark.parametrize("input_norm", [False, True])
def test_save_load_round_trip_and_mismatch_errors(target, tmp_path, input_norm):
    drafter = make_drafter(target, 1, name="mtp1", input_norm=input_norm)
    drafter.save(tmp_path / "d")
    back = load_chain_drafter(tmp_path / "d", target)
    assert back.config == drafter.config
    for (k, v), (k2, v2) in zip(drafter.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert not any("embed" in k or "lm_head" in k for k in back.state_dict())
    cfg = drafter.config
    for field, value in (("vocab_size", VOCAB + 1), ("hidden_size", 32), ("feature_layer", 3), ("max_steps", 0)):
        with pytest.raises(ValueError, match=field):
            ChainDrafter(ChainDrafterConfig(**{**cfg.__dict__, field: value}), target)
    state = drafter.new_state(4, 4)
    drafter.add_request(state, 0)
    with pytest.raises(ValueError, match="extend first"):
        drafter.draft(state, [0], torch.tensor([5]), 1, torch.zeros(1), None, None, None)
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_chain_drafter(tmp_path / "d", target)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_unrolled_attention_equals_the_dense_mask(k):
    """The diagonal form of a training unroll step's attention equals attention over every step's keys under the
    dense ``[L, k * L]`` visibility mask it replaces (GQA heads included)."""
    from dspark_kernels.drafters.chain_drafter import _unrolled_attention

    g = torch.Generator().manual_seed(k)
    b, hq, hkv, seq_len, d = 2, 6, 2, 13, 8
    q = torch.randn(b, hq, seq_len, d, generator=g)
    keys = [torch.randn(b, hkv, seq_len, d, generator=g) for _ in range(k)]
    values = [torch.randn(b, hkv, seq_len, d, generator=g) for _ in range(k)]
    pos = torch.arange(seq_len)
    s, t = pos[None, :], pos[:, None]
    mask = torch.cat([s <= t - k + 1] + [s == t - k + j for j in range(2, k + 1)], dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                            attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(_unrolled_attention(q, keys, values, k), dense, rtol=1e-5, atol=1e-5)

"""Block drafter (DSpark / DFlash) and the draft-verify loop on a tiny random target.

* training forward == inference forward (the packed teacher-forced pass reproduces what ``propose`` computes);
* T = 0: speculative output == the target's greedy output, token for token, for every drafter kind;
* T > 0: the distribution of the generated tokens matches the target's (chi-square against the exact marginals).
"""

import random

import pytest
import torch

from dspark_kernels.drafters.block_drafter import BlockDrafter, DrafterConfig, load_block_drafter
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate, load_model
from dspark_kernels.train.drafter import drafter_loss
from dspark_kernels.train.drafter_data import forward_outputs, make_batch
from dspark_kernels.train.rollouts import Rollouts
from tests.lossless import assert_follows_target
from tests.tiny_models import save_tiny_qwen3

VOCAB, MASK = 96, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    return load_model(save_tiny_qwen3(tmp_path_factory.mktemp("target"), vocab_size=VOCAB))


def make_drafter(target, kind="vanilla", rank=8, layers=2, seed=1):
    """``kind`` is a head kind, or ``ANCHOR``: the vanilla head with the anchor-feature path."""
    torch.manual_seed(seed)
    head, _, path = kind.partition("+")
    cfg = DrafterConfig(feature_layers=(0, 2), mask_token_id=MASK, vocab_size=VOCAB, hidden_size=64,
                        num_layers=layers, gamma=7, head_kind=head if rank else "none", markov_rank=rank,
                        anchor_feature=path == "anchor")
    drafter = BlockDrafter(cfg, target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))  # w2 starts at 0: perturb so the head really acts
    return drafter.eval()


ANCHOR = "vanilla+anchor"
KINDS = [("vanilla", 8), ("gated", 8), ("rnn", 8), ("none", 0), (ANCHOR, 8)]
ROLLOUT_PROMPTS = [[1, random.Random(i).randrange(4, VOCAB), random.Random(i + 99).randrange(4, VOCAB)]
                   for i in range(64)]


def train_block_drafter(target, kind="vanilla", rank=8, iters=300):
    """A drafter trained for a few seconds on the target's own sampled rollouts (DSpark loss, or DFlash's CE for
    rank 0): accepted often enough that the end-to-end tests run the accept, reject and residual paths (a random
    drafter is almost never accepted, so they would test plain decoding)."""
    rng = random.Random(0)
    responses = generate(target, ROLLOUT_PROMPTS, 24, temperature=1.0, seeds=list(range(len(ROLLOUT_PROMPTS))))
    ro = Rollouts(ROLLOUT_PROMPTS, responses.tokens, [1.0] * len(ROLLOUT_PROMPTS), [0] * len(ROLLOUT_PROMPTS))
    drafter = make_drafter(target, kind, rank).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(iters):
        gamma = rng.choice([3, 4])
        batch = make_batch(target, ro, rng.sample(range(len(ROLLOUT_PROMPTS)), 16), drafter.feature_layers, gamma, 4,
                           rng)
        loss = drafter_loss(drafter, batch, gamma, (0.1, 0.9, 1.0) if rank else (1.0, 0.0, 0.0)).total
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def trained(target):
    """One trained drafter per head kind (about 4 s each)."""
    return {kind: train_block_drafter(target, kind, rank) for kind, rank in KINDS}


@pytest.mark.parametrize("kind,rank", KINDS)
def test_training_forward_matches_inference(target, kind, rank):
    drafter = make_drafter(target, kind, rank)
    seq = [random.randrange(4, VOCAB) for _ in range(20)]
    out = forward_outputs(target, [seq], drafter.feature_layers)
    features, tokens = out.features, out.tokens
    gamma, anchors = 5, torch.tensor([[6, 11, 19]])
    base_t, hid_t = drafter.forward_train(features, tokens, anchors, gamma)
    for a_idx, p in enumerate(anchors[0].tolist()):
        cache = drafter.new_state(8, 4)
        cache.add_request(0)
        drafter.extend_context(cache, [0], features[0, :p], torch.tensor([0, p], dtype=torch.int32))
        prop = drafter.propose(cache, [0], torch.tensor([seq[p]]), gamma)
        torch.testing.assert_close(prop.base_logits, base_t[0, a_idx], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(prop.hidden, hid_t[0, a_idx], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["vanilla", ANCHOR])
def test_propose_takes_context_in_its_pass(target, impl, kind):
    """``propose(context=...)`` puts the committed tokens into the cache inside the backbone pass: the cache and the
    proposal equal ``extend_context`` then ``propose``, ragged, with a request that has no new tokens this round
    (with the anchor-feature path it keeps the feature of its earlier context)."""
    drafter = make_drafter(target, kind)
    seqs = [[random.randrange(4, VOCAB) for _ in range(n)] for n in (10, 7, 13)]
    feats = [forward_outputs(target, [s], drafter.feature_layers).features[0] for s in seqs]
    first, new = [6, 5, 4], [2, 0, 7]  # tokens extended before, tokens handed over with the draft
    anchors = torch.tensor([s[a + b] for s, a, b in zip(seqs, first, new)])

    def chunked(sizes, starts):
        cu = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
        rows = torch.cat([f[s:s + n] for f, s, n in zip(feats, starts, sizes)])
        return torch.zeros(rows.shape[0], dtype=torch.int64), rows, cu

    caches, props = [], []
    for fused in (False, True):
        cache = drafter.new_state(32, 4)
        for rid in range(3):
            cache.add_request(rid)
        drafter.extend_context(cache, [0, 1, 2], *chunked(first, [0, 0, 0])[1:])
        ctx = chunked(new, first)
        if not fused:
            drafter.extend_context(cache, [0, 1, 2], *ctx[1:])
        props.append(drafter.propose(cache, [0, 1, 2], anchors, 4, impl=impl, context=ctx if fused else None))
        caches.append(cache)
    assert [caches[1].length(r) for r in range(3)] == [a + b for a, b in zip(first, new)]
    for layer in range(2):
        for rid in range(3):
            slots = caches[0].token_slots([rid], [caches[0].length(rid)])[0]
            for kv0, kv1 in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
                flat0, flat1 = (kv[layer].flatten(0, 1) for kv in (kv0, kv1))
                torch.testing.assert_close(flat1[slots], flat0[slots], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(props[1].base_logits, props[0].base_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(props[1].hidden, props[0].hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,rank", KINDS)
@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_greedy_speculative_equals_target_greedy(target, trained, kind, rank, gamma):
    prompts = [[1, 5, 9, 13], [1, 40], [1] + list(range(20, 45)), *ROLLOUT_PROMPTS[:5]]
    ar = generate(target, prompts, 24, temperature=0.0)
    for drafter in (make_drafter(target, kind, rank), trained[kind]):
        spec = speculative_generate(target, drafter, prompts, 24, gamma, temperature=0.0)
        assert spec.tokens == ar.tokens
        assert spec.rounds > 0 and 1.0 <= spec.tau <= gamma + 1
    assert sum(spec.accept_hist[min(gamma, 2):]) > 0  # the trained drafter's runs of accepted drafts were committed


@pytest.mark.parametrize("target_dtype, drafter_dtype", [(torch.bfloat16, torch.float32),
                                                          (torch.float32, torch.bfloat16)])
def test_drafter_in_another_dtype_than_the_target(target, trained, target_dtype, drafter_dtype, tmp_path):
    """A drafter may run in another dtype than its target (a bf16 target with an fp32 drafter crashed in the
    target's LM head): greedy output is still the target's own."""
    trained["vanilla"].save(tmp_path / "d")
    torch.manual_seed(0)  # the module's target again (its fixture's seed), loaded in target_dtype
    tgt = load_model(save_tiny_qwen3(tmp_path / "t", vocab_size=VOCAB), dtype=target_dtype)
    drafter = load_block_drafter(tmp_path / "d", tgt, dtype=drafter_dtype)
    prompts = [[1, 5, 9, 13], [1, 40], *ROLLOUT_PROMPTS[:3]]
    ar = generate(tgt, prompts, 16, temperature=0.0)
    spec = speculative_generate(tgt, drafter, prompts, 16, 4, temperature=0.0)
    assert spec.tokens == ar.tokens and sum(spec.accept_hist[1:]) > 0


def test_greedy_with_eos_and_triton_path(target):
    drafter = make_drafter(target)
    prompts = [[1, 7, 8], [1, 30, 31, 32]]
    ar = generate(target, prompts, 16, temperature=0.0, eos_token_id=17)
    spec = speculative_generate(target, drafter, prompts, 16, 4, temperature=0.0, eos_token_id=17, impl="triton")
    assert spec.tokens == ar.tokens and spec.finish_reasons == ar.finish_reasons


def _sampled(target, drafter, temperature, n=4000):
    prompt, steps, gamma = [1, 11, 12], 3, 3
    spec = speculative_generate(target, drafter, [prompt] * n, steps, gamma, temperature=temperature,
                                seeds=list(range(n)))
    return prompt, steps, spec


@pytest.mark.parametrize("kind,temperature", [("vanilla", 1.0), ("gated", 1.0), ("rnn", 1.0), ("none", 0.8),
                                              (ANCHOR, 1.0)])
def test_sampled_speculative_is_lossless(target, trained, kind, temperature):
    prompt, steps, spec = _sampled(target, trained[kind], temperature)
    rounds = sum(spec.accept_hist)
    assert sum(spec.accept_hist[1:]) > 0.05 * rounds and spec.accept_hist[0] > 0.05 * rounds  # both paths, often
    assert_follows_target(target, prompt, spec.tokens, temperature, steps)


def test_the_lossless_check_catches_a_wrong_residual(target, trained, monkeypatch):
    """The end-to-end check can fail: resampling a rejected position from the target instead of the residual
    ``max(0, p_t - p_d)`` (a classic speculative-sampling bug) is rejected with this drafter and sample size."""
    import importlib

    rs = importlib.import_module("dspark_kernels.reference.rejection_sample")
    monkeypatch.setattr(rs, "_correction_weights", lambda probs, dp, x, rej, final_row, rd: probs[final_row])
    prompt, steps, spec = _sampled(target, trained["vanilla"], 1.0)
    with pytest.raises(AssertionError):
        assert_follows_target(target, prompt, spec.tokens, 1.0, steps)


def test_seeded_runs_reproduce_and_do_not_depend_on_batching(target):
    drafter = make_drafter(target)
    a = speculative_generate(target, drafter, [[1, 5], [1, 6, 7]], 12, 4, temperature=1.0, seeds=[3, 4])
    b = speculative_generate(target, drafter, [[1, 6, 7]], 12, 4, temperature=1.0, seeds=[4])
    assert a.tokens[1] == b.tokens[0]


def test_training_step_reduces_loss(target):
    drafter = make_drafter(target).train()
    rng = random.Random(0)
    ro = Rollouts([[1, 5, 6, 7]] * 4, [[rng.randrange(4, VOCAB) for _ in range(24)] for _ in range(4)], [1.0] * 4,
                  [0] * 4)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    batch = make_batch(target, ro, [0, 1, 2, 3], drafter.feature_layers, 5, 6, rng)
    first = None
    for _ in range(15):
        loss = drafter_loss(drafter, batch, 5, (0.1, 0.9, 1.0)).total
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first


@pytest.mark.parametrize("kind,rank", [("vanilla", 8), ("rnn", 8), ("none", 0)])
def test_draft_vocab_loss_is_the_loss_of_the_drafted_distribution(target, kind, rank):
    """Trained over a draft vocabulary of K tokens, the loss is the full-vocabulary one of the distribution the drafter
    then drafts from (its logits outside the K tokens at -inf): L1 against the target's whole softmax (so ``1 - L1 / 2``
    stays the acceptance), CE over the labels inside the K tokens; with K = V in a shuffled order it is the plain
    loss."""
    from dspark_kernels.drafters.draft_vocab import DraftVocab

    drafter = make_drafter(target, kind, rank)
    rng = random.Random(5)
    ro = Rollouts([[1, 5, 6, 7]] * 3, [[rng.randrange(4, VOCAB) for _ in range(20)] for _ in range(3)], [1.0] * 3,
                  [0] * 3)

    def batch_for(vocab):  # the same anchors, the target's distribution over ``vocab``
        return make_batch(target, ro, [0, 1, 2], drafter.feature_layers, 4, 5, random.Random(6), vocab)

    batch = batch_for(None)
    weights = (0.1, 0.9, 1.0) if rank else (1.0, 0.0, 0.0)
    full = drafter_loss(drafter, batch, 4, weights)
    base, hidden = drafter.forward_train(batch.features, batch.tokens, batch.anchors, 4)
    anchor_tok = batch.tokens.gather(1, batch.anchors.clamp(min=0))
    prev = torch.cat([anchor_tok[:, :, None], batch.labels[:, :, :-1]], dim=2)
    b, a, g, v = base.shape
    logits = drafter.head.teacher_forced(base.view(b * a, g, v), hidden.view(b * a, g, -1), prev.view(b * a, g))[0]
    logits = logits.view(b, a, g, v).detach()
    w = torch.exp(-torch.arange(g, dtype=torch.float32) / 4.0) * batch.valid
    p_t = torch.softmax(batch.target_logits, dim=-1)
    l1_full = (torch.softmax(logits, dim=-1) - p_t).abs().sum(-1)
    for decay in (4.0, 0.5):  # the slots' weights follow --slot-decay
        w_d = torch.exp(-torch.arange(g, dtype=torch.float32) / decay) * batch.valid
        expected = float((w_d * l1_full).sum() / w_d.sum())
        assert drafter_loss(drafter, batch, 4, weights, decay).l1 == pytest.approx(expected, rel=1e-5)

    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    drafter.draft_vocab = DraftVocab(ids, VOCAB)
    shuffled = drafter_loss(drafter, batch_for(drafter.draft_vocab), 4, weights)
    assert shuffled.l1 == pytest.approx(full.l1, rel=1e-5) and shuffled.ce == pytest.approx(full.ce, rel=1e-5)
    assert float(shuffled.total.detach()) == pytest.approx(float(full.total.detach()), rel=1e-5)

    k = 40
    drafter.draft_vocab = DraftVocab(ids[:k], VOCAB)
    sub = drafter_loss(drafter, batch_for(drafter.draft_vocab), 4, weights)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids[:k]] = False
    log_q = torch.log_softmax(logits.masked_fill(outside, float("-inf")), dim=-1)
    l1 = (log_q.exp() - p_t).abs().sum(-1)
    inside = ~outside[batch.labels]
    assert 0 < int((inside & batch.valid).sum()) < int(batch.valid.sum())  # both kinds of label occur
    ce = -log_q.gather(-1, batch.labels[..., None]).squeeze(-1).masked_fill(~inside, 0.0)
    assert sub.l1 == pytest.approx(float((w * l1).sum() / w.sum()), rel=1e-5)
    assert sub.ce == pytest.approx(float((w * ce).sum() / w.sum()), rel=1e-5)
    kept = (log_q.exp() - p_t)[..., ids[:k]].abs().sum(-1)  # without the target's mass outside the K tokens
    assert sub.l1 > float((w * kept).sum() / w.sum()) + 0.05


def test_save_load_round_trip_and_mismatch_errors(target, tmp_path):
    drafter = make_drafter(target, "rnn", 8)
    drafter.save(tmp_path / "d")
    back = load_block_drafter(tmp_path / "d", target)
    assert back.config == drafter.config and len(back.state_dict()) == len(drafter.state_dict())
    for (k, v), (k2, v2) in zip(drafter.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    cfg = drafter.config
    with pytest.raises(ValueError, match="vocab_size"):
        BlockDrafter(DrafterConfig(**{**cfg.__dict__, "vocab_size": VOCAB + 1}), target)
    with pytest.raises(ValueError, match="hidden_size"):
        BlockDrafter(DrafterConfig(**{**cfg.__dict__, "hidden_size": 32}), target)
    for layers in ((3,), (), (-1,), (99,), (0, 3), (1, 1)):
        with pytest.raises(ValueError, match="feature_layers"):
            BlockDrafter(DrafterConfig(**{**cfg.__dict__, "feature_layers": layers}), target)
    with pytest.raises(ValueError, match="gamma"):
        BlockDrafter(DrafterConfig(**{**cfg.__dict__, "gamma": 17}), target)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(target, drafter, [[1, 2]], 4, 0)
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_block_drafter(tmp_path / "d", target)


def test_anchor_feature_path_reads_the_predecessor_and_refuses_missing_context(target):
    """The anchor-feature path adds ``anchor_proj(H_ctx[P - 1])`` to the block input: the proposal equals a pass
    without the path whose input embedding carries that term; a request with no context, or a cache without the
    kept features, is a clear error; freeing a request forgets its feature."""
    drafter = make_drafter(target, ANCHOR)
    plain = make_drafter(target, "vanilla")
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("anchor_proj")})
    seq = [random.randrange(4, VOCAB) for _ in range(9)]
    feats = forward_outputs(target, [seq], drafter.feature_layers).features[0]
    cache, plain_cache = drafter.new_state(8, 4), plain.new_state(8, 4)
    for c, d in ((cache, drafter), (plain_cache, plain)):
        c.add_request(0)
        d.extend_context(c, [0], feats[:8], torch.tensor([0, 8], dtype=torch.int32))
    torch.testing.assert_close(cache.last_context[0], drafter.context_features(feats[7]))
    shift = drafter.anchor_proj(drafter.context_features(feats[7]))
    embed = plain.embed

    def shifted_embed(ids):
        return embed(ids) + shift
    plain.embed = shifted_embed
    ours, ref = drafter.propose(cache, [0], torch.tensor([seq[8]]), 4), plain.propose(plain_cache, [0],
                                                                                      torch.tensor([seq[8]]), 4)
    torch.testing.assert_close(ours.base_logits, ref.base_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours.base_logits, make_drafter(target).propose(plain_cache, [0], torch.tensor([seq[8]]),
                                                                             4).base_logits, atol=1e-3)
    cache.add_request(1)
    with pytest.raises(ValueError, match=r"requests \[1\] have no context"):
        drafter.propose(cache, [0, 1], torch.tensor([seq[8], seq[0]]), 4)
    from dspark_kernels.models.kv_cache import PagedKVCache

    bare = PagedKVCache(2, 8, 4, cache.num_kv_heads, cache.head_dim)
    bare.add_request(0)
    with pytest.raises(TypeError, match="BlockDrafterCache"):
        drafter.propose(bare, [0], torch.tensor([seq[8]]), 4)
    cache.free(0)
    assert 0 not in cache.last_context and cache.num_free_pages == 8


def test_traces_record_confidence_and_acceptance(target):
    drafter = make_drafter(target)
    res = speculative_generate(target, drafter, [[1, 5], [1, 6, 7]], 10, 4, temperature=1.0, seeds=[1, 2],
                               record_traces=True)
    conf, acc = res.extra["confidence_logits"], res.extra["accepted"]
    assert conf.shape == (res.rounds, 4) and acc.shape == (res.rounds,)
    assert torch.bincount(acc, minlength=5).tolist() == res.accept_hist



def _two_prefilled_caches(target, drafter, rids, prompts, samp):
    """Two target caches holding the same prefilled prompts (one for the round under test, one for a reference
    forward) and the prompts' first tokens."""
    from dspark_kernels.engine.rounds import PendingContext, prefill

    caches = []
    for _ in range(2):
        tcache, dstate = target.new_cache(16, 4), drafter.new_state(16, 4)
        for rid in rids:
            tcache.add_request(rid)
            drafter.add_request(dstate, rid)
        pending = PendingContext()
        first = prefill(target, drafter, tcache, dstate, rids, prompts, samp,
                        defer=lambda kept, pending=pending: pending.add(rids, kept))
        caches.append(tcache)
    return caches, first


@pytest.mark.parametrize("lens, wrong", [([3], None), ([2], 0), ([3, 3], 0), ([3, 0, 2], 2), ([1, 3, 2], 1)])
def test_verify_round_keeps_the_accepted_rows_of_ragged_requests(target, lens, wrong):
    """Greedy verify of ragged lengths (one request: slices; several: host-built indices): each request accepts the
    drafts that match the target's greedy tokens (request ``wrong`` gets its second draft corrupted), emits the target's
    next token, keeps the anchor and its accepted drafts with the features of the same ragged forward run on a second
    cache, and its cache grows by exactly what it kept."""
    from dspark_kernels.drafters import DraftOutput
    from dspark_kernels.engine.rounds import verify_round
    from dspark_kernels.sampling import Sampling

    drafter, gamma = make_drafter(target), 3
    prompts = [[1, 5, 9, 13], [1, 40], [1, 7, 8, 9, 10]][: len(lens)]
    rids = list(range(len(lens)))
    greedy = generate(target, prompts, gamma + 2).tokens  # anchor, the drafts all accepted, the bonus token
    samp = Sampling.of([0.0] * len(rids), [0] * len(rids), [1.0] * len(rids), rids, [1] * len(rids), target.device)
    caches, first = _two_prefilled_caches(target, drafter, rids, prompts, samp)
    assert first == [g[0] for g in greedy]
    drafts = [list(g[1: gamma + 1]) for g in greedy]
    if wrong is not None:
        drafts[wrong][1] = (drafts[wrong][1] + 1) % VOCAB
    anchors = torch.tensor(first)
    rnd = verify_round(target, drafter, caches[0], rids, anchors,
                       DraftOutput(torch.tensor([t for d in drafts for t in d]), None, None), torch.tensor(lens), gamma,
                       samp)
    expect = [min(n, 1) if i == wrong else n for i, n in enumerate(lens)]
    assert rnd.accepted == expect and rnd.num_accepted.tolist() == expect
    assert rnd.emitted == [g[1: a + 2] for g, a in zip(greedy, expect)]
    verified = [[first[i]] + drafts[i][: n] for i, n in enumerate(lens)]
    cu = torch.tensor([0, *torch.tensor([len(v) for v in verified]).cumsum(0).tolist()], dtype=torch.int32)
    fwd = target(torch.tensor([t for v in verified for t in v]), cu, rids, caches[1],
                 hidden_layers=drafter.feature_layers)
    feats = torch.cat([fwd.hidden_states[i] for i in drafter.feature_layers], -1)
    rows = [int(cu[i]) + j for i, a in enumerate(expect) for j in range(a + 1)]
    ids, kept_feats, kept_cu = rnd.kept
    assert ids.tolist() == [t for v, a in zip(verified, expect) for t in v[: a + 1]]
    assert kept_cu.tolist() == [0, *torch.tensor([a + 1 for a in expect]).cumsum(0).tolist()]
    torch.testing.assert_close(kept_feats, feats[rows], rtol=0, atol=0)
    assert [caches[0].length(r) for r in rids] == [len(p) + a + 1 for p, a in zip(prompts, expect)]

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_round_matches_a_forward_and_the_zero_draft_sampler(target, temperature):
    """A verify round with every length 0 (a plain step, :func:`plain_round`) emits, per request, the token the
    rejection sampler draws from the target's row after zero drafts (the general path's call), keeps each anchor with
    its target features, and grows each cache by one."""
    from dspark_kernels.engine.rounds import no_drafts, verify_round
    from dspark_kernels.ops import rejection_sample
    from dspark_kernels.ops.rejection_sample import rejection_noise
    from dspark_kernels.sampling import Sampling

    drafter = make_drafter(target)
    prompts, rids = [[1, 5, 9, 13], [1, 40]], [0, 1]
    samp = Sampling.of([temperature] * 2, [0, 0], [1.0, 1.0], [3, 4], [1, 1], target.device)
    caches, first = _two_prefilled_caches(target, drafter, rids, prompts, samp)
    anchors = torch.tensor(first)
    rnd = verify_round(target, drafter, caches[0], rids, anchors, no_drafts(2, 3, target.device),
                       torch.zeros(2, dtype=torch.int64), 3, samp)
    cu = torch.arange(3, dtype=torch.int32)
    fwd = target(anchors, cu, rids, caches[1], hidden_layers=drafter.feature_layers)
    zero_cu = torch.zeros(3, dtype=torch.int32)
    acc_u, smp_u = (None, None) if temperature == 0 else rejection_noise(samp.seed, samp.offset, zero_cu, 0,
                                                                         max_spec_len=3)
    ref = rejection_sample(torch.zeros(0, dtype=torch.int64), zero_cu, None, fwd.logits, samp.temperature,
                           samp.top_k, samp.top_p, acc_u, smp_u, max_spec_len=3)
    assert rnd.emitted == [[t] for t in ref.output_token_ids[:, 0].tolist()]
    assert rnd.accepted == [0, 0] and rnd.num_accepted.tolist() == [0, 0]
    ids, feats, kept_cu = rnd.kept
    assert ids.tolist() == first and kept_cu.tolist() == [0, 1, 2]
    torch.testing.assert_close(feats, torch.cat([fwd.hidden_states[i] for i in drafter.feature_layers], -1),
                               rtol=0, atol=0)
    assert [caches[0].length(r) for r in rids] == [len(p) + 1 for p in prompts]


def _kept(rows_per_request: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's ``kept`` with consecutive token ids from ``start`` and features ``[T, 2]`` = (id, -id)."""
    ids = torch.arange(start, start + sum(rows_per_request))
    cu = torch.tensor([0, *rows_per_request]).cumsum(0).to(torch.int32)
    return ids, torch.stack([ids.float(), -ids.float()], dim=1), cu


def test_pending_context_hands_each_request_its_rows_in_commit_order():
    """Ragged rounds for changing request sets: a take of any subset, in any order, returns each request's rows of
    every round it has not handed over yet, in commit order, with offsets aligned with the take's ids (an empty
    chunk for a request with none); taking exactly one whole round in its order returns that round's own tensors;
    dropped requests hand nothing over; ``longest`` counts pending rows on the host."""
    from dspark_kernels.engine.rounds import PendingContext

    pending, expect = PendingContext(), {}
    rounds = [([0, 1, 2], [3, 1, 2]), ([0, 2], [2, 1]), ([2, 1, 0], [1, 0, 4])]
    start = 100
    for rids, rows in rounds:
        kept = _kept(rows, start)
        pending.add(rids, kept)
        for rid, lo, hi in zip(rids, kept[2][:-1].tolist(), kept[2][1:].tolist()):
            expect.setdefault(rid, []).extend(kept[0][lo:hi].tolist())
        start += 50
    assert pending.longest([0, 1, 2]) == max(len(v) for v in expect.values()) and pending.longest([7]) == 0
    pending.drop(1)
    ids, feats, cu = pending.take([2, 5, 0], torch.device("cpu"))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, len(expect[2]), len(expect[2]), len(expect[2] + expect[0])]
    assert ids.tolist() == expect[2] + expect[0]
    assert torch.equal(feats, torch.stack([ids.float(), -ids.float()], dim=1))
    assert pending.take([0, 1, 2], torch.device("cpu")) is None

    whole = _kept([2, 1], 500)
    pending.add([3, 4], whole)
    assert pending.take([3, 4], torch.device("cpu")) is whole  # one whole round in its order: no copy
    pending.add([3, 4], whole)
    ids, _, cu = pending.take([4, 3], torch.device("cpu"))  # another order: sliced and concatenated
    assert ids.tolist() == [502, 500, 501] and cu.tolist() == [0, 1, 3]
    pending.add([3, 4], _kept([2, 0], 600))  # request 4 kept no row: its offsets would not align with [3, 4]
    ids, _, cu = pending.take([3, 4], torch.device("cpu"))
    assert ids.tolist() == [600, 601] and cu.tolist() == [0, 2, 2]

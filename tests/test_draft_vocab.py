"""Drafting over a draft vocabulary (a frequency-ranked subset of the target's tokens).

* the full vocabulary in id order drafts exactly what no draft vocabulary drafts;
* with a subset, tokens come from it, the reported draft rows are the drawn distributions (the full head's logits
  restricted to the subset, renormalised), 0 elsewhere;
* T = 0 output equals the target's greedy output; T = 1 output follows the target's distribution (chi-square), and a
  planted bug (draft probabilities reported at the wrong tokens) is caught;
* the token ranking is a permutation by count, written and read with clear errors.
"""

import random

import pytest
import torch

from dspark_kernels.drafters import load_drafter
from dspark_kernels.drafters.draft_vocab import RANKING_FILE, DraftVocab, load_token_ranking, save_token_ranking
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import generate, load_model
from dspark_kernels.ops.sequential_head import sequential_head
from dspark_kernels.train.token_ranking import coverage, token_ranking
from dspark_kernels.train.token_ranking import main as ranking_main
from tests.lossless import assert_follows_target
from tests.test_drafter_engine import ROLLOUT_PROMPTS, VOCAB, make_drafter, train_block_drafter
from tests.test_sequential_head import make_args, run_both
from tests.tiny_models import save_tiny_qwen3

K = 40  # of the tiny target's 96 tokens


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    return load_model(save_tiny_qwen3(tmp_path_factory.mktemp("target"), vocab_size=VOCAB))


@pytest.fixture(scope="module")
def ranking(target):
    responses = generate(target, ROLLOUT_PROMPTS, 24, temperature=1.0, seeds=list(range(len(ROLLOUT_PROMPTS))))
    return token_ranking(responses.tokens, VOCAB)


@pytest.fixture(scope="module")
def trained(target):
    return train_block_drafter(target, "vanilla", 8)


def _draft(drafter, vocab, temperature=1.0, seed=0, gamma=5):
    drafter.draft_vocab = vocab
    state = drafter.new_state(16, 4)
    rids = [0, 1, 2]
    for rid in rids:
        drafter.add_request(state, rid)
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(9, 2 * 64, generator=g)
    drafter.extend(state, rids, torch.zeros(9, dtype=torch.long), feats, torch.tensor([0, 4, 6, 9]))
    anchors = torch.tensor([5, 90, 17])
    temps = torch.full((3,), temperature)
    u = torch.rand(3 * gamma, generator=g).clamp(1e-6, 1 - 1e-6)
    out = drafter.draft(state, rids, anchors, gamma, temps, torch.zeros(3, dtype=torch.int64), torch.ones(3), u)
    drafter.draft_vocab = None
    return anchors, out


@pytest.mark.parametrize("kind,rank", [("vanilla", 8), ("gated", 8), ("rnn", 8), ("none", 0)])
def test_the_whole_vocabulary_in_id_order_drafts_the_same(target, kind, rank):
    drafter = make_drafter(target, kind, rank)
    _, plain = _draft(drafter, None)
    _, full = _draft(drafter, DraftVocab(torch.arange(VOCAB), VOCAB))
    assert torch.equal(plain.tokens, full.tokens)
    torch.testing.assert_close(full.draft_probs, plain.draft_probs, rtol=0, atol=0)
    if plain.confidence_logits is not None:
        torch.testing.assert_close(full.confidence_logits, plain.confidence_logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind,rank", [("vanilla", 8), ("gated", 8), ("rnn", 8), ("none", 0)])
def test_a_subset_drafts_its_own_tokens_with_the_restricted_distribution(target, ranking, kind, rank):
    drafter = make_drafter(target, kind, rank)
    vocab = DraftVocab.from_ranking(ranking, K)
    anchors, out = _draft(drafter, vocab, gamma=5)
    ids = vocab.ids
    assert bool(torch.isin(out.tokens, ids).all())
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert bool((out.draft_probs[:, outside] == 0).all())
    torch.testing.assert_close(out.draft_probs.sum(1), torch.ones(15), rtol=0, atol=1e-5)
    # replay: the full head's logits for the drawn tokens, restricted to the subset and renormalised
    drafter.draft_vocab = None
    state = drafter.new_state(16, 4)
    for rid in range(3):
        drafter.add_request(state, rid)
    g = torch.Generator().manual_seed(0)
    drafter.extend(state, [0, 1, 2], torch.zeros(9, dtype=torch.long), torch.randn(9, 2 * 64, generator=g),
                   torch.tensor([0, 4, 6, 9]))
    prop = drafter.propose(state, [0, 1, 2], anchors, 5)
    prev = torch.cat([anchors[:, None], out.tokens.view(3, 5)[:, :-1]], dim=1)
    with torch.no_grad():
        logits, conf = drafter.head.teacher_forced(prop.base_logits.view(3, 5, -1), prop.hidden.view(3, 5, -1), prev)
    want = torch.softmax(logits.view(15, -1)[:, ids], dim=-1)
    torch.testing.assert_close(out.draft_probs[:, ids], want, rtol=1e-5, atol=1e-6)
    if out.confidence_logits is not None:
        torch.testing.assert_close(out.confidence_logits, conf.view(-1), rtol=1e-5, atol=1e-5)


def test_greedy_speculative_with_a_subset_equals_target_greedy(target, trained, ranking):
    prompts = [[1, 5, 9], [1, 40, 41, 42, 43]]
    ar = generate(target, prompts, 20, temperature=0.0)
    trained.draft_vocab = DraftVocab.from_ranking(ranking, K)
    try:
        spec = speculative_generate(target, trained, prompts, 20, 4, temperature=0.0)
    finally:
        trained.draft_vocab = None
    assert spec.tokens == ar.tokens
    assert sum(spec.accept_hist[1:]) > 0  # drafts were accepted: the subset path really proposed


def _sampled(target, drafter, n=4000):
    prompt, steps = [1, 11, 12], 3
    spec = speculative_generate(target, drafter, [prompt] * n, steps, 3, temperature=1.0, seeds=list(range(n)))
    return prompt, steps, spec


def test_sampled_speculative_with_a_subset_is_lossless(target, trained, ranking):
    trained.draft_vocab = DraftVocab.from_ranking(ranking, K)
    try:
        prompt, steps, spec = _sampled(target, trained)
    finally:
        trained.draft_vocab = None
    rounds = sum(spec.accept_hist)
    assert sum(spec.accept_hist[1:]) > 0.05 * rounds and spec.accept_hist[0] > 0.05 * rounds
    assert_follows_target(target, prompt, spec.tokens, 1.0, steps)


def test_the_lossless_check_catches_probabilities_reported_at_the_wrong_tokens(target, trained, ranking,
                                                                               monkeypatch):
    """A planted bug: the subset's draft rows widened to the neighbouring ranks' tokens (so verification reads a draft
    probability that is not the drawn token's) must fail the same check."""
    vocab = DraftVocab.from_ranking(ranking, K)
    shifted = vocab.ids.roll(1)
    monkeypatch.setattr(DraftVocab, "widen", lambda self, p: None if p is None else
                        p.new_zeros(p.shape[0], self.vocab_size).index_copy_(1, shifted, p))
    trained.draft_vocab = vocab
    try:
        prompt, steps, spec = _sampled(target, trained)
    finally:
        trained.draft_vocab = None
    with pytest.raises(AssertionError):
        assert_follows_target(target, prompt, spec.tokens, 1.0, steps)


def test_op_reads_anchors_beyond_the_drafted_vocabulary():
    """``w1`` with more rows than ``base_logits`` has columns: anchors index all of them, drafts stay below V."""
    args = make_args([3, 0, 2, 4], 50, "vanilla", temps=[1.0, 0.7, 0.0, 1.2])
    w = args["weights"]
    extra = torch.randn(30, w.w1.shape[1])
    args["weights"] = w._replace(w1=torch.cat([w.w1, extra]))
    args["anchor_tokens"] = torch.tensor([55, 3, 79, 50])
    res = run_both(args)
    assert int(res.tokens.max()) < 50
    args["anchor_tokens"] = torch.tensor([55, 3, 80, 50])
    with pytest.raises(ValueError, match="anchor_tokens"):
        sequential_head(**args, impl="torch")
    args["weights"] = w._replace(w1=w.w1[:-1])
    args["anchor_tokens"] = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="weights.w1"):
        sequential_head(**args, impl="torch")


def test_token_ranking_orders_by_count_then_id_and_coverage_counts():
    ranking = token_ranking([[3, 3, 1], [1, 3, 4]], 6)
    assert ranking.tolist() == [3, 1, 4, 0, 2, 5]
    assert coverage(ranking, [[3, 1, 5, 5]], [1, 2, 6]) == {1: 0.25, 2: 0.5, 6: 1.0}


def test_ranking_files_round_trip_and_bad_ones_are_named(tmp_path):
    perm = torch.randperm(VOCAB)
    save_token_ranking(perm, tmp_path)
    assert torch.equal(load_token_ranking(tmp_path, VOCAB), perm)
    with pytest.raises(ValueError, match="ranking"):
        load_token_ranking(tmp_path, VOCAB + 1)
    with pytest.raises(FileNotFoundError, match=RANKING_FILE):
        load_token_ranking(tmp_path / "nowhere", VOCAB)
    (tmp_path / RANKING_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read"):
        load_token_ranking(tmp_path, VOCAB)
    with pytest.raises(ValueError, match="exactly once"):
        save_token_ranking(torch.tensor([0, 0, 1]), tmp_path)


@pytest.mark.parametrize("ids,match", [(torch.tensor([1, 1]), "distinct"), (torch.tensor([0, 96]), "distinct"),
                                       (torch.tensor([], dtype=torch.long), "1..96"),
                                       (torch.tensor([0.5]), "int tensor")])
def test_bad_subsets_are_refused(ids, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DraftVocab(ids, VOCAB)


def test_load_drafter_with_a_draft_vocabulary(target, ranking, tmp_path):
    drafter = make_drafter(target)
    drafter.save(tmp_path)
    with pytest.raises(FileNotFoundError, match=RANKING_FILE):
        load_drafter(tmp_path, target, draft_vocab=K)
    save_token_ranking(ranking, tmp_path)
    for bad in (0, VOCAB + 1, 2.5):
        with pytest.raises(ValueError, match="draft_vocab"):
            load_drafter(tmp_path, target, draft_vocab=bad)
    loaded = load_drafter(tmp_path, target, draft_vocab=K)
    assert torch.equal(loaded.draft_vocab.ids, ranking[:K])
    assert load_drafter(tmp_path, target).draft_vocab is None


def test_ranking_cli_writes_into_drafter_dirs(target, tmp_path, capsys):
    from dspark_kernels.train.rollouts import Rollouts, save_rollouts

    rng = random.Random(0)
    ro = Rollouts([[1, 2]] * 4, [[rng.randrange(4, VOCAB) for _ in range(10)] for _ in range(4)], [1.0] * 4, [0] * 4)
    save_rollouts(ro, tmp_path / "ro", "train")
    save_rollouts(ro, tmp_path / "ro", "heldout")
    make_drafter(target).save(tmp_path / "d")
    ranking_main(["--rollouts", str(tmp_path / "ro"), "--out", str(tmp_path / "d"), "--sizes", "8"])
    assert torch.equal(load_token_ranking(tmp_path / "d", VOCAB), token_ranking(ro.responses, VOCAB))
    assert '"8"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ranking_main(["--rollouts", str(tmp_path / "ro"), "--out", str(tmp_path / "ro")])

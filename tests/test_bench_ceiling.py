"""Parallel-drafting ceiling: the water-filling solver is exact, and the target's path distributions are read at the
right positions."""

import itertools

import pytest
import torch

from dspark_kernels.bench.ceiling import (
    best_unconditioned_acceptance,
    expected_acceptance,
    ideal_prefix_acceptance,
    path_distributions,
)
from dspark_kernels.models import load_model
from tests.tiny_models import save_tiny_qwen3


def test_identical_rows_reach_one():
    p = torch.softmax(torch.randn(5), 0).expand(4, -1)
    value, q = best_unconditioned_acceptance(p)
    assert value == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(q, p[0].double())


def test_disjoint_one_hot_rows():
    value, q = best_unconditioned_acceptance(torch.eye(4)[:2])
    assert value == pytest.approx(0.5, abs=1e-12)
    assert float(q.sum()) == pytest.approx(1.0, abs=1e-12)


def test_optimum_beats_every_other_draft():
    gen = torch.Generator().manual_seed(3)
    for s, v in ((3, 5), (8, 17), (32, 64)):
        p = torch.softmax(2 * torch.randn(s, v, generator=gen, dtype=torch.float64), dim=1)
        value, q = best_unconditioned_acceptance(p)
        assert float(q.sum()) == pytest.approx(1.0, abs=1e-12) and bool((q >= 0).all())
        assert expected_acceptance(q, p) == pytest.approx(value, abs=1e-12)
        others = [p.mean(0), *p, *torch.distributions.Dirichlet(torch.ones(v, dtype=torch.float64)).sample((200,))]
        assert max(expected_acceptance(o, p) for o in others) <= value + 1e-12


def test_matches_a_grid_search():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], dtype=torch.float64)
    grid = [torch.tensor([a, b, 1 - a - b], dtype=torch.float64)
            for a, b in itertools.product(torch.linspace(0, 1, 101).tolist(), repeat=2) if a + b <= 1 + 1e-12]
    best = max(expected_acceptance(q.clamp(min=0), p) for q in grid)
    assert best_unconditioned_acceptance(p)[0] == pytest.approx(best, abs=1e-9)


def test_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        best_unconditioned_acceptance(torch.ones(3))


def test_path_distributions_follow_the_target(tmp_path):
    target = load_model(save_tiny_qwen3(tmp_path / "t", vocab_size=48, peak=4.0))
    context, paths, gamma = [1, 5, 9, 4], 6, 3
    dists, tokens = path_distributions(target, context, paths, gamma, seed=0)
    assert dists.shape == (gamma, paths, 48)
    torch.testing.assert_close(dists.sum(-1), torch.ones(gamma, paths))
    # position 1 sees only the context: every path has the same distribution there
    assert best_unconditioned_acceptance(dists[0])[0] == pytest.approx(1.0, abs=1e-6)
    # each row is the target's next-token distribution after the context and that path's earlier tokens
    from dspark_kernels.models import generate

    assert tokens.tolist() == generate(target, [context] * paths, gamma, temperature=1.0, seeds=range(paths)).tokens
    for s in (0, paths - 1):
        seq = context + tokens[s, : gamma - 1].tolist()
        cache = target.new_cache(4, 16)
        cache.add_request(0)
        logits = target(torch.tensor(seq), torch.tensor([0, len(seq)], dtype=torch.int32), [0], cache).logits
        want = torch.softmax(logits[len(context) - 1:].float(), dim=-1)
        torch.testing.assert_close(dists[:, s], want, atol=1e-5, rtol=1e-4)
    assert (dists[1:] - dists[1:, :1]).abs().amax() > 1e-3  # later positions depend on the sampled tokens


def test_ideal_prefix_acceptance_matches_enumeration():
    """The path estimate of P(drafts 1..k accepted) converges to the exact sum over draft sequences."""
    gen = torch.Generator().manual_seed(5)
    v, n = 4, 40000
    p1 = torch.softmax(torch.randn(v, generator=gen, dtype=torch.float64), 0)
    p2 = torch.softmax(2 * torch.randn(v, v, generator=gen, dtype=torch.float64), 1)  # p2[x1] = p(x2 | x1)
    q = torch.softmax(torch.randn(2, v, generator=gen, dtype=torch.float64), 1)
    exact1 = float(torch.minimum(q[0], p1).sum())
    exact2 = float((torch.minimum(q[0], p1)[:, None] * torch.minimum(q[1][None, :], p2)).sum())
    x1 = torch.multinomial(p1, n, replacement=True, generator=gen)
    x2 = torch.multinomial(p2[x1], 1, generator=gen).squeeze(1)
    dists = torch.stack([p1.expand(n, v), p2[x1]])
    got = ideal_prefix_acceptance(dists, torch.stack([x1, x2], dim=1), q)
    assert float(got[0]) == pytest.approx(exact1, abs=0.01) and float(got[1]) == pytest.approx(exact2, abs=0.01)


def test_tables_from_synthetic_results():
    from dspark_kernels.bench.ceiling import summary_table

    anchors = [{"ceiling": [1.0, 0.9, 0.8], "ideal_survival": [1.0, 0.9, 0.72], "entropy": [0.5, 1.0, 0.2]},
               {"ceiling": [1.0, 0.5, 0.4], "ideal_survival": [1.0, 0.5, 0.2], "entropy": [4.0, 5.0, 6.0]}]
    data = {"settings": {"gamma": 3}, "results": [{
        "ceiling_by_position": [1.0, 0.7, 0.6], "ideal_survival_by_position": [1.0, 0.7, 0.46],
        "ideal_parallel_tau": 4.16, "anchors": anchors}]}
    acceptance = {"results": [{"drafter": "eagle", "temperature": 1.0, "gamma": 3, "tau": 2.5,
                               "acceptance_by_position": [0.5, 0.6, 0.7]},
                              {"drafter": "eagle", "temperature": 0.0, "gamma": 3, "tau": 9.0,
                               "acceptance_by_position": [0.9, 0.9, 0.9]}]}
    table = summary_table(data, acceptance)
    assert "| parallel ceiling (every anchor) | 1.00 | 0.70 | 0.60 |  |" in table
    assert "| ideal parallel drafter (conditional) | 1.00 | 0.70 | 0.66 | 4.16 |" in table
    assert "| eagle (measured) | 0.50 | 0.60 | 0.70 | 2.50 |" in table
    assert "| 0 - 1.5 | 1 (50%) | 0.90 | 0.80 | 3.62 |" in table
    assert "| 3 - inf | 1 (50%) | 0.50 | 0.40 | 2.70 |" in table

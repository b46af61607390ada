"""Shared statistical check for end-to-end losslessness: generated tokens vs the target's exact marginals, and the
first two tokens jointly."""

import torch
from scipy.stats import chisquare

from dspark_kernels.train.drafter_data import forward_outputs, target_logits


def exact_marginals(target, prompt: list[int], steps: int, temperature: float,
                    pairs: dict | None = None, min_mass: float = 1e-6) -> list[torch.Tensor]:
    """Exact distribution ``[V]`` (float64) of generated tokens 1..steps, enumerating prefixes with mass > ``min_mass``
    (the pruned mass is missing from later marginals: the chi-square pools it with the rare tokens).
    ``pairs`` (a dict, filled when given and ``steps >= 2``): the joint probability of each first-two-token prefix
    ``(t1, t2)`` kept by that enumeration."""
    prefixes = {(): 1.0}
    marginals = []
    for step in range(steps):
        items = list(prefixes.items())
        seqs = [prompt + list(p) for p, _ in items]
        logits = target_logits(target, forward_outputs(target, seqs, (0,)).last_hidden)
        last = logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
        probs = torch.softmax(last / temperature, dim=-1).double()
        marginal = torch.zeros(probs.shape[-1], dtype=torch.float64)
        nxt = {}
        for (p, w), row in zip(items, probs):
            marginal += w * row
            for tok in torch.nonzero(row * w > min_mass).flatten().tolist():
                nxt[p + (tok,)] = w * float(row[tok])
        marginals.append(marginal)
        prefixes = nxt
        if step == 1 and pairs is not None:
            pairs.update(prefixes)
    return marginals


def assert_follows_target(target, prompt: list[int], outputs: list[list[int]], temperature: float,
                          steps: int) -> None:
    """Chi-square (p > 1e-3) of the tokens at each of the first ``steps`` positions of ``outputs`` against the exact
    marginals, and (``steps >= 2``) of the first two tokens' pairs against their exact joint; tokens or pairs with
    expected count < 5 are pooled into one bin."""
    pairs: dict = {}
    assert_follows_marginals(exact_marginals(target, prompt, steps, temperature, pairs), pairs, outputs)


def assert_follows_marginals(marginals: list[torch.Tensor], pairs: dict, outputs: list[list[int]]) -> None:
    """:func:`assert_follows_target` against marginals (and pairs) :func:`exact_marginals` computed once."""
    n = len(outputs)
    steps = len(marginals)
    for pos, exact in enumerate(marginals):
        counts = torch.bincount(torch.tensor([t[pos] for t in outputs]), minlength=exact.numel()).double()
        expected = exact * n
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        p_value = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
        assert p_value > 1e-3, (pos, p_value)
    if steps >= 2:  # the joint of the first two tokens: a wrong conditional can hide behind right marginals
        seen: dict = {}
        for t in outputs:
            seen[(t[0], t[1])] = seen.get((t[0], t[1]), 0) + 1
        big = [pair for pair, p in pairs.items() if p * n >= 5]
        obs = [seen.get(pair, 0) for pair in big]
        exp = [pairs[pair] * n for pair in big]
        obs.append(n - sum(obs))
        exp.append(max(n - sum(exp), 1e-9))  # pairs expected fewer than 5 times, and the enumeration's pruned mass
        p_value = chisquare(obs, exp).pvalue
        assert p_value > 1e-3, ("pairs", p_value)

"""The trainers' CE / L1 terms over a draft vocabulary are the full-vocabulary terms of the distribution the drafter
drafts from (probability 0 outside the K tokens), with the chain trainer's broadcast layout."""

import pytest
import torch

from dspark_kernels.drafters.draft_vocab import DraftVocab
from dspark_kernels.train.draft_vocab_loss import ce_and_l1

V = 50


@pytest.mark.parametrize("k", [1, 17, V])
def test_draft_vocab_terms_are_those_of_the_widened_distribution(k):
    g = torch.Generator().manual_seed(k)
    ids = torch.randperm(V, generator=g)[:k]
    vocab = DraftVocab(ids, V)
    full = torch.randn(2, 3, 4, V, generator=g)  # [B, steps, P, V] draft logits over the whole vocabulary
    target = 2 * torch.randn(2, 1, 4, V, generator=g)  # broadcast over the steps, as the chain trainer passes it
    labels = torch.randint(0, V, (2, 1, 4), generator=g)
    labels[0, 0, 0] = ids[0]  # at least one label inside the draft vocabulary
    ce, l1 = ce_and_l1(full[..., ids], target[..., ids], labels, vocab, target.logsumexp(-1))

    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    log_q = torch.log_softmax(full.masked_fill(outside, float("-inf")), dim=-1)
    want_l1 = (log_q.exp() - torch.softmax(target, dim=-1)).abs().sum(-1)
    inside = ~outside[labels].expand(2, 3, 4)
    want_ce = -log_q.gather(-1, labels.expand(2, 3, 4)[..., None]).squeeze(-1).masked_fill(~inside, 0.0)
    torch.testing.assert_close(l1, want_l1)
    torch.testing.assert_close(ce, want_ce)
    if k == V:  # the whole vocabulary in another order: the plain terms
        plain_ce, plain_l1 = ce_and_l1(full, target, labels, None)
        torch.testing.assert_close(l1, plain_l1)
        torch.testing.assert_close(ce, plain_ce)


def test_draft_vocab_terms_need_the_whole_vocabulary_log_sum_exp():
    vocab = DraftVocab(torch.arange(5), V)
    with pytest.raises(ValueError, match="target_lse"):
        ce_and_l1(torch.randn(3, 5), torch.randn(3, 5), torch.zeros(3, dtype=torch.int64), vocab)

"""Round cost breakdown of the shipped DSpark drafter on SmolLM2 at batch 1: the target's verify forward (gamma + 1
rows), the drafter's backbone pass (its LM head included), its LM head alone, the sequential head op (greedy and
sampled); then the same drafter pieces over draft vocabularies of K tokens (``draft_vocab``); medians of 20.

``python scripts/round_costs_smollm2.py`` writes ``results/round_costs_smollm2.json``."""
import json
import statistics
import time

import torch

from dspark_kernels.drafters import load_drafter
from dspark_kernels.drafters.draft_vocab import DraftVocab, load_token_ranking
from dspark_kernels.models import load_model
from dspark_kernels.models.target_tokenizer import load_target_tokenizer
from dspark_kernels.ops import sequential_head

M = "smollm2-135m-instruct"
t = load_model(M)
d = load_drafter(f"dspark_kernels/assets/drafters/{M}/dspark", t)
tok = load_target_tokenizer(M)
ids = tok.encode_chat([{"role": "user", "content": "Explain in simple words what a computer network is."}])
def med(f, n=20):
    f()
    xs = []
    for _ in range(n):
        a = time.perf_counter()
        f()
        xs.append(time.perf_counter() - a)
    return statistics.median(xs) * 1e3
out = {}
for gamma in (7, 15):
    cache = t.new_cache(64, 16)
    cache.add_request(0)
    t(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32), [0], cache)
    def verify():
        t(torch.randint(100, 4000, (gamma + 1,)), torch.tensor([0, gamma + 1], dtype=torch.int32), [0], cache,
          check_inputs=False)
        cache.rollback(0, gamma + 1)
    def decode():
        t(torch.randint(100, 4000, (1,)), torch.tensor([0, 1], dtype=torch.int32), [0], cache, check_inputs=False)
        cache.rollback(0, 1)
    st = d.new_state(64, 16)
    d.add_request(st, 0)
    feats = torch.randn(len(ids), 3 * 576)
    d.extend_context(st, [0], feats, torch.tensor([0, len(ids)], dtype=torch.int32))
    anchors = torch.tensor([ids[-1]])
    prop = d.propose(st, [0], anchors, gamma)
    def backbone():
        d.propose(st, [0], anchors, gamma)
    h = torch.randn(gamma, 576)
    def lm_head():
        d.lm_logits(h)
    w = d.head.weights()
    cu = torch.tensor([0, gamma], dtype=torch.int32)
    def seq_head_greedy():
        sequential_head(prop.base_logits, prop.hidden, anchors, cu, w, torch.zeros(1), None, None, None,
                        check_inputs=False)
    def seq_head_sampled():
        sequential_head(prop.base_logits, prop.hidden, anchors, cu, w, torch.ones(1), None, None, torch.rand(gamma),
                        check_inputs=False)
    row = {"decode_ms": med(decode), "verify_ms": med(verify), "drafter_backbone_ms": med(backbone),
           "draft_lm_head_ms": med(lm_head), "sequential_head_greedy_ms": med(seq_head_greedy)}
    try:
        row["sequential_head_sampled_ms"] = med(seq_head_sampled)
    except Exception as e:
        row["sequential_head_sampled_ms"] = f"error: {e}"
    round_ms = row["verify_ms"] + row["drafter_backbone_ms"] + row["sequential_head_greedy_ms"]
    row["sequential_head_share_of_round"] = row["sequential_head_greedy_ms"] / round_ms
    row["draft_lm_head_share_of_round"] = row["draft_lm_head_ms"] / round_ms
    ranking = load_token_ranking(f"dspark_kernels/assets/drafters/{M}/dspark", t.config.vocab_size)
    row["draft_vocab"] = {}
    for k in (4096, 8192, 16384):
        d.draft_vocab = DraftVocab.from_ranking(ranking, k)
        sub = d.propose(st, [0], anchors, gamma)
        def sub_head():
            d.draft_vocab.sequential_head(sub.base_logits, sub.hidden, anchors, cu, w, torch.zeros(1), None, None,
                                          None, check_inputs=False)
        row["draft_vocab"][k] = {"drafter_backbone_ms": med(backbone),
                                 "draft_lm_head_ms": med(lambda: d.draft_logits(h)),
                                 "sequential_head_greedy_ms": med(sub_head)}
        d.draft_vocab = None
    out[f"gamma{gamma}"] = row
    print(gamma, json.dumps(row))
json.dump(out, open("results/round_costs_smollm2.json", "w"), indent=1)

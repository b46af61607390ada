"""Drive the ops the way a serving engine's decode step would, through the engine-layout adapters.

One step for a batch of running requests (dense draft block per request, as SGLang's block drafters keep it):

1. draft: ``gamma`` tokens per request from the drafter, with per-request uniforms derived on the device from
   ``seeds``/``offsets`` tensors (no generator state, so the step can be captured in a CUDA graph); the same pass
   takes the tokens committed since the request's last draft into the drafter's context (``context``);
2. schedule: optionally, SGLang-style ``schedule_verify_lens_topk`` picks how many drafts of each request to verify
   under a token ``budget`` (calibrated prefix survival of the confidence head); without a budget all are verified;
3. pack: the admitted drafts become vLLM's flattened ``draft_token_ids [N]`` + ``cu_num_draft_tokens [B]`` (inclusive)
   and the verify batch ``[anchor, drafts...]`` per request, whose logits are exactly vLLM's ``logits_indices`` rows;
4. verify: one target forward over the ragged batch, then ``rejection_sample_vllm`` (int32 output, ``-1`` padding);
5. commit: the one device-to-host copy of the step (the emitted tokens, as every engine reads them), KV rollback of
   the rejected drafts; the kept tokens with their target features wait for the next step's draft pass
   (:class:`~dspark_kernels.engine.PendingContext`).

On the CPU with the reference ops (and with the shipped demo models) this produces exactly the tokens of the
library's own loop, :func:`dspark_kernels.engine.speculative.speculative_generate` (checked by
``tests/test_adapters.py``), at T > 0 too: it runs the same passes over the same rows (extending the drafter's context
in a pass of its own instead would round its keys and values differently in the last bit, and a T > 0 draw at a
boundary can follow that). Run: ``python examples/engine_step.py --budget 12``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dspark_kernels.adapters import pack_verified_drafts, rejection_sample_vllm, schedule_verify_lens_topk
from dspark_kernels.engine import DRAFT_NOISE_STREAM, PendingContext, Sampling, features_of, finish_reason, prefill
from dspark_kernels.noise import uniform_noise

ASSETS = Path(__file__).resolve().parents[1] / "dspark_kernels" / "assets"


def engine_step(target, drafter, tcache, dstate, rids: list[int], anchors: torch.Tensor, gamma: int,
                sampling: Sampling, budget: int | None, pending: PendingContext,
                impl: str | None = None) -> list[list[int]]:
    """One draft -> schedule -> verify -> commit step for requests ``rids`` (anchors ``[R]`` on the device);
    returns each request's emitted tokens (accepted drafts, then the correction or bonus token). ``pending`` holds
    the tokens each request committed since its last draft; the draft takes them, the commit adds this step's."""
    r, dev = len(rids), anchors.device
    uniforms = uniform_noise(sampling.seed, sampling.offset, (gamma,), stream=DRAFT_NOISE_STREAM).reshape(-1)
    drafted = drafter.draft(dstate, rids, anchors, gamma, sampling.temperature, sampling.top_k, sampling.top_p,
                            uniforms, impl=impl, context=pending.take(rids, dev))

    if budget is None or drafted.confidence_logits is None:
        verify_lens = torch.full((r,), gamma, dtype=torch.int32, device=dev)
    else:
        verify_lens = schedule_verify_lens_topk(drafted.confidence_logits.view(r, gamma), budget, impl=impl,
                                                check_inputs=False)

    probs = None if sampling.greedy else drafted.draft_probs.view(r, gamma, -1)
    draft_ids, cu, draft_probs = pack_verified_drafts(drafted.tokens.view(r, gamma), verify_lens, probs)
    # verify batch: request r contributes [anchor_r, its admitted drafts]; cu_q = cu + r
    cu_q = cu + torch.arange(r + 1, dtype=torch.int32, device=dev)
    block = torch.cat([anchors[:, None], drafted.tokens.view(r, gamma)], dim=1)
    in_window = torch.arange(gamma + 1, device=dev)[None, :] <= verify_lens[:, None].long()
    tokens = block[in_window]
    layers = tuple(drafter.feature_layers)
    fwd = target(tokens, cu_q, rids, tcache, hidden_layers=layers, impl=impl, check_inputs=False)

    out, num_accepted = rejection_sample_vllm(draft_ids, cu[1:], gamma, draft_probs, fwd.logits,
                                              sampling.temperature, sampling.top_k, sampling.top_p,
                                              sampling.seed, sampling.offset, impl=impl, check_inputs=False)

    out_host, lens_host = out.cpu().tolist(), verify_lens.cpu().tolist()  # the step's one device-to-host copy
    emitted, keep, start = [], [], 0
    for rid, row, l_r in zip(rids, out_host, lens_host):
        toks = [t for t in row if t != -1]
        accepted = len(toks) - 1
        tcache.rollback(rid, l_r - accepted)
        keep.extend(range(start, start + accepted + 1))
        start += l_r + 1
        emitted.append(toks)
    keep_t = torch.tensor(keep, dtype=torch.int64, device=dev)
    keep_cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor([len(e) for e in emitted]).cumsum(0)])
    pending.add(rids, (tokens[keep_t], features_of(fwd.hidden_states, layers)[keep_t], keep_cu.to(dev, torch.int32)))
    return emitted


def run(target, drafter, prompts: list[list[int]], max_new_tokens: int, gamma: int, temperature: float = 0.0,
        seeds: list[int] | None = None, budget: int | None = None, eos_token_id: int | None = None,
        page_size: int = 16, impl: str | None = None) -> list[list[int]]:
    """Decode ``prompts`` with :func:`engine_step` until each hits EOS or ``max_new_tokens``; new tokens per prompt.
    Request i's step t uses noise counter ``(seeds[i], t)`` (the prefill is step 0), like the library's own loop."""
    n, dev = len(prompts), target.device
    seeds = list(seeds) if seeds is not None else [0] * n
    pages = sum(-(-(len(p) + max_new_tokens + gamma + 1) // page_size) for p in prompts)
    tcache, dstate = target.new_cache(pages, page_size), drafter.new_state(pages, page_size)
    for i in range(n):
        tcache.add_request(i)
        drafter.add_request(dstate, i)
    step = [0] * n

    def sampling(live):
        return Sampling.of([temperature] * len(live), [0] * len(live), [1.0] * len(live),
                           [seeds[i] for i in live], [step[i] for i in live], dev)

    live = list(range(n))
    pending = PendingContext()
    out = [[tok] for tok in prefill(target, drafter, tcache, dstate, live, prompts, sampling(live), impl,
                                    defer=lambda kept: pending.add(live, kept))]
    while True:
        for i in live:
            step[i] += 1
        still = []
        for i in live:
            if finish_reason(out[i], max_new_tokens, eos_token_id) is None:
                still.append(i)
            else:
                tcache.free(i)
                drafter.free(dstate, i)
                pending.drop(i)
        live = still
        if not live:
            return out
        anchors = torch.tensor([out[i][-1] for i in live], dtype=torch.int64, device=dev)
        for i, toks in zip(live, engine_step(target, drafter, tcache, dstate, live, anchors, gamma, sampling(live),
                                             budget, pending, impl)):
            out[i].extend(toks)


def main() -> None:
    from dspark_kernels.drafters import load_drafter
    from dspark_kernels.models import load_model
    from dspark_kernels.train.tokenizer import BOS_ID, EOS_ID, load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=None, help="verify-token budget per step (default: verify all)")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    target = load_model(ASSETS / "target")
    tok = load_tokenizer(ASSETS / "target")
    drafter = load_drafter(ASSETS / "drafters" / "dspark", target)
    texts = ["import os\n\n\ndef list_python_files(root):\n", "The module provides"]
    outs = run(target, drafter, [[BOS_ID] + tok.encode(t).ids for t in texts], args.max_new_tokens, args.gamma,
               args.temperature, seeds=[1, 2], budget=args.budget, eos_token_id=EOS_ID)
    for text, new in zip(texts, outs):
        print(repr(text + tok.decode(new)))


if __name__ == "__main__":
    main()

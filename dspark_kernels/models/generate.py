"""Plain batched autoregressive generation with the target model (the non-speculative baseline), and
:func:`forward_sequences`, one forward over whole sequences (scoring, drafter features).

One ragged prefill forward for all prompts, then decode steps that feed one token per live request. Greedy at
temperature 0; otherwise each request samples with its own temperature / top-k / top-p through the project's sampler
op (:func:`dspark_kernels.ops.rejection_sample` with zero drafts), with counter-based noise from per-request seeds, so
a request's output does not depend on what it is batched with.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..reference._sampling import argmax_rows
from ..request_checks import check_decode_args, check_model, check_requests, check_step_logits
from ..sampling import PromptSampling, next_tokens
from .transformer import CausalLM, ForwardOutput

__all__ = ["GenerateResult", "forward_sequences", "generate"]


@dataclass
class GenerateResult:
    """``tokens[i]``: new tokens of prompt ``i`` (EOS included when hit); ``finish_reasons[i]``: "eos" | "length";
    ``steps``: forward passes (prefill included); ``elapsed_s``: wall time; ``prefill_s``: time of the prefill step."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    steps: int
    elapsed_s: float
    prefill_s: float

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)


@torch.no_grad()
def forward_sequences(model: CausalLM, seqs: Sequence[Sequence[int]], **forward_kwargs) -> tuple[ForwardOutput,
                                                                                                  torch.Tensor]:
    """One ragged forward of whole token sequences as requests ``0..n-1`` of a fresh paged cache (page size 16).

    Returns the forward's output and ``cu [n + 1]`` int32, the sequences' offsets in the flattened rows, both on the
    model's device; ``forward_kwargs`` go to the forward (``logits_indices``, ``hidden_layers``, ``check_inputs``).
    """
    lens = [len(s) for s in seqs]
    cache = model.new_cache(sum(-(-n // 16) for n in lens), 16)
    for i in range(len(seqs)):
        cache.add_request(i)
    dev = model.device
    cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(dev, torch.int32)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=dev)
    return model(ids, cu, list(range(len(seqs))), cache, **forward_kwargs), cu


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seeds: Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    page_size: int = 16,
    impl: str | None = None,
) -> GenerateResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    Args:
        model: target model.
        prompts: token-id lists (each non-empty, ids in the vocabulary; prompt + ``max_new_tokens`` within the
            model's ``max_position_embeddings``).
        max_new_tokens: per-request cap on new tokens.
        temperature, top_k, top_p: scalars or one value per prompt (0 / 0 / 1 = off); temperature 0 is greedy.
        seeds: one int per prompt for reproducible sampling (``None``: drawn from torch's global RNG).
        eos_token_id: stop token id, or several (e.g. ``model.config.eos_token_ids``); ``None`` never stops early.
        page_size: KV-cache page size (the cache is sized for every prompt plus ``max_new_tokens``).
        impl: kernel implementation for attention / sampling (``None``: by device).
    Returns:
        :class:`GenerateResult`.
    """
    check_model(model, "model")
    check_decode_args(max_new_tokens, page_size)
    prompts, eos = check_requests(model.config, prompts, max_new_tokens, eos_token_id)
    n = len(prompts)
    dev = model.device
    sampler = PromptSampling(temperature, top_k, top_p, seeds, n)
    out: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    t0 = time.perf_counter()
    if n == 0 or max_new_tokens == 0:
        return GenerateResult(out, reasons, 0, 0.0, 0.0)

    num_pages = sum(-(-(len(p) + max_new_tokens) // page_size) for p in prompts)
    cache = model.new_cache(num_pages, page_size)
    for i in range(n):
        cache.add_request(i)

    live = list(range(n))
    feed = prompts
    steps, prefill_s = 0, 0.0
    while live:
        lens = [len(f) for f in feed]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        ids = torch.tensor([t for f in feed for t in f], dtype=torch.int64, device=dev)
        last = (cu[1:] - 1).long()
        logits = model(ids, cu, live, cache, logits_indices=last, impl=impl, check_inputs=steps == 0).logits
        steps += 1
        if sampler.greedy:  # no parameter tensors to build
            check_step_logits(logits, live)
            nxt = argmax_rows(logits).tolist()
        else:  # noise offset = tokens a request generated so far, so its draw at step t depends on its seed and t only
            sampling = sampler.of(live, [len(out[i]) for i in live], dev)
            check_step_logits(logits, live, temperature=sampling.temperature)
            nxt = next_tokens(logits, sampling, impl)
        if steps == 1:
            _sync(dev)
            prefill_s = time.perf_counter() - t0
        still = []
        for i, tok in zip(live, nxt):
            out[i].append(tok)
            if tok in eos:
                reasons[i] = "eos"
            elif len(out[i]) < max_new_tokens:
                still.append(i)
                continue
            cache.free(i)
        live = still
        feed = [[out[i][-1]] for i in live]
    _sync(dev)
    return GenerateResult(out, reasons, steps, time.perf_counter() - t0, prefill_s)

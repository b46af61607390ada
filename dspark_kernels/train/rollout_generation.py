"""Continuous-batched target rollouts that can record, in the same forwards, the target features a drafter trains on.

Up to ``batch_size`` requests decode together; as they stop (EOS or ``max_new_tokens``), the next prompts are
admitted, once an eighth of the batch is free, and prefilled in a forward of their own, so the batch stays full
instead of draining to a tail of one or two requests (what a static batch of long, ragged chat answers spends most of
its steps on).

Request ``j`` (counted from ``first_index``) samples with seed ``seed + j`` and temperature ``temperatures[j % len]``;
its noise at step ``t`` depends only on that seed and ``t`` (:class:`dspark_kernels.sampling.PromptSampling`), so its
tokens do not depend on what it is batched with, up to the float rounding of batched GEMMs.

With ``feature_layers`` the forwards also return, for every position ``p`` of a rollout but its last (``seq_len - 1``
rows: a drafter never needs the last token's features or distribution), the features of
:class:`RolloutFeatures`. They are exactly what :func:`dspark_kernels.train.drafter_data.forward_outputs` would
recompute with a separate forward over the finished sequence (up to rounding), at no extra target compute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models import CausalLM
from ..sampling import PromptSampling, next_tokens


@dataclass
class RolloutFeatures:
    """Per position ``p < seq_len - 1`` of one rollout (prompt + response):

    features [seq_len - 1, m * hidden] bfloat16: raw outputs of the ``m`` feature layers, concatenated;
    last_hidden [seq_len - 1, hidden] float32: raw output of the last decoder layer (the final norm and LM head of
        the target turn it into the target's logits for token ``p + 1``);
    logsumexp [seq_len - 1] float32: log-sum-exp of those logits over the whole vocabulary for ``p >= prompt_len - 1``
        (what a reduced draft vocabulary needs to normalise target probabilities), NaN over the prompt before that.
    """

    features: torch.Tensor
    last_hidden: torch.Tensor
    logsumexp: torch.Tensor


@dataclass
class _Live:
    out: list[int]
    feats: list[torch.Tensor]
    last: list[torch.Tensor]
    lse: list[torch.Tensor]


def continuous_generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperatures: Sequence[float],
    batch_size: int,
    seed: int,
    eos_token_id: Sequence[int],
    feature_layers: Sequence[int] | None = None,
    first_index: int = 0,
    impl: str | None = None,
    on_done: Callable[[int], None] | None = None,
) -> tuple[list[list[int]], list[RolloutFeatures] | None]:
    """Generate a response to every prompt (token id lists) with continuous batching.

    Returns ``(responses, features)``: ``responses[i]`` the new tokens of prompt ``i`` (EOS included when hit);
    ``features[i]`` its :class:`RolloutFeatures` when ``feature_layers`` is given, else ``features`` is ``None``.
    ``on_done(i)`` is called as each request finishes (progress).
    """
    n = len(prompts)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    eos = set(int(t) for t in eos_token_id)
    temps = [float(temperatures[(first_index + i) % len(temperatures)]) for i in range(n)]
    sampler = PromptSampling(temps, 0, 1.0, [seed + first_index + i for i in range(n)], n)
    last_layer = model.config.num_hidden_layers - 1
    layers = list(feature_layers) if feature_layers is not None else []
    want = sorted(set(layers) | {last_layer}) if feature_layers is not None else []
    dev = model.device
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    cache = model.new_cache(batch_size * -(-longest // 16), 16)
    pending = deque(range(n))
    state: dict[int, _Live] = {}
    responses: list[list[int]] = [[] for _ in range(n)]
    features: list[RolloutFeatures | None] = [None] * n
    feed: dict[int, list[int]] = {}
    admit_group = max(1, batch_size // 8)

    def step(live: list[int]) -> None:
        """One forward over ``live``'s fed tokens, then sample each one's next token and retire the finished."""
        lens = [len(feed[i]) for i in live]
        cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)
        ids = torch.tensor([t for i in live for t in feed[i]], dtype=torch.int64, device=dev)
        result = model(ids, cu.to(dev, torch.int32), live, cache, logits_indices=(cu[1:] - 1).to(dev),
                       hidden_layers=want, impl=impl, check_inputs=False)
        logits = result.logits
        if feature_layers is not None:
            feat = torch.cat([result.hidden_states[layer] for layer in layers], dim=-1).to("cpu", torch.bfloat16)
            last = result.hidden_states[last_layer].to("cpu", torch.float32)
            lse = torch.logsumexp(logits, dim=-1).cpu()
            bounds = cu.tolist()
            for r, i in enumerate(live):
                a, b = bounds[r], bounds[r + 1]
                st = state[i]
                st.feats.append(feat[a:b])
                st.last.append(last[a:b])
                row_lse = torch.full((b - a,), float("nan"))
                row_lse[-1] = lse[r]
                st.lse.append(row_lse)
        nxt = next_tokens(logits, sampler.of(live, [len(state[i].out) for i in live], dev), impl)
        for i, tok in zip(live, nxt):
            st = state[i]
            st.out.append(tok)
            if tok in eos or len(st.out) >= max_new_tokens:
                cache.free(i)
                del state[i], feed[i]
                responses[i] = st.out
                if feature_layers is not None:
                    features[i] = RolloutFeatures(torch.cat(st.feats), torch.cat(st.last), torch.cat(st.lse))
                if on_done is not None:
                    on_done(i)
            else:
                feed[i] = [tok]

    while pending or state:
        free = batch_size - len(state)
        if pending and (free >= admit_group or not state):
            # prefill the admitted prompts in a forward of their own: mixed with one-token decode rows, a prompt's
            # length would pad every decode row's attention to it
            new = [pending.popleft() for _ in range(min(free, len(pending)))]
            for i in new:
                cache.add_request(i)
                state[i] = _Live([], [], [], [])
                feed[i] = list(prompts[i])
            step(new)
        else:
            step(list(state))
    return responses, (features if feature_layers is not None else None)  # type: ignore[return-value]

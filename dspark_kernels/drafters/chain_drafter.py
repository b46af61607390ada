"""EAGLE-style autoregressive chain drafter (and MTP-1, the same model trained and used for one draft token).

Model: one target-family causal decoder layer (pre-norm attention with Qwen3 q/k-norm + SwiGLU MLP). Its input at
position ``t`` is the *pair* ``(f_t, x_{t+1})``::

    in_t = fc([f_t ; embed(x_{t+1})])        (2 * hidden -> hidden, bias-free)
           fc([feature_norm(f_t) ; token_norm(embed(x_{t+1}))])   with ``input_norm``
    g_t  = layer(in_t)                      (causal over the request's pairs 0..t)
    logits_t = lm_head(norm(g_t))           -> predicts x_{t+2}

where ``f_t`` is the target's raw output of ONE layer (``feature_layer``, by default the last non-final layer) at
position ``t``. The embedding and LM head are the target's, frozen and not stored with the drafter.

Inference state (:class:`ChainState`): a paged KV cache with one entry per *committed pair* (pair ``j`` at position
``j``) plus, per request, the pending feature of the last extended position (its pair waits for the next token).

* ``extend`` (committed tokens ``x_P .. x_{P+n-1}`` with features ``f_P .. f_{P+n-1}``) writes the pairs
  ``(pending, x_P), (f_P, x_{P+1}) .. (f_{P+n-2}, x_{P+n-1})`` and makes ``f_{P+n-1}`` the new pending feature. With
  one layer a pair's K/V depend only on its own input, so extending needs no attention. ``draft(context=...)`` does
  the same inside its first step, in the same GEMMs as the anchors' pairs.
* ``draft`` (anchor ``x_A`` = the last emitted token, not yet extended): step 1 runs the pair ``(pending, x_A)`` at
  position ``A - 1``; step ``k > 1`` runs ``(g_prev, d_{k-1})`` at the next position (EAGLE-1: the drafter's own output
  hidden replaces the target feature it does not have). Each step is sampled by
  :func:`~dspark_kernels.ops.sequential_head` with kind ``"none"`` (plain filtered sampling, exactly the verifier's
  temperature/top-k/top-p filter, one uniform per drafted token) and returns the exact draft distribution. Afterwards
  every cache entry written by the draft is rolled back (the pending pair included: the next ``extend`` re-adds it with
  the then-committed anchor), so the cache holds only committed pairs.

Training (:meth:`ChainDrafter.forward_train`) is teacher-forced over whole sequences with a "training-time test"
unroll: step ``k`` at position ``t`` feeds ``(g^{k-1}_{t-1}, x_{t+1})`` and attends to the step-1 (true-feature) pairs
at positions ``<= t - k + 1`` plus the step-``j`` pairs at position ``t - k + j`` (``j = 2..k``), which is exactly what
chain step ``k`` from anchor ``A = t - k + 2`` sees at inference (teacher-forced tokens).

MTP-1 is a ``ChainDrafter`` with ``max_steps = 1``, trained on step 1 only; it accepts any ``gamma`` at inference
but is meant for (and benchmarked with) ``gamma = 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import ModelConfig
from ..models.fused_linear import fuse_projections
from ..models.gemm_dtype import cast_gemm_weights
from ..models.kv_cache import PagedKVCache
from ..models.transformer import CausalLM, RMSNorm
from ..ops import verify_attention
from ..ops.sequential_head import SequentialHeadWeights
from .api import DraftContext, DraftOutput, load_drafter_weights, read_drafter_config, save_drafter
from .block_drafter import DraftLayer
from .draft_vocab import DraftVocab, draft_logits, draw

__all__ = ["ChainDrafter", "ChainDrafterConfig", "ChainState", "load_chain_drafter"]

MAX_STEPS = 16
_NONE_HEAD = SequentialHeadWeights("none")


@dataclass(frozen=True)
class ChainDrafterConfig:
    """Hyper-parameters of a chain drafter (stored as ``drafter_config.json``).

    ``feature_layer``: the target layer whose raw output is the feature (-1 = the last non-final layer,
    ``num_hidden_layers - 2``, resolved by :meth:`resolved`); ``max_steps``: the chain length it was trained for
    (1 = MTP-1); ``vocab_size``/``hidden_size`` record the target, so a mismatched target is refused.
    ``input_norm``: RMS-normalise the feature and the token embedding apiece before ``fc``. A target's raw residual
    stream can be far larger than its embeddings (SmolLM2-135M: a median token RMS of about 30 at layer 28 against
    0.13 for an embedding), and without the norms ``fc`` starts out reading the feature alone.
    """

    feature_layer: int
    vocab_size: int
    hidden_size: int
    max_steps: int = 4
    name: str = "eagle"
    input_norm: bool = False

    def resolved(self, target: ModelConfig) -> "ChainDrafterConfig":
        if self.feature_layer == -1:
            return dataclasses.replace(self, feature_layer=target.num_hidden_layers - 2)
        return self

    def validate(self, target: ModelConfig) -> None:
        if not isinstance(self.max_steps, int) or not 1 <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"max_steps must be an int in 1..{MAX_STEPS}, got {self.max_steps!r}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab_size {self.vocab_size} does not match the target's {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            raise ValueError(f"drafter hidden_size {self.hidden_size} does not match the target's "
                             f"{target.hidden_size}")
        if not 0 <= self.feature_layer < target.num_hidden_layers - 1:
            raise ValueError(
                f"feature_layer {self.feature_layer} must be a target layer in [0, {target.num_hidden_layers - 1}) "
                "(the final layer is excluded: HF exposes it only after the final norm)"
            )


class ChainState:
    """Per-batch drafter state: the pairs' paged KV cache and each request's pending feature."""

    def __init__(self, cache: PagedKVCache, hidden: int) -> None:
        self.cache = cache
        self.pending: dict[Hashable, torch.Tensor] = {}  # rid -> feature [hidden] of the last extended position
        self.hidden = hidden

    def add_request(self, rid: Hashable) -> None:
        self.cache.add_request(rid)

    def free(self, rid: Hashable) -> None:
        self.cache.free(rid)
        self.pending.pop(rid, None)

    def num_pairs(self, rid: Hashable) -> int:
        """Committed pairs held in the cache for ``rid``."""
        return self.cache.length(rid)


@dataclass
class ChainDraft:
    """``tokens [R, gamma]``, ``draft_probs [R, gamma, V]`` (None when drafted without uniforms: all greedy),
    ``logits [R, gamma, V]`` (unfiltered, fp32; ``[R, gamma, K]`` over a draft vocabulary) and
    ``hidden [R, gamma, hidden]`` of every chain step."""

    tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    logits: torch.Tensor
    hidden: torch.Tensor


class ChainDrafter(nn.Module):
    """EAGLE-style chain drafter (MTP-1 with ``max_steps = 1``) bound to a target's embedding and LM head."""

    def __init__(self, cfg: ChainDrafterConfig, target: CausalLM) -> None:
        super().__init__()
        cfg = cfg.resolved(target.config)
        cfg.validate(target.config)
        self.config = cfg
        self.layer_config = dataclasses.replace(target.config, num_hidden_layers=1)
        h = target.config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        if cfg.input_norm:
            self.feature_norm = RMSNorm(h, target.config.rms_norm_eps)
            self.token_norm = RMSNorm(h, target.config.rms_norm_eps)
        self.layer = DraftLayer(self.layer_config)
        self.norm = RMSNorm(h, target.config.rms_norm_eps)
        self.__dict__["target"] = target  # frozen, shared: not a parameter, not saved
        self.draft_vocab: DraftVocab | None = None  # drafting over a subset of the vocabulary (.draft_vocab)

    # ------------------------------------------------------------------ shared pieces
    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Activation (and cache) dtype; the linear weights may be in a GEMM dtype (:mod:`.gemm_dtype`)."""
        return self.norm.weight.dtype

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.config.feature_layer,)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.target.model.embed_tokens.weight).to(self.dtype)

    def lm_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(self.norm(g).to(self.target.dtype)).float()

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """The logits drafting uses: :meth:`lm_logits` ``[..., V]``, or ``[..., K]`` over :attr:`draft_vocab`."""
        return draft_logits(self.draft_vocab, self.target.lm_head, self.norm(g).to(self.target.dtype))

    def pair_inputs(self, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``feats [..., hidden]`` and next-token ids ``[...]`` -> layer inputs ``[..., hidden]``."""
        feats, emb = feats.to(self.dtype), self.embed(ids)
        if self.config.input_norm:
            feats, emb = self.feature_norm(feats), self.token_norm(emb)
        return self.fc(torch.cat([feats, emb], dim=-1))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.target._rope(positions, self.dtype)

    # ------------------------------------------------------------------ inference (the Drafter protocol)
    def new_state(self, num_pages: int, page_size: int = 16) -> ChainState:
        c = self.layer_config
        cache = PagedKVCache(1, num_pages, page_size, c.num_key_value_heads, c.head_dim, dtype=self.dtype,
                             device=self.device)
        return ChainState(cache, c.hidden_size)

    def add_request(self, state: ChainState, rid: Hashable) -> None:
        state.add_request(rid)

    def free(self, state: ChainState, rid: Hashable) -> None:
        state.free(rid)

    def _context_pairs(self, state: ChainState, rids: list, token_ids: torch.Tensor, features: torch.Tensor,
                       cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Reserve the cache for the pairs that committed tokens ``[T]`` with features ``[T, hidden]`` (requests
        flattened by ``cu [R + 1]``) complete and make each request's last feature its pending one.

        Returns the pairs' features and next tokens (the inputs of :meth:`pair_inputs`), cache slots and positions
        (``[P, hidden]``, ``[P]``, ``[P]``, ``[P]``), or None when there is no pair; the caller writes their K/V."""
        dev = self.device
        cu_l = cu.tolist()
        n_tok = [cu_l[i + 1] - cu_l[i] for i in range(len(rids))]
        has = [int(rid in state.pending) for rid in rids]
        n_pairs = [n - 1 + h if n > 0 else 0 for n, h in zip(n_tok, has)]
        total = sum(n_pairs)
        features = features.to(dev)
        token_ids = token_ids.to(dev)
        pairs = None
        if total > 0:
            r = len(rids)
            cu_t = torch.tensor(cu_l[:-1], dtype=torch.long, device=dev)
            has_t = torch.tensor(has, dtype=torch.long, device=dev)
            np_t = torch.tensor(n_pairs, dtype=torch.long, device=dev)
            req = torch.repeat_interleave(torch.arange(r, device=dev), np_t, output_size=total)
            cu_p = torch.cumsum(np_t, 0) - np_t
            j = torch.arange(total, device=dev) - cu_p[req]
            fidx = cu_t[req] + j - has_t[req]
            fidx = torch.where(fidx < cu_t[req], features.shape[0] + req, fidx)  # j = 0 with a pending feature
            tidx = cu_t[req] + j + 1 - has_t[req]
            pend = torch.zeros(r, features.shape[1], dtype=features.dtype, device=dev)
            for i, rid in enumerate(rids):
                if has[i] and n_pairs[i]:
                    pend[i] = state.pending[rid]
            cache = state.cache
            cache.reserve_many(rids, n_pairs)
            pairs = (torch.cat([features, pend])[fidx], token_ids[tidx].long(), *cache.token_slots(rids, n_pairs, dev))
        for i, rid in enumerate(rids):
            if n_tok[i] > 0:
                state.pending[rid] = features[cu_l[i + 1] - 1].clone()
        return pairs

    @torch.inference_mode()
    def extend(self, state: ChainState, rids: Sequence[Hashable], token_ids: torch.Tensor, features: torch.Tensor,
               cu: torch.Tensor) -> None:
        """Commit tokens ``[T]`` with their target features ``[T, hidden]`` (requests flattened by ``cu [R + 1]``)."""
        pairs = self._context_pairs(state, list(rids), token_ids, features, cu)
        if pairs is not None:
            feats, tokens, slots, positions = pairs
            cos, sin = self._rope(positions)
            k, v = self.layer.self_attn.keys_values(self.layer.input_layernorm(self.pair_inputs(feats, tokens)), cos,
                                                    sin)
            state.cache.write(0, slots, k, v)

    def draft(self, state: ChainState, rids: Sequence[Hashable], anchors: torch.Tensor, gamma: int,
              temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor | None,
              impl: str | None = None, context: DraftContext | None = None) -> DraftOutput:
        """Chain ``gamma`` steps after each anchor; ``uniforms [R * gamma]`` request-major (None when all greedy).
        ``context``'s pairs go through the first step's GEMMs with the anchors' (see :meth:`chain`)."""
        out = self.chain(state, rids, anchors, gamma, temperature, top_k, top_p, uniforms, impl=impl, context=context)
        r = len(rids)
        probs = None if out.draft_probs is None else out.draft_probs.reshape(r * gamma, -1)
        return DraftOutput(out.tokens.reshape(r * gamma), probs, None)

    @torch.inference_mode()
    def chain(self, state: ChainState, rids: Sequence[Hashable], anchors: torch.Tensor, gamma: int,
              temperature: torch.Tensor, top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
              uniforms: torch.Tensor | None = None, impl: str | None = None,
              forced_tokens: torch.Tensor | None = None, context: DraftContext | None = None) -> ChainDraft:
        """The drafting loop behind :meth:`draft`; ``forced_tokens [R, gamma]`` (testing) feeds the given tokens to
        the next step instead of the sampled ones. The cache is restored to the committed pairs before returning.

        ``context = (token_ids, features, cu)``: committed tokens not yet extended. Their pairs are committed as
        :meth:`extend` commits them, but inside the first step: its fc, norm and projection GEMMs run over the
        context pairs and the anchors' pairs together, and the context's K/V are written before the anchors attend.
        """
        if not isinstance(gamma, int) or not 1 <= gamma <= MAX_STEPS:
            raise ValueError(f"gamma must be an int in 1..{MAX_STEPS}, got {gamma!r}")
        rids = list(rids)
        pairs = None if context is None else self._context_pairs(state, rids, *context)
        missing = [rid for rid in rids if rid not in state.pending]
        if missing:
            raise ValueError(f"draft: requests {missing[:5]} have no extended tokens yet (call extend first)")
        dev, r = self.device, len(rids)
        anchors = anchors.to(dev).long()
        temperature = temperature.to(dev)
        top_k = top_k.to(dev) if top_k is not None else None
        top_p = top_p.to(dev) if top_p is not None else None
        u = uniforms.to(dev).view(r, gamma) if uniforms is not None else None
        cache = state.cache
        cu1 = torch.arange(r + 1, dtype=torch.int32, device=dev)
        feats = torch.stack([state.pending[rid] for rid in rids]).to(dev)
        prev_tok = anchors
        toks, probs, logits_all, hidden_all = [], [], [], []
        written = 0
        try:
            for k in range(gamma):
                cache.reserve_many(rids, [1] * r)
                written += 1
                page_table, lens = cache.batch_tensors(rids, dev)
                positions = lens.long() - 1
                fused = k == 0 and pairs is not None
                if fused:  # the anchors' rows first, then the context pairs' rows
                    x_all = self.pair_inputs(torch.cat([feats, pairs[0]]), torch.cat([prev_tok, pairs[1]]))
                    x, positions = x_all[:r], torch.cat([positions, pairs[3]])
                else:
                    x_all = x = self.pair_inputs(feats, prev_tok)
                cos, sin = self._rope(positions)
                attn = self.layer.self_attn
                q, kk, vv = attn.queries_keys_values(self.layer.input_layernorm(x_all), cos, sin)
                if fused:
                    cache.write(0, pairs[2], kk[r:], vv[r:])
                    q, kk, vv = q[:r], kk[:r], vv[:r]
                cache.write(0, cache.token_slots(rids, [1] * r, dev)[0], kk, vv)
                o = verify_attention(q, cache.k[0], cache.v[0], page_table, cu1, lens, impl=impl, check_inputs=False,
                                     max_seqlen_q=1)
                g = self.layer.finish(x, o.reshape(r, -1))
                logits = self.draft_logits(g)
                res = draw(self.draft_vocab, logits, g, prev_tok, cu1, _NONE_HEAD, temperature, top_k, top_p,
                           None if u is None else u[:, k].contiguous(), impl=impl, check_inputs=False)
                toks.append(res.tokens)
                probs.append(res.draft_probs)
                logits_all.append(logits)
                hidden_all.append(g)
                feats = g
                prev_tok = res.tokens if forced_tokens is None else forced_tokens[:, k].to(dev).long()
        finally:
            for rid in rids:
                cache.rollback(rid, written)
        return ChainDraft(torch.stack(toks, 1), None if u is None else torch.stack(probs, 1),
                          torch.stack(logits_all, 1), torch.stack(hidden_all, 1))

    # ------------------------------------------------------------------ training
    def forward_train(self, features: torch.Tensor, tokens: torch.Tensor, steps: int,
                      logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Teacher-forced chain over whole sequences with a training-time-test unroll (see module docstring).

        Args:
            features: ``[B, L, hidden]`` target features of ``feature_layer`` at every position.
            tokens: ``[B, L]`` token ids.
            steps: chain steps ``K`` to unroll.
            logits: False skips the LM head (``None`` logits; apply :meth:`lm_logits` to chosen rows of ``hidden``).
        Returns:
            ``logits [B, K, L, V]`` fp32 and ``hidden [B, K, L, hidden]``; step ``k`` (1-based) at position ``t``
            predicts ``x_{t+2}`` for the chain anchored at ``t - k + 2`` (positions where the inputs do not exist
            carry meaningless values).
        """
        b, seq_len, _ = features.shape
        dev = features.device
        attn = self.layer.self_attn
        nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(b, 1)], dim=1)  # x_{t+1} at position t
        pos = torch.arange(seq_len, device=dev)
        cos, sin = self._rope(pos.repeat(b))
        keys, values, logits_out, hidden_out = [], [], [], []
        feats = features.to(self.dtype)
        for k in range(1, steps + 1):
            x = self.pair_inputs(feats, nxt).reshape(b * seq_len, -1)
            hx = self.layer.input_layernorm(x)
            q = attn.queries(hx, cos, sin).view(b, seq_len, attn.hq, attn.d).transpose(1, 2)
            kk, vv = attn.keys_values(hx, cos, sin)
            keys.append(kk.view(b, seq_len, attn.hkv, attn.d).transpose(1, 2))
            values.append(vv.view(b, seq_len, attn.hkv, attn.d).transpose(1, 2))
            if k == 1:
                o = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True,
                                                   enable_gqa=attn.hq != attn.hkv)
            else:
                o = _unrolled_attention(q, keys, values, k)
            g = self.layer.finish(x, o.transpose(1, 2).reshape(b * seq_len, -1)).view(b, seq_len, -1)
            if logits:
                logits_out.append(self.lm_logits(g))
            hidden_out.append(g)
            feats = torch.cat([g.new_zeros(b, 1, g.shape[-1]), g[:, :-1]], dim=1)  # g^{k}_{t-1} at position t
        return (torch.stack(logits_out, 1) if logits else None), torch.stack(hidden_out, 1)

    # ------------------------------------------------------------------ I/O
    def save(self, out_dir: str | Path) -> None:
        """``drafter_config.json`` + ``model.safetensors`` (trainable weights only; embedding/LM head are the
        target's)."""
        save_drafter(self, dataclasses.asdict(self.config), "chain", out_dir)


def load_chain_drafter(path: str | Path, target: CausalLM, dtype: torch.dtype = torch.float32,
                       gemm_dtype: torch.dtype | str | None = None) -> ChainDrafter:
    """Load a drafter directory written by :meth:`ChainDrafter.save` for ``target``; clear errors on mismatch.
    ``gemm_dtype``: the linear weights in that dtype (:mod:`.gemm_dtype`); the projections are fused for inference
    (:mod:`.fused_linear`)."""
    raw = read_drafter_config(path, "chain")
    del raw["drafter_type"]
    drafter = load_drafter_weights(ChainDrafter(ChainDrafterConfig(**raw), target), path, target, dtype)
    return fuse_projections(cast_gemm_weights(drafter, gemm_dtype))


def _unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        k: int) -> torch.Tensor:
    """Attention of unroll step ``k >= 2``: the query at position ``t`` sees the step-1 pairs at ``s <= t - k + 1`` and,
    for ``j = 2..k``, the single step-``j`` pair at ``t - k + j``.

    ``q [B, Hq, L, D]``; ``keys``/``values``: the ``k`` steps' ``[B, Hkv, L, D]`` (query head ``h`` reads KV head
    ``h // (Hq / Hkv)``). The step-1 part is one masked ``[L, L]`` score matrix; each later step adds one score per
    query (a diagonal), joined in the same softmax: about the cost of step 1, where one dense ``[L, k * L]`` mask
    would cost ``k`` times it. Returns ``[B, Hq, L, D]``.
    """
    group = q.shape[1] // keys[0].shape[1]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(group, dim=1) if group > 1 else x

    seq_len = q.shape[2]
    pos = torch.arange(seq_len, device=q.device)
    scale = q.shape[-1] ** -0.5
    scores = (q @ heads(keys[0]).transpose(-1, -2)) * scale  # [B, H, L, L]
    scores = scores.masked_fill(pos[None, :] > pos[:, None] - k + 1, float("-inf"))
    diag_k, diag_v = [], []
    for j in range(2, k + 1):  # the step-j pair at t - (k - j): shift step j's rows down by k - j positions
        shift = k - j
        diag_k.append(F.pad(heads(keys[j - 1]), (0, 0, shift, 0))[:, :, :seq_len])
        diag_v.append(F.pad(heads(values[j - 1]), (0, 0, shift, 0))[:, :, :seq_len])
    dk, dv = torch.stack(diag_k, 3), torch.stack(diag_v, 3)  # [B, H, L, k - 1, D]
    diag = (q[:, :, :, None, :] * dk).sum(-1) * scale  # [B, H, L, k - 1]
    missing = pos[:, None] - (k - torch.arange(2, k + 1, device=q.device))[None, :] < 0  # [L, k - 1]: before 0
    diag = diag.masked_fill(missing, float("-inf"))
    probs = torch.softmax(torch.cat([scores, diag], dim=-1), dim=-1)
    return probs[..., :seq_len] @ heads(values[0]) + (probs[..., seq_len:, None] * dv).sum(3)


"""DSpark / DFlash block drafter: a parallel backbone over target features plus a sequential head.

Backbone (paper §2, DSpark's anchor-predicts variant): for a request whose last emitted token (the *anchor* x_0) sits
at position P, the block input is ``[x_0, MASK x (gamma - 1)]`` at positions ``P .. P + gamma - 1``; block slot k
(0-based) predicts the token at ``P + k + 1``.

* Context features: the target's raw hidden states of ``feature_layers`` for every committed position ``< P``,
  concatenated (``[T, m * hidden]``), projected by a bias-free ``fc`` and RMS-normalised (``hidden_norm``) into
  ``H_ctx``.
* Every draft layer is a target-family decoder layer (pre-norm attention + SwiGLU MLP, Qwen3 q/k-norm). Its queries
  come from the block; its keys/values are the concatenation of ``k/v_proj(H_ctx)`` (same projections, RoPE at the
  context's absolute positions) and ``k/v_proj(norm(block))`` (RoPE at the block positions). Attention is non-causal
  within the block.
* The final norm and the target's frozen LM head give the base logits ``U_k``; the target's frozen embedding embeds the
  block input. Neither is stored with the drafter.
* Anchor feature (``anchor_feature = True``): every block row's input also gets ``anchor_proj(H_ctx[P - 1])``, the
  context feature of the anchor's predecessor (the target state whose output the anchor was sampled from), through a
  bias-free ``hidden -> hidden`` projection initialised at zero. MTP-1 reads that feature directly, concatenated with
  the anchor's embedding; without this path the block reaches it only through attention.

The sequential head (:class:`~dspark_kernels.drafters.sequential_head.SequentialHead`) adds the Markov/RNN bias of the
previous token left to right and emits the confidence logits; ``markov_rank = 0`` is pure DFlash. The head's ``h_k``
is the last draft layer's residual stream before the final norm (the reference code hands its heads the normalised
state; the shipped drafters were trained, and run, with this one).

Inference keeps a per-request paged cache of projected context K/V (:class:`PagedKVCache` with one entry per draft
layer) that grows with accepted tokens; the block's own K/V never enter it. The decode loops hand each round's kept
tokens to the next round's draft (``context``), whose backbone pass writes them in the same GEMMs as the block
(:meth:`BlockDrafter.propose`); :meth:`BlockDrafter.extend_context` does it on its own.
Training (:meth:`BlockDrafter.forward_train`) packs many anchors of one sequence into one pass with the mask
"context strictly before the anchor + the anchor's own block".
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
from ..models.transformer import CausalLM, DecoderLayer, RMSNorm
from ..ops import draft_block_attention, plan_draft_block_attention
from .api import DraftContext, DraftOutput, load_drafter_weights, read_drafter_config, save_drafter
from .draft_vocab import DraftVocab, draft_logits, draw
from .sequential_head import SequentialHead

__all__ = ["BlockDrafter", "BlockDrafterCache", "DrafterConfig", "load_block_drafter"]

MAX_GAMMA = 16
HEAD_KINDS = ("none", "vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DrafterConfig:
    """Hyper-parameters of a block drafter (stored as ``drafter_config.json``).

    ``vocab_size``/``hidden_size`` record the target it was built for, so a mismatched target is refused at load.
    """

    feature_layers: tuple[int, ...]
    mask_token_id: int
    vocab_size: int
    hidden_size: int
    num_layers: int = 2
    gamma: int = 7
    head_kind: str = "vanilla"
    markov_rank: int = 64
    confidence: bool = True
    name: str = "dspark"
    anchor_feature: bool = False

    def validate(self, target: ModelConfig) -> None:
        if not 1 <= self.num_layers <= 5:
            raise ValueError(f"num_layers must be in 1..5, got {self.num_layers}")
        if not 1 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in 1..{MAX_GAMMA}, got {self.gamma}")
        if self.head_kind not in HEAD_KINDS:
            raise ValueError(f"head_kind must be one of {HEAD_KINDS}, got {self.head_kind!r}")
        if not 0 <= self.markov_rank <= target.vocab_size:
            raise ValueError(f"markov_rank must be in 0..vocab_size ({target.vocab_size}), got {self.markov_rank}")
        if (self.head_kind == "none") != (self.markov_rank == 0):
            raise ValueError(f"markov_rank 0 goes with head_kind 'none' (pure DFlash); got {self.markov_rank}, "
                             f"{self.head_kind!r}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab_size {self.vocab_size} does not match the target's {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            raise ValueError(f"drafter hidden_size {self.hidden_size} does not match the target's "
                             f"{target.hidden_size}")
        if not self.feature_layers:
            raise ValueError("feature_layers must name at least one target layer")
        if len(set(self.feature_layers)) != len(self.feature_layers):
            raise ValueError(f"feature_layers must name distinct target layers, got {list(self.feature_layers)}")
        for layer in self.feature_layers:
            if not 0 <= layer < target.num_hidden_layers - 1:
                raise ValueError(
                    f"feature_layers entry {layer} must be a target layer in [0, {target.num_hidden_layers - 1}) "
                    "(the final layer is excluded: HF exposes it only after the final norm)"
                )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {target.vocab_size})")


class BlockDrafterCache(PagedKVCache):
    """The block drafter's per-batch state: the paged context K/V of every draft layer, plus each request's last
    context feature ``H_ctx [hidden]`` (kept only by a drafter with the anchor-feature path, which reads it as the
    anchor's predecessor)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last_context: dict[Hashable, torch.Tensor] = {}

    def free(self, rid: Hashable) -> None:
        super().free(rid)
        self.last_context.pop(rid, None)


class DraftLayer(DecoderLayer):
    """A target-family decoder layer whose attention is run by the drafter (over context + block)."""

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual around attention (``attn_out [T, Hq * D]``), then the MLP block."""
        x = x + self.self_attn.o_proj(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class Proposal:
    """One drafting round: base logits ``U [N, V]`` (``[N, K]`` over a draft vocabulary) and hidden ``h [N, hidden]``
    of every block slot, requests flattened by ``cu [R + 1]`` (each request's block length)."""

    base_logits: torch.Tensor
    hidden: torch.Tensor
    cu: torch.Tensor


class BlockDrafter(nn.Module):
    """DSpark (or DFlash with ``markov_rank = 0``) drafter bound to a target model's embedding and LM head."""

    def __init__(self, cfg: DrafterConfig, target: CausalLM) -> None:
        super().__init__()
        cfg.validate(target.config)
        self.config = cfg
        self.layer_config = dataclasses.replace(target.config, num_hidden_layers=cfg.num_layers)
        h = target.config.hidden_size
        self.fc = nn.Linear(len(cfg.feature_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, target.config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(self.layer_config) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, target.config.rms_norm_eps)
        head_kind = cfg.head_kind if cfg.markov_rank > 0 else "vanilla"  # rank 0 makes the head "none" regardless
        self.head = SequentialHead(cfg.vocab_size, h, cfg.markov_rank, kind=head_kind, confidence=cfg.confidence)
        self.anchor_proj = nn.Linear(h, h, bias=False) if cfg.anchor_feature else None
        if self.anchor_proj is not None:
            nn.init.zeros_(self.anchor_proj.weight)  # starts as the drafter without the path (fine-tuning from one)
        # frozen, shared with the target (plain attributes: not parameters of the drafter, not saved)
        self.__dict__["target"] = target
        self.draft_vocab: DraftVocab | None = None  # drafting over a subset of the vocabulary (.draft_vocab)

    # ------------------------------------------------------------------ shared pieces
    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Activation (and context cache) dtype; the linear weights may be in a GEMM dtype (:mod:`.gemm_dtype`)."""
        return self.norm.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.target.model.embed_tokens.weight)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Base logits ``U`` (fp32) from the last hidden state through the final norm and the frozen LM head (in the
        target's dtype: a drafter may run in another one)."""
        return self.target.lm_head(self.norm(h).to(self.target.dtype)).float()

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The base logits drafting uses: :meth:`lm_logits` ``[..., V]``, or ``[..., K]`` over :attr:`draft_vocab`."""
        return draft_logits(self.draft_vocab, self.target.lm_head, self.norm(h).to(self.target.dtype))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.target._rope(positions, dtype)

    def context_features(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., m * hidden]`` concatenated target features -> ``H_ctx [..., hidden]``."""
        return self.hidden_norm(self.fc(features))

    def block_inputs(self, anchors: torch.Tensor, gamma: int) -> torch.Tensor:
        """``anchors [R]`` -> block token ids ``[R, gamma]``: the anchor then ``gamma - 1`` MASK tokens."""
        ids = torch.full((anchors.shape[0], gamma), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        return ids

    # ------------------------------------------------------------------ inference (the Drafter protocol)
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def max_gamma(self) -> int:
        """The largest block a pass drafts (its block attention's limit)."""
        return MAX_GAMMA

    def new_state(self, num_pages: int, page_size: int = 16) -> BlockDrafterCache:
        return self.new_cache(num_pages, page_size)

    def add_request(self, state: PagedKVCache, rid: Hashable) -> None:
        state.add_request(rid)

    def free(self, state: PagedKVCache, rid: Hashable) -> None:
        state.free(rid)

    def extend(self, state: PagedKVCache, rids: Sequence[Hashable], token_ids: torch.Tensor, features: torch.Tensor,
               cu: torch.Tensor) -> None:
        """Committed tokens enter the context through their target features only (``token_ids`` unused)."""
        self.extend_context(state, rids, features, cu)

    def draft(self, state: PagedKVCache, rids: Sequence[Hashable], anchors: torch.Tensor, gamma: int,
              temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor | None,
              impl: str | None = None, context: DraftContext | None = None) -> DraftOutput:
        """Backbone pass (taking ``context`` into the cache in the same pass), then the sequential head op left to
        right over each block. A drafter trained without a confidence head (DFlash) returns no confidence logits
        (``None``), so a policy that schedules on confidences refuses it instead of reading constant zeros."""
        prop = self.propose(state, rids, anchors, gamma, impl=impl, context=context)
        with torch.inference_mode():
            res = draw(self.draft_vocab, prop.base_logits, prop.hidden, anchors.to(self.device), prop.cu,
                       self.head.weights(), temperature, top_k, top_p, uniforms, impl=impl, check_inputs=False)
        return DraftOutput(res.tokens, res.draft_probs, res.confidence_logits if self.config.confidence else None)

    def new_cache(self, num_pages: int, page_size: int = 16) -> BlockDrafterCache:
        c = self.layer_config
        return BlockDrafterCache(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, c.head_dim,
                                 dtype=self.dtype, device=self.device)

    def _new_context(self, cache: PagedKVCache, request_ids: Sequence[Hashable], counts: Sequence[int],
                     features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cache slots ``[T]``, absolute positions ``[T]`` and ``H_ctx [T, hidden]`` of committed tokens (features
        ``[T, m * hidden]``, ``counts[r]`` of request ``request_ids[r]``) already reserved as the last positions of
        each request."""
        slots, positions = cache.token_slots(request_ids, counts, self.device)
        return slots, positions, self.context_features(features.to(self.device, self.dtype))

    def _keep_last_context(self, cache: PagedKVCache, request_ids: Sequence[Hashable], counts: Sequence[int],
                           h_ctx: torch.Tensor) -> None:
        """Remember each request's last new context row of ``h_ctx [T, hidden]`` (``counts[r]`` rows of request
        ``r``) when the anchor-feature path needs it."""
        if self.anchor_proj is None or h_ctx.shape[0] == 0:
            return
        ends = torch.tensor(counts, dtype=torch.long).cumsum(0) - 1
        rows = h_ctx[ends.clamp(min=0).to(h_ctx.device)]
        for rid, n, row in zip(request_ids, counts, rows):
            if n > 0:
                cache.last_context[rid] = row

    def _anchor_features(self, cache: PagedKVCache, request_ids: Sequence[Hashable]) -> torch.Tensor:
        """``H_ctx [R, hidden]`` of each request's anchor predecessor (its last context row)."""
        last = getattr(cache, "last_context", None)
        if last is None:
            raise TypeError(f"an anchor-feature drafter needs the state of its new_state/new_cache (a "
                            f"BlockDrafterCache), got {type(cache).__name__}")
        missing = [rid for rid in request_ids if rid not in last]
        if missing:
            raise ValueError(f"requests {missing[:5]} have no context yet: an anchor-feature drafter reads the "
                             "feature of the anchor's predecessor (extend the prompt first)")
        return torch.stack([last[rid] for rid in request_ids])

    @torch.inference_mode()
    def extend_context(self, cache: PagedKVCache, request_ids: Sequence[Hashable], features: torch.Tensor,
                       cu: torch.Tensor) -> None:
        """Append committed tokens' features ``[T, m * hidden]`` (requests flattened by ``cu [R + 1]``) to the cache.

        Their positions continue each request's cached length. (:meth:`propose` with ``context`` does the same
        inside its pass.)
        """
        counts = (cu[1:] - cu[:-1]).tolist()
        cache.reserve_many(list(request_ids), counts)
        slots, positions, h_ctx = self._new_context(cache, request_ids, counts, features)
        self._keep_last_context(cache, request_ids, counts, h_ctx)
        cos, sin = self._rope(positions, h_ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(h_ctx, cos, sin)
            cache.write(i, slots, k, v)

    @torch.inference_mode()
    def propose(self, cache: PagedKVCache, request_ids: Sequence[Hashable], anchors: torch.Tensor, gamma: int,
                impl: str | None = None, context: DraftContext | None = None) -> Proposal:
        """One parallel backbone pass: ``anchors [R]`` (each at position = its cached context length) ->
        :class:`Proposal` with ``gamma`` slots per request.

        ``context = (token_ids, features [T, m * hidden], cu [R + 1])``: committed tokens of each request not yet in
        the cache (before its anchor). They enter it in this pass, as :meth:`extend_context` would put them: each
        layer projects the block rows and the context rows in one GEMM and writes the context's K/V before the
        block attends."""
        if not 1 <= gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in 1..{MAX_GAMMA}, got {gamma}")
        n_req = len(request_ids)
        fresh = context is not None and context[1].shape[0] > 0
        if fresh:
            counts = (context[2][1:] - context[2][:-1]).tolist()
            cache.reserve_many(list(request_ids), counts)
        page_table, ctx_lens = cache.batch_tensors(request_ids, self.device)
        ids = self.block_inputs(anchors.to(self.device).long(), gamma).reshape(-1)
        positions = (ctx_lens.long()[:, None] + torch.arange(gamma, device=self.device)[None, :]).reshape(-1)
        cu = torch.arange(0, (n_req + 1) * gamma, gamma, dtype=torch.int32, device=self.device)
        x = self.embed(ids).to(self.dtype)
        n_block = x.shape[0]
        if fresh:
            slots, ctx_positions, h_ctx = self._new_context(cache, request_ids, counts, context[1])
            self._keep_last_context(cache, request_ids, counts, h_ctx)
            positions = torch.cat([positions, ctx_positions])
        if self.anchor_proj is not None:
            x = x + self.anchor_proj(self._anchor_features(cache, request_ids)).repeat_interleave(gamma, dim=0)
        cos, sin = self._rope(positions, x.dtype)
        plan = plan_draft_block_attention(page_table, cu, ctx_lens, cache.page_size,
                                          self.layer_config.num_attention_heads, impl=impl, check_inputs=False)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            hx = layer.input_layernorm(x)
            q, k, v = attn.queries_keys_values(torch.cat([hx, h_ctx]) if fresh else hx, cos, sin)
            if fresh:
                cache.write(i, slots, k[n_block:], v[n_block:])
                q, k, v = q[:n_block], k[:n_block], v[:n_block]
            o = draft_block_attention(q, k, v, cache.k[i], cache.v[i], page_table, cu, ctx_lens, impl=impl,
                                      check_inputs=False, max_seqlen_q=gamma, plan=plan)
            x = layer.finish(x, o.reshape(x.shape[0], -1))
        return Proposal(self.draft_logits(x), x, cu)

    # ------------------------------------------------------------------ training
    def forward_train(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                      gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced backbone over many anchors per sequence.

        Args:
            features: ``[B, L, m * hidden]`` target features of every position.
            tokens: ``[B, L]`` token ids.
            anchors: ``[B, A]`` anchor positions (``-1`` = padding block: it sees no context and its outputs are
                meaningless).
            gamma: block size.
        Returns:
            ``base_logits [B, A, gamma, V]`` fp32 (``[B, A, gamma, K]`` over :attr:`draft_vocab` when it is set, in
            its rank order) and ``hidden [B, A, gamma, hidden]``.
        """
        b, seq_len, _ = features.shape
        n_anchor = anchors.shape[1]
        m = n_anchor * gamma
        dev = features.device
        safe = anchors.clamp(min=0)
        ids = self.block_inputs(tokens.gather(1, safe).reshape(-1), gamma).view(b, m)
        blk_pos = (safe[:, :, None] + torch.arange(gamma, device=dev)).reshape(b, m)
        ctx_pos = torch.arange(seq_len, device=dev)
        # visibility [B, M, L + M]: context strictly before the anchor, and the anchor's own block
        ctx_vis = ctx_pos[None, None, :] < anchors.repeat_interleave(gamma, dim=1)[:, :, None]
        # padding blocks still see themselves, so no row is fully masked (their outputs are ignored by the loss)
        blk_id = torch.arange(m, device=dev) // gamma
        blk_vis = (blk_id[:, None] == blk_id[None, :]).expand(b, m, m)
        visible = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]  # [B, 1, M, L + M]

        h_ctx = self.context_features(features).reshape(b * seq_len, -1)
        cos_c, sin_c = self._rope(ctx_pos.repeat(b), h_ctx.dtype)
        cos_b, sin_b = self._rope(blk_pos.reshape(-1), h_ctx.dtype)
        x = self.embed(ids.reshape(-1)).to(h_ctx.dtype)
        if self.anchor_proj is not None:  # the anchor's predecessor row (anchors >= 1 have one; others read zeros)
            rows = (safe - 1).clamp(min=0)[..., None].expand(-1, -1, h_ctx.shape[-1])
            prev = h_ctx.view(b, seq_len, -1).gather(1, rows)
            prev = prev * (anchors >= 1)[..., None].to(prev.dtype)
            x = x + self.anchor_proj(prev).repeat_interleave(gamma, dim=1).reshape(b * m, -1)
        for layer in self.layers:
            attn = layer.self_attn
            hx = layer.input_layernorm(x)
            q = attn.queries(hx, cos_b, sin_b).view(b, m, attn.hq, attn.d).transpose(1, 2)
            kb, vb = attn.keys_values(hx, cos_b, sin_b)
            kc, vc = attn.keys_values(h_ctx, cos_c, sin_c)
            k = torch.cat([kc.view(b, seq_len, attn.hkv, attn.d), kb.view(b, m, attn.hkv, attn.d)], 1).transpose(1, 2)
            v = torch.cat([vc.view(b, seq_len, attn.hkv, attn.d), vb.view(b, m, attn.hkv, attn.d)], 1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=attn.hq != attn.hkv)
            x = layer.finish(x, o.transpose(1, 2).reshape(b * m, -1))
        return self.draft_logits(x).view(b, n_anchor, gamma, -1), x.view(b, n_anchor, gamma, -1)

    # ------------------------------------------------------------------ I/O
    def save(self, out_dir: str | Path) -> None:
        """``drafter_config.json`` + ``model.safetensors`` (trainable weights only; embedding/LM head are the
        target's)."""
        save_drafter(self, dataclasses.asdict(self.config), "block", out_dir)


def load_block_drafter(path: str | Path, target: CausalLM, dtype: torch.dtype = torch.float32,
                       gemm_dtype: torch.dtype | str | None = None) -> BlockDrafter:
    """Load a drafter directory written by :meth:`BlockDrafter.save` for ``target``; clear errors on mismatch.

    ``gemm_dtype``: the backbone's linear weights in that dtype (:mod:`.gemm_dtype`); the sequential head stays in
    ``dtype`` (its draft probabilities are computed in fp32). The projections are fused for inference
    (:mod:`.fused_linear`)."""
    raw = read_drafter_config(path, "block")
    del raw["drafter_type"]
    raw["feature_layers"] = tuple(raw["feature_layers"])
    drafter = load_drafter_weights(BlockDrafter(DrafterConfig(**raw), target), path, target, dtype)
    return fuse_projections(cast_gemm_weights(drafter, gemm_dtype, skip=[drafter.head]))

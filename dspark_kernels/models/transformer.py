"""Target model: Qwen3 / Llama decoder-only transformer in PyTorch over a paged KV cache.

One batched forward serves prefill, decode and verify: request ``r`` contributes ``q_len_r`` new tokens (flattened
along ``total_q`` by ``cu_seqlens_q``), which are appended to its cache entry at positions
``len_r .. len_r + q_len_r - 1`` (``len_r`` = tokens already cached) and attend causally to everything before them via
:func:`dspark_kernels.ops.verify_attention`.

Per layer (HF semantics):
    x -> input_layernorm -> q/k/v proj -> [qwen3: per-head q_norm/k_norm] -> RoPE(abs. positions) -> write K/V
      -> verify_attention -> o_proj -> + residual -> post_attention_layernorm -> SwiGLU MLP -> + residual
Module and parameter names mirror the Hugging Face checkpoints so state dicts load without renaming.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import plan_verify_attention, verify_attention
from ..ops._validate import INDEX_DTYPES, check_cu_seqlens, check_tensor
from ..ops.verify_attention import PinnedLaunch
from ..reference._paged_attention import AttentionPlan
from ..reference._tensor_key import tensor_key
from ..reference.batch_invariant_attention import BatchInvariantPlan
from .config import ModelConfig
from .fused_linear import FusedLinear, fuse_projections
from .gemm_dtype import cast_gemm_weights, pad_single_row_gemms
from .kv_cache import PagedKVCache
from .sources import load_weights
from .weight_layout import column_major_weights

__all__ = ["CausalLM", "ForwardOutput", "load_model", "RMSNorm"]


@dataclass
class ForwardOutput:
    """``logits [n, V]`` float32 (rows of ``logits_indices``, or all ``total_q`` tokens) and
    ``hidden_states``: layer index -> ``[total_q, hidden]`` (-1 = embedding output)."""

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; statistics in fp32, result in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps)`` over the last dim (fp32 statistics, the input dtype), before the weight.

        ``F.rms_norm`` without a weight: the same arithmetic as ``x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)``
        cast back (bit-identical in fp32, bf16 and fp16, tested) in one op instead of five."""
        return F.rms_norm(x, (x.shape[-1],), None, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` (non-interleaved halves, HF convention) with the tables of :meth:`CausalLM._rope`:
    ``cos [T, 1, D]`` and ``sin [T, 1, D]`` with its first half negated.

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)`` is ``x * cos + (x2, x1) * (-s1, s2)``:
    the same products (a negated factor is exact), so the same bits, with the swap a ``roll`` and no negation or
    concatenation per call."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.hq * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.hkv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.hkv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * d, h, bias=cfg.attention_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fused_qkv: FusedLinear | None = None  # set by fuse_projections (inference)
        self._qk_weights_key: tuple | None = None  # _qk_norm_weights' kept concatenation and what it was made from

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> roped queries ``[T, Hq, D]`` (Qwen3: per-head q_norm first)."""
        return self._rope_queries(self.q_proj(x), cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> roped keys and values ``[T, Hkv, D]`` (Qwen3: per-head k_norm first)."""
        k, v = (self.k_proj(x), self.v_proj(x)) if self.fused_qkv is None else self.fused_qkv(x, first=1)
        return self._rope_keys_values(k, v, cos, sin)

    def queries_keys_values(self, x: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`queries` and :meth:`keys_values` of the same ``x``: one GEMM when the projections are fused
        (:func:`~.fused_linear.fuse_projections`), three otherwise.

        Fused, the query and key heads sit side by side in the GEMM's output and go through the q/k norm and RoPE
        as one ``[T, Hq + Hkv, D]`` tensor (each head row with its own norm's weight): the same arithmetic per element
        as two separate passes, in half the ops. ``q`` and ``k`` are then views of that tensor."""
        if self.fused_qkv is None:
            return (self.queries(x, cos, sin), *self.keys_values(x, cos, sin))
        t, heads = x.shape[0], self.hq + self.hkv
        y = self.fused_qkv.output(x)
        qk = y[:, : heads * self.d].reshape(t, heads, self.d)
        if self.qk_norm:
            qk = self._qk_norm_weights() * self.q_norm.normalize(qk)
        qk = apply_rope(qk, cos, sin)
        return qk[:, : self.hq], qk[:, self.hq:], y[:, heads * self.d:].reshape(t, self.hkv, self.d)

    def _qk_norm_weights(self) -> torch.Tensor:
        """``[Hq + Hkv, D]``: the q norm's weight for every query head, then the k norm's for every key head; kept
        until either weight is replaced or updated in place (storage and version counter; an inference tensor has no
        version counter, so then it is made per call)."""
        q, k = self.q_norm.weight, self.k_norm.weight
        key = None if q.is_inference() or k.is_inference() else (tensor_key(q), tensor_key(k))
        if key is None or key != self._qk_weights_key:
            weights = torch.cat((q.expand(self.hq, self.d), k.expand(self.hkv, self.d)))
            if key is None:
                return weights
            self._qk_weights, self._qk_weights_key = weights, key
        return self._qk_weights

    def _rope_queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = q.reshape(q.shape[0], self.hq, self.d)
        return apply_rope(self.q_norm(q) if self.qk_norm else q, cos, sin)

    def _rope_keys_values(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = k.reshape(k.shape[0], self.hkv, self.d)
        return apply_rope(self.k_norm(k) if self.qk_norm else k, cos, sin), v.reshape(v.shape[0], self.hkv, self.d)

    def forward(self, x: torch.Tensor, ctx: "_BatchCtx", layer: int) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this layer's K/V for the new tokens into the cache."""
        t = x.shape[0]
        q, k, v = self.queries_keys_values(x, ctx.cos, ctx.sin)
        cache = ctx.cache
        cache.write(layer, ctx.slots, k, v)
        o = verify_attention(
            q, cache.k[layer], cache.v[layer], ctx.page_table, ctx.cu_seqlens_q, ctx.seq_lens,
            impl=ctx.impl, check_inputs=ctx.check_inputs, max_seqlen_q=ctx.max_seqlen_q, plan=ctx.plan,
        )
        return self.o_proj(o.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.fused_gate_up: FusedLinear | None = None  # set by fuse_projections (inference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (self.gate_proj(x), self.up_proj(x)) if self.fused_gate_up is None else self.fused_gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: "_BatchCtx", layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class _BatchCtx:
    """Per-forward tensors shared by all layers."""

    cache: PagedKVCache
    page_table: torch.Tensor  # [R, max_pages] int32
    seq_lens: torch.Tensor  # [R] int32, including the new tokens
    cu_seqlens_q: torch.Tensor  # [R + 1] int32
    slots: torch.Tensor  # [T] int64 flat cache slots of the new tokens
    cos: torch.Tensor  # [T, 1, D] (CausalLM._rope)
    sin: torch.Tensor  # [T, 1, D], first half negated
    impl: str | None
    check_inputs: bool
    max_seqlen_q: int  # longest query length (lets the Triton launch skip a host sync)
    # plan_verify_attention's result, shared by every layer (None: the Triton kernel's default launch)
    plan: AttentionPlan | BatchInvariantPlan | PinnedLaunch | None


class CausalLM(nn.Module):
    """Qwen3 / Llama causal LM over a :class:`PagedKVCache`. Build from a checkpoint with :func:`load_model`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        # attention whose rows do not depend on the batch (see load_model)
        self.batch_invariant = False

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, num_pages: int, page_size: int = 16, dtype: torch.dtype | None = None) -> PagedKVCache:
        """An empty cache sized for this model (dtype defaults to the weights' dtype, device to theirs)."""
        c = self.config
        return PagedKVCache(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads, c.head_dim,
                            dtype=dtype or self.dtype, device=self.device)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation tables at absolute ``positions [T]`` for :func:`apply_rope`: ``cos [T, 1, D]`` and ``sin
        [T, 1, D]`` with its first half negated (angles in fp32, cast to ``dtype``)."""
        dev = positions.device
        if dev not in self._inv_freq:
            self._inv_freq[dev] = self.config.inv_freq(dev)
        freqs = positions.float()[:, None] * self._inv_freq[dev][None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin, half = emb.sin(), freqs.shape[1]
        return emb.cos().to(dtype)[:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)[:, None]

    def _validate(self, input_ids, cu_seqlens_q, request_ids, cache, logits_indices, hidden_layers) -> list[int]:
        cfg = self.config
        check_tensor("input_ids", input_ids, ndim=1, dtypes=INDEX_DTYPES)
        total = input_ids.shape[0]
        cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total)
        if cu.numel() != len(request_ids) + 1:
            raise ValueError(f"cu_seqlens_q must have len(request_ids) + 1 = {len(request_ids) + 1} entries, "
                             f"got {cu.numel()}")
        if total:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= cfg.vocab_size:
                bad = hi if hi >= cfg.vocab_size else lo
                raise ValueError(f"input_ids contain token id {bad} outside the vocabulary [0, {cfg.vocab_size})")
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        ):
            raise ValueError(
                f"cache (layers {cache.num_layers}, kv heads {cache.num_kv_heads}, head_dim {cache.head_dim}) does "
                f"not match the model ({cfg.num_hidden_layers}, {cfg.num_key_value_heads}, {cfg.head_dim})"
            )
        for layer in hidden_layers:
            if not isinstance(layer, int) or not -1 <= layer < cfg.num_hidden_layers:
                raise ValueError(f"hidden_layers entries must be ints in [-1, {cfg.num_hidden_layers}), got {layer!r}")
        if logits_indices is not None:
            check_tensor("logits_indices", logits_indices, ndim=1, dtypes=INDEX_DTYPES)
            if logits_indices.numel() and (int(logits_indices.min()) < 0 or int(logits_indices.max()) >= total):
                raise ValueError(f"logits_indices must lie in [0, {total}), got {logits_indices.tolist()}")
        return (cu[1:] - cu[:-1]).tolist()

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        request_ids: Sequence[Hashable],
        cache: PagedKVCache,
        logits_indices: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        impl: str | None = None,
        check_inputs: bool = True,
    ) -> ForwardOutput:
        """Append the new tokens of every request to ``cache`` and return their logits.

        Args:
            input_ids: ``[total_q]`` int token ids, flattened by ``cu_seqlens_q``.
            cu_seqlens_q: ``[R + 1]`` int offsets; request ``request_ids[r]`` owns rows ``cu[r]:cu[r+1]``.
            request_ids: ``R`` distinct ids already registered in ``cache`` (``cache.add_request``).
            cache: paged KV cache; each request's length grows by its query length (use ``cache.rollback`` to drop
                rejected tokens afterwards).
            logits_indices: ``[n]`` rows of ``total_q`` to compute logits for (``None``: all rows).
            hidden_layers: decoder-layer indices whose raw outputs to return (-1: the embedding output).
            impl: attention implementation passed to ``verify_attention`` (``None``: by device).
            check_inputs: ``False`` skips validation (host syncs) in hot loops.
        Returns:
            :class:`ForwardOutput` with ``logits [n or total_q, V]`` float32 and the requested hidden states
            ``[total_q, hidden]``.
        """
        dev = self.device
        if check_inputs:
            q_lens = self._validate(input_ids, cu_seqlens_q, request_ids, cache, logits_indices, hidden_layers)
        else:
            cu_host = cu_seqlens_q.tolist()
            q_lens = [b - a for a, b in zip(cu_host[:-1], cu_host[1:])]
        cache.reserve_many(list(request_ids), q_lens)
        try:
            with torch.inference_mode():
                return self._forward(input_ids.to(dev), cu_seqlens_q.to(dev, torch.int32), request_ids, cache,
                                     logits_indices, hidden_layers, impl, check_inputs, q_lens)
        except BaseException:
            for rid, n in zip(request_ids, q_lens):
                cache.rollback(rid, n)
            raise

    def _forward(self, input_ids, cu, request_ids, cache, logits_indices, hidden_layers, impl, check_inputs,
                 q_lens):
        page_table, seq_lens = cache.batch_tensors(request_ids, self.device)
        slots, positions = cache.token_slots(request_ids, q_lens, self.device)  # of the new tokens

        x = self.model.embed_tokens(input_ids.long())
        cos, sin = self._rope(positions, x.dtype)
        plan = plan_verify_attention(page_table, cu, seq_lens, cache.page_size, self.config.num_attention_heads,
                                     impl=impl, batch_invariant=self.batch_invariant, check_inputs=check_inputs)
        ctx = _BatchCtx(cache, page_table, seq_lens, cu, slots, cos, sin, impl, check_inputs,
                        max(q_lens, default=0), plan)
        wanted = set(hidden_layers)
        hidden: dict[int, torch.Tensor] = {}
        if -1 in wanted:
            hidden[-1] = x
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, i)
            if i in wanted:
                hidden[i] = x
        if logits_indices is not None:
            x = x[logits_indices.to(x.device).long()]
        logits = self.lm_head(self.model.norm(x)).float()
        return ForwardOutput(logits=logits, hidden_states=hidden)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               gemm_dtype: torch.dtype | str | None = None, batch_invariant: bool = False) -> CausalLM:
    """Load a Qwen3 / Llama model into a :class:`CausalLM` in eval mode.

    ``path``: a Hugging Face checkpoint directory (see :mod:`.checkpoint`), a GGUF file (dequantized, see
    :mod:`.gguf_weights`) or a registry name (:mod:`.registry`: ``smollm2-135m-instruct`` is fetched on first use).

    ``dtype``: weights and activations; ``gemm_dtype`` (e.g. ``torch.bfloat16``): keep the linear layers' weights in
    that dtype instead, running weight-only low-precision GEMMs (:mod:`.gemm_dtype`; the LM head gets its own copy
    when tied to the embedding). fp32 CPU linear weights are stored column-major, the layout of fast few-row GEMMs
    there (:mod:`.weight_layout`; a tied LM head gets its own copy). The q/k/v and gate/up projections are fused for
    inference (:mod:`.fused_linear`); the state dict keeps the checkpoint's names. ``batch_invariant``:
    batch-invariant attention (``plan_verify_attention(..., batch_invariant=True)``:
    :mod:`reference.batch_invariant_attention` on the CPU, one pinned launch config for the Triton kernel), so a
    token's logits do not depend on how many tokens or requests share its forward, and GEMMs whose rows do not
    depend on the row count (:func:`.gemm_dtype.pad_single_row_gemms`): greedy speculative decoding then reproduces
    greedy AR decoding bit for bit (slower attention on the CPU; sets
    :attr:`CausalLM.batch_invariant`)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must name a torch device (e.g. 'cpu', 'cuda:0'), got {device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA device is available (torch.cuda.is_available() is False)")
    cfg, sd = load_weights(path, dtype=dtype)
    sd = {k: v.to(device) for k, v in sd.items()}
    if cfg.tie_word_embeddings and sd["lm_head.weight"] is not sd["model.embed_tokens.weight"]:
        # a checkpoint may store both; the tied model has one tensor (HF uses the embedding)
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.batch_invariant = batch_invariant
    model = fuse_projections(column_major_weights(cast_gemm_weights(model.eval().requires_grad_(False), gemm_dtype)))
    return pad_single_row_gemms(model) if batch_invariant else model

"""Entry points in the tensor layouts that serving engines already pass around, so an engine can swap our ops in.

* :mod:`.vllm`: vLLM v1's rejection-sampler layout (flattened drafts, ``cu_num_draft_tokens`` without a leading zero,
  logits gathered at ``logits_indices``, ``-1`` placeholders in the output);
* :mod:`.sglang`: SGLang's block-drafter scheduler layout (dense ``[bs, gamma]`` confidences, one verify length per
  request, clamped to ``[min_verify_len, max_len]``).

Everything here is tensor-in, tensor-out with seeds and offsets as tensors: no host synchronisation, so the calls can
be captured in a CUDA graph (shapes are fixed by the engine's token bucket). ``examples/engine_step.py`` drives them
the way an engine step would.
"""

from .sglang import pack_verified_drafts, schedule_verify_lens_alg1, schedule_verify_lens_topk
from .vllm import offsets_from_vllm_cu, rejection_sample_vllm

__all__ = [
    "offsets_from_vllm_cu",
    "pack_verified_drafts",
    "rejection_sample_vllm",
    "schedule_verify_lens_alg1",
    "schedule_verify_lens_topk",
]

"""Entry points in the tensor layouts that serving engines already pass around, so an engine can swap our ops in.

* :mod:`.vllm`: vLLM v1's rejection-sampler layout (flattened drafts, ``cu_num_draft_tokens`` without a leading zero,
  logits gathered at ``logits_indices``, ``-1`` placeholders in the output);
* :mod:`.sglang`: a dense block-drafter scheduler layout as SGLang-style DSpark workers keep it (``[bs, gamma]``
  confidences, one verify length per request within ``[min_verify_len, max_len]``, a budget of draft slots).

Everything here is tensor-in, tensor-out with seeds and offsets as tensors. With ``check_inputs=False`` (and a
``[1]`` device tensor as the top-K budget) the scheduling and verification calls make no host synchronisation, so
they can be captured in a CUDA graph (shapes are fixed by the engine's token bucket); packing the verified drafts
(:func:`pack_verified_drafts`) has a data-dependent size and is the step's one sync. ``examples/engine_step.py``
drives them the way an engine step would.
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

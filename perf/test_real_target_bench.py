"""The real target, SmolLM2-135M-Instruct (from its GGUF), on this machine: greedy decode at batch 1 side by side with
``transformers`` and llama.cpp, the verify premise (a forward of k tokens against a 1-token decode) and batched decode.

Decode (``test_decode``): a ChatML prompt, ``NEW`` greedy tokens with EOS ignored, batch 1, the same process and
thread count for every runtime:

- ``ours_fp32`` / ``ours_bf16``: :func:`dspark_kernels.models.generate` with fp32 or weight-only bf16 GEMMs;
- ``hf_fp32`` / ``hf_bf16``: ``transformers`` ``generate`` on the dequantized Hugging Face directory
  (:func:`dspark_kernels.models.convert.converted_directory`), the same weights as ours at the same precision;
- ``llamacpp``: llama.cpp through ``llama-cpp-python`` on the GGUF itself (its Q4_1 / Q8_0 blocks), skipped when the
  optional extra (``pip install -e ".[llamacpp]"``, a source build) is absent.

Each record states the weight bytes the runtime reads per token (``bytes``: every weight but the embedding table,
which is gathered, once per forward) and its minimum (``min_bytes``: the GGUF's own tensor bytes, the least any
runtime of this checkpoint must stream per token), and ``flops`` (2 x parameters per token). ``extra_info`` has
tokens/s. ``test_decode_side_by_side`` runs them all round-robin in one test and records the median tokens/s of
each and the ratios the goals name: compare runtimes there, since absolute CPU times drift on a shared machine.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time

import pytest
import torch

from dspark_kernels.models import ModelConfig, expected_shapes, generate, load_model
from dspark_kernels.models.convert import converted_directory
from dspark_kernels.models.gguf_reader import GGUFFile
from dspark_kernels.models.gguf_weights import gguf_config_dict
from dspark_kernels.models.target_tokenizer import load_target_tokenizer
from perf.costs import decode_flops, target_forward_cost
from perf.roofline import record

MODEL = "smollm2-135m-instruct"
NEW = 64
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
RUNTIMES = ("ours_fp32", "ours_bf16", "hf_fp32", "hf_bf16", "llamacpp")
VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 200
BATCHES = (1, 2, 4, 8, 16, 32)
BATCH_NEW = 16
SIDE_BY_SIDE_CYCLES = 5


@pytest.fixture(scope="module")
def setting():
    """``(gguf path, prompt ids, gguf tensor bytes, matmul FLOPs of one token)``."""
    from dspark_kernels.models.registry import resolve_model

    path = resolve_model(MODEL)
    ids = load_target_tokenizer(path).encode_chat(CHAT)
    f = GGUFFile(path)
    gguf_bytes = sum(int(t.n_bytes) for name, t in f.tensors.items() if name != "token_embd.weight")
    cfg = ModelConfig.from_dict(gguf_config_dict(f))
    params = sum(math.prod(s) for n, s in expected_shapes(cfg).items() if n.endswith(".weight") and s[1:]
                 and n != "model.embed_tokens.weight")
    return path, ids, gguf_bytes + int(f.tensors["token_embd.weight"].n_bytes) * cfg.tie_word_embeddings, 2.0 * params


def _streamed_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one forward reads: all parameters but the embedding table (the LM head counts, tied or not)."""
    read = [p for n, p in model.named_parameters(remove_duplicate=False) if n != "model.embed_tokens.weight"]
    return sum(p.numel() * p.element_size() for p in read)


def _runner(runtime: str, path, ids: list[int]):
    """``(run() -> number of new tokens, weight bytes per token)`` for one runtime (``None``: llama.cpp reads the
    GGUF's own blocks)."""
    if runtime.startswith("ours"):
        model = load_model(path, gemm_dtype="bfloat16" if runtime == "ours_bf16" else None)
        return (lambda: generate(model, [ids], NEW).num_generated), _streamed_bytes(model)
    if runtime.startswith("hf"):
        transformers = pytest.importorskip("transformers")
        dtype = torch.bfloat16 if runtime == "hf_bf16" else torch.float32
        hf = transformers.AutoModelForCausalLM.from_pretrained(converted_directory(path), dtype=dtype).eval()
        x = torch.tensor([ids])

        @torch.no_grad()
        def run():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, pad_token_id=0, temperature=None, top_p=None, top_k=None)
            return out.shape[1] - len(ids)
        return run, _streamed_bytes(hf)
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is the optional extra: pip install -e '.[llamacpp]'")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=torch.get_num_threads(),
                          verbose=False)

    def run():
        n = 0
        llm.reset()
        for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            n += 1
            if n == NEW:
                break
        return n
    return run, None


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_decode(benchmark, setting, runtime):
    path, ids, gguf_bytes, token_flops = setting
    run, streamed = _runner(runtime, path, ids)
    n = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert n == NEW
    record(benchmark, shapes={"runtime": runtime, "batch": 1, "new_tokens": NEW, "prompt_tokens": len(ids)},
           bytes_moved=(streamed if streamed is not None else gguf_bytes) * NEW, flops=token_flops * NEW,
           impl="torch")
    benchmark.extra_info.update({"min_bytes": float(gguf_bytes * NEW), "threads": torch.get_num_threads()})
    if benchmark.stats is not None:  # None under --benchmark-disable (the CI smoke run)
        benchmark.extra_info["tokens_per_s"] = NEW / benchmark.stats.stats.median


def test_decode_side_by_side(benchmark, setting):
    """The goal's measurement: every runtime decodes the same prompt once per cycle, in an order rotated each cycle,
    so slow drifts of a shared machine's speed hit them alike; ``extra_info`` has each runtime's median tokens/s over
    the cycles and the ratios the goals name (ours / ``transformers`` at each precision, ours / llama.cpp)."""
    path, ids, _, _ = setting
    runtimes = [r for r in RUNTIMES if r != "llamacpp" or importlib.util.find_spec("llama_cpp") is not None]
    runners = {r: _runner(r, path, ids)[0] for r in runtimes}
    seconds: dict[str, list[float]] = {r: [] for r in runtimes}
    cycle = [0]

    def one_cycle():
        k = cycle[0] % len(runtimes)
        for r in runtimes[k:] + runtimes[:k]:
            t0 = time.perf_counter()
            assert runners[r]() == NEW
            seconds[r].append(time.perf_counter() - t0)
        cycle[0] += 1

    benchmark.pedantic(one_cycle, rounds=SIDE_BY_SIDE_CYCLES, warmup_rounds=1)
    tps = {r: NEW / statistics.median(t[1:] if len(t) > 1 else t) for r, t in seconds.items()}  # t[0]: the warmup
    ratios = {"ours_fp32/hf_fp32": tps["ours_fp32"] / tps["hf_fp32"],
              "ours_bf16/hf_bf16": tps["ours_bf16"] / tps["hf_bf16"]}
    if "llamacpp" in tps:
        ratios["best_ours/llamacpp"] = max(tps["ours_fp32"], tps["ours_bf16"]) / tps["llamacpp"]
    benchmark.extra_info.update({"runtimes": runtimes, "tokens_per_s": tps, "ratios": ratios, "new_tokens": NEW,
                                 "cycles": len(seconds[runtimes[0]]) - 1, "threads": torch.get_num_threads()})


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def target(request, setting):
    return load_model(setting[0], gemm_dtype=request.param), request.param


@pytest.mark.parametrize("k", VERIFY_TOKENS)
def test_verify_forward(benchmark, target, k):
    """One forward of ``k`` new tokens on a ``CONTEXT``-token cache (rolled back after each call): k = 1 is a plain
    decode step; a verify of k tokens costs ``time(k) / time(1)`` decode steps."""
    model, gemm_dtype = target
    cache = model.new_cache(num_pages=(CONTEXT + 64) // 16 + 2, page_size=16)
    cache.add_request(0)
    ctx = torch.randint(4, 49152, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    model(ctx, torch.tensor([0, CONTEXT], dtype=torch.int32), [0], cache, logits_indices=torch.tensor([CONTEXT - 1]))
    new = torch.randint(4, 49152, (k,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, k], dtype=torch.int32)

    def verify():
        model(new, cu, [0], cache)
        cache.rollback(0, k)

    benchmark.pedantic(verify, rounds=20, warmup_rounds=3)
    weight_bytes, flops = target_forward_cost(model, CONTEXT, k)
    record(benchmark, shapes={"new_tokens": k, "context": CONTEXT, "gemm_dtype": gemm_dtype}, bytes_moved=weight_bytes,
           flops=flops, impl="torch")


@pytest.mark.parametrize("batch", BATCHES)
def test_batched_decode(benchmark, target, setting, batch):
    """Greedy decode of ``batch`` chat prompts at once, ``BATCH_NEW`` tokens each (tokens/s of the batch)."""
    model, gemm_dtype = target
    ids = setting[1]
    prompts = [ids[:len(ids) - i % 4] for i in range(batch)]  # ragged
    res = benchmark.pedantic(lambda: generate(model, prompts, BATCH_NEW), rounds=2, warmup_rounds=1)
    assert res.num_generated == batch * BATCH_NEW
    record(benchmark, shapes={"batch": batch, "new_tokens": BATCH_NEW, "gemm_dtype": gemm_dtype},
           bytes_moved=_streamed_bytes(model) * BATCH_NEW,
           flops=decode_flops(model, sum(len(p) for p in prompts) + batch * (BATCH_NEW - 1), batch * BATCH_NEW),
           impl="torch")
    if benchmark.stats is not None:
        benchmark.extra_info["tokens_per_s"] = batch * BATCH_NEW / benchmark.stats.stats.median

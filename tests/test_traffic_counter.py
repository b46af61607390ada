"""The interpreter traffic counter (``perf/traffic.py``) counts a kernel's bytes, grid and serial depth exactly."""

import pytest
import torch
import triton
import triton.language as tl

from perf.traffic import count_traffic

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="counts the Triton interpreter's work")


@triton.jit
def _copy_tiles(x_ptr, y_ptr, n, TILES: tl.constexpr, BLOCK: tl.constexpr):
    """Program p copies ``TILES`` tiles of ``BLOCK`` elements from ``p * TILES * BLOCK`` (masked past ``n``)."""
    base = tl.program_id(0) * TILES * BLOCK
    for t in range(TILES):
        i = base + t * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def test_counts_masked_bytes_programs_and_the_longest_program():
    x = torch.randn(1000)
    y = torch.empty(1000)
    with count_traffic() as t:
        z = torch.zeros(250, dtype=torch.float64)  # launcher work: a filled allocation
        _copy_tiles[(4,)](x, y, 1000, TILES=2, BLOCK=128)
        _copy_tiles[(1,)](x, y, 1000, TILES=8, BLOCK=128)
    assert torch.equal(x, y) and z.sum() == 0
    assert t.kernel_bytes == 2 * (1000 * 4 + 1000 * 4)  # masked lanes are not traffic
    assert t.programs == [4, 1]
    assert t.dependent_chain == 2 * 2 + 2 * 8  # a load and a store per tile, the longest program of each launch
    assert t.torch_bytes == 250 * 8
    assert t.bytes_moved == t.kernel_bytes + t.torch_bytes


def test_the_interpreter_is_restored_after_the_block():
    from triton.runtime import interpreter

    before = interpreter.InterpreterBuilder.create_masked_load
    with count_traffic():
        pass
    assert interpreter.InterpreterBuilder.create_masked_load is before
    x, y = torch.randn(64), torch.empty(64)
    _copy_tiles[(1,)](x, y, 64, TILES=1, BLOCK=64)
    assert torch.equal(x, y)


def test_decode_of_one_request_fills_a_wave_and_the_draft_block_reads_its_context_once():
    """The grid and traffic goals of the attention kernels, counted: decode of one request over 4k keys launches at
    least 132 programs (split-KV) and reads its K/V once; a draft block of gamma 7 x GQA group 4 is one query tile,
    so the context is read once per KV head (not once per 16-row tile)."""
    from dspark_kernels.ops import draft_block_attention, verify_attention
    from dspark_kernels.ops.draft_block_attention import _DEFAULTS as DRAFT_DEFAULTS
    from tests.test_draft_block_attention import make_block_batch
    from tests.test_verify_attention import make_paged_batch

    args = make_paged_batch([1], [4096], 8, 8, 16, 16)
    with count_traffic(torch_ops=False) as t:
        verify_attention(*args, impl="triton", max_seqlen_q=1)
    kv_bytes = 2 * 4096 * 8 * 16 * 4
    assert t.programs[0] >= 132
    assert kv_bytes <= t.kernel_bytes <= 1.25 * kv_bytes  # K/V once, plus the splits' partial states
    hq, hkv, d, ctx = 8, 2, 16, DRAFT_DEFAULTS["BLOCK_N"]  # one key tile of context: no split-KV
    args = make_block_batch([7, 7], [ctx, ctx], hq, hkv, d, 16)
    with count_traffic(torch_ops=False) as t:
        draft_block_attention(*args, impl="triton", max_seqlen_q=7)
    context_bytes = 2 * 2 * ctx * hkv * d * 4
    block_bytes = 4 * (2 * 2 * 7 * hq * d + 2 * 2 * 7 * hkv * d)  # q, out; block k, v
    assert t.programs == [2 * hkv]  # one query tile per (request, KV head)
    assert t.kernel_bytes <= 1.1 * (context_bytes + block_bytes)

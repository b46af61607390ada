"""PagedKVCache: page accounting (reserve / rollback / free), page reuse, out-of-pages, batch tensors, K/V scatter."""

import pytest
import torch

from dspark_kernels.models import OutOfPagesError, PagedKVCache


def _cache(num_pages=6, page_size=4, layers=2):
    return PagedKVCache(layers, num_pages, page_size, num_kv_heads=2, head_dim=3)


def test_reserve_rollback_free_accounting():
    c = _cache()
    c.add_request("a")
    assert c.reserve("a", 5) == 0  # 2 pages
    assert c.length("a") == 5 and len(c.pages("a")) == 2 and c.num_free_pages == 4
    assert c.reserve("a", 3) == 5  # fills page 2 exactly
    assert len(c.pages("a")) == 2 and c.num_free_pages == 4
    assert c.reserve("a", 1) == 8
    assert len(c.pages("a")) == 3 and c.num_free_pages == 3
    c.rollback("a", 1)  # back to 8 tokens: third page released
    assert c.length("a") == 8 and len(c.pages("a")) == 2 and c.num_free_pages == 4
    c.rollback("a", 4)
    assert c.length("a") == 4 and len(c.pages("a")) == 1
    c.rollback("a", 0)
    assert c.length("a") == 4
    with pytest.raises(ValueError, match="rollback"):
        c.rollback("a", 5)
    c.free("a")
    assert "a" not in c and c.num_free_pages == 6
    with pytest.raises(KeyError, match="unknown request"):
        c.reserve("a", 1)


def test_pages_are_reused():
    c = _cache(num_pages=3)
    c.add_request(1)
    c.reserve(1, 12)
    first = set(c.pages(1))
    assert first == {0, 1, 2} and c.num_free_pages == 0
    c.free(1)
    c.add_request(2)
    c.reserve(2, 12)
    assert set(c.pages(2)) == first
    c.rollback(2, 8)
    c.add_request(3)
    c.reserve(3, 8)
    assert set(c.pages(2)) | set(c.pages(3)) == first


def test_out_of_pages_is_clear_and_atomic():
    c = _cache(num_pages=2)
    c.add_request("x")
    c.add_request("y")
    c.reserve("x", 6)
    with pytest.raises(OutOfPagesError, match="out of KV-cache pages"):
        c.reserve("y", 3)
    assert c.length("y") == 0 and c.num_free_pages == 0 and c.length("x") == 6
    c.rollback("x", 6)
    c.reserve("y", 3)  # fine now
    with pytest.raises(OutOfPagesError):
        c.reserve_many(["x", "y"], [1, 2])  # x needs 1 page (1 free), y needs 1 more
    assert c.length("x") == 0 and c.length("y") == 3  # nothing reserved by the failed batch


def test_duplicate_and_bad_args():
    with pytest.raises(ValueError, match="num_pages"):
        PagedKVCache(1, 0, 4, 1, 2)
    c = _cache()
    c.add_request(0)
    with pytest.raises(ValueError, match="already"):
        c.add_request(0)
    with pytest.raises(ValueError, match="duplicate"):
        c.reserve_many([0, 0], [1, 1])


def test_batch_tensors_and_write_scatter():
    c = _cache(num_pages=8, page_size=4)
    for rid, n in (("a", 6), ("b", 1), ("c", 9)):
        c.add_request(rid)
        c.reserve(rid, n - 2 if n > 2 else n)
    q_lens = [2, 0, 2]  # a and c get two new tokens each, b none
    c.reserve("a", 2)
    c.reserve("c", 2)
    rids = ["a", "b", "c"]
    table, lens = c.batch_tensors(rids)
    assert table.dtype == torch.int32 and lens.dtype == torch.int32
    assert lens.tolist() == [6, 1, 9] and table.shape == (3, 3)
    for r, rid in enumerate(rids):
        assert table[r, : len(c.pages(rid))].tolist() == c.pages(rid)
    slots, positions = c.token_slots(rids, q_lens)
    expect, expect_pos = [], []
    for rid, q in zip(rids, q_lens):
        for pos in range(c.length(rid) - q, c.length(rid)):
            expect.append(c.pages(rid)[pos // 4] * 4 + pos % 4)
            expect_pos.append(pos)
    assert slots.tolist() == expect and positions.tolist() == expect_pos
    assert slots.dtype == positions.dtype == torch.int64
    assert c.token_slots(["c"], [9])[1].tolist() == list(range(9))  # a whole request
    with pytest.raises(ValueError, match="count must be in"):
        c.token_slots(["b"], [2])
    k = torch.randn(4, 2, 3)
    v = torch.randn(4, 2, 3)
    c.write(1, slots, k, v)
    for i, s in enumerate(expect):
        torch.testing.assert_close(c.k[1][s // 4, s % 4], k[i])
        torch.testing.assert_close(c.v[1][s // 4, s % 4], v[i])
    assert c.k[0].abs().sum() == 0  # other layer untouched

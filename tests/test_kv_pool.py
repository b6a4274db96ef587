"""KVPool: page allocation accounting and the integrity check."""

import pytest
import torch

from tokenrouter.models.kv_pool import KVPool


def make_pool(num_pages=8, page_size=4):
    return KVPool(num_pages, page_size, num_layers=2, num_kv_heads=1, head_dim=2,
                  dtype=torch.float32, device=torch.device("cpu"))


def test_shapes_and_capacity():
    pool = make_pool(num_pages=5, page_size=3)
    assert pool.k.shape == (2, 18, 1, 2)  # 5 pages and the scratch page
    assert pool.v.shape == (2, 18, 1, 2)
    assert pool.capacity_tokens == 15
    assert pool.scratch_slot == 15
    assert pool.num_free == 5
    assert pool.free_pages == set(range(5))
    assert KVPool.bytes_per_token(2, 1, 2, torch.float32) == 2 * 2 * 1 * 2 * 4


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        make_pool(num_pages=0)
    with pytest.raises(ValueError):
        make_pool(page_size=0)


def test_alloc_and_free_accounting():
    pool = make_pool(num_pages=8)
    a = pool.alloc(3)
    assert a == [0, 1, 2]  # low ids first, deterministic
    assert pool.num_free == 5
    b = pool.alloc(5)
    assert b is not None and len(b) == 5
    assert set(a).isdisjoint(b)
    assert set(a) | set(b) == set(range(8))
    assert pool.num_free == 0
    assert pool.free_pages == set()
    pool.check_integrity()
    pool.free(a)
    assert pool.num_free == 3
    assert pool.free_pages == set(a)
    pool.free(b)
    assert pool.num_free == 8
    assert pool.free_pages == set(range(8))
    pool.check_integrity()


def test_alloc_zero_returns_empty_list():
    pool = make_pool(num_pages=2)
    assert pool.alloc(0) == []
    assert pool.num_free == 2


def test_alloc_more_than_free_takes_nothing():
    pool = make_pool(num_pages=4)
    held = pool.alloc(3)
    assert held is not None
    before = pool.free_pages
    assert pool.alloc(2) is None
    assert pool.num_free == 1
    assert pool.free_pages == before
    assert pool.alloc(5) is None  # more than the whole pool
    assert pool.num_free == 1
    assert pool.alloc(1) is not None
    assert pool.alloc(1) is None
    pool.check_integrity()


def test_freed_pages_are_reused():
    pool = make_pool(num_pages=3)
    a = pool.alloc(3)
    pool.free(a[1:2])
    assert pool.alloc(1) == [a[1]]


def test_check_integrity_catches_double_free():
    pool = make_pool(num_pages=4)
    pages = pool.alloc(2)
    pool.free(pages[:1])
    pool.check_integrity()
    pool.free(pages[:1])  # the same page again
    with pytest.raises(AssertionError, match="twice"):
        pool.check_integrity()


def test_check_integrity_catches_out_of_range_page():
    pool = make_pool(num_pages=4)
    pool.alloc(1)
    pool.free([99])
    with pytest.raises(AssertionError, match="out of range"):
        pool.check_integrity()

"""RadixCache: page-aligned matching, splits, lock counts, LRU eviction, and a randomized model check."""

import random

import pytest
import torch

from tokenrouter.engine.radix_cache import RadixCache, TreeNode
from tokenrouter.models.kv_pool import KVPool


def make(num_pages=32, page_size=4, enabled=True):
    pool = KVPool(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=1,
                  dtype=torch.float32, device=torch.device("cpu"))
    return pool, RadixCache(pool, enabled=enabled)


def check(pool, cache):
    pool.check_integrity()
    cache.check_integrity()
    # No request holds private pages in these tests: every page is free or cached.
    assert pool.num_free + cache.total_pages == pool.num_pages
    assert len(cache.all_pages()) == cache.total_pages


def put(pool, cache, tokens):
    """Cache tokens (whole pages) with fresh pages, freeing the duplicates as the scheduler does."""
    p = cache.page_size
    assert len(tokens) % p == 0
    pages = pool.alloc(len(tokens) // p)
    assert pages is not None
    known = cache.insert(tokens, pages)
    pool.free(pages[:known // p])
    check(pool, cache)
    return known, pages


def path_tokens(cache, node):
    """Token ids from the root down to node."""
    parts = []
    while node is not cache.root:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def seq(n, start=0):
    return list(range(start, start + n))


PAGE_SIZES = [1, 4]


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_match_on_empty_cache(p):
    pool, cache = make(page_size=p)
    m = cache.match_prefix(seq(10))
    assert m.length == 0 and m.pages == [] and m.node is cache.root
    m = cache.match_prefix([])
    assert m.length == 0 and m.pages == [] and m.node is cache.root
    check(pool, cache)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_insert_then_match(p):
    pool, cache = make(page_size=p)
    tokens = seq(3 * p, start=100)
    known, pages = put(pool, cache, tokens)
    assert known == 0
    assert cache.evictable_pages == 3 and cache.locked_pages == 0

    # Exact and longer queries match everything cached.
    for query in (tokens, tokens + [7, 8, 9]):
        m = cache.match_prefix(query)
        assert m.length == 3 * p
        assert m.pages == pages
        assert path_tokens(cache, m.node) == tokens

    # A query that stops mid-page rounds down to the last whole page.
    query = tokens[:2 * p + (p - 1)] if p > 1 else tokens[:2]
    m = cache.match_prefix(query)
    assert m.length == 2 * p
    assert m.pages == pages[:2]
    assert path_tokens(cache, m.node) == tokens[:2 * p]

    # A query that diverges inside the second page matches only the first.
    query = tokens[:p] + [999] + tokens[p + 1:]
    m = cache.match_prefix(query)
    assert m.length == p
    assert m.pages == pages[:1]

    # A query shorter than a page matches nothing.
    if p > 1:
        m = cache.match_prefix(tokens[:p - 1])
        assert m.length == 0 and m.node is cache.root
    # A different first page matches nothing.
    m = cache.match_prefix([999] + tokens[1:])
    assert m.length == 0 and m.pages == []
    check(pool, cache)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_insert_returns_cached_length(p):
    pool, cache = make(page_size=p)
    base = seq(2 * p, start=10)
    assert put(pool, cache, base)[0] == 0
    # Same tokens again: everything was already cached.
    assert put(pool, cache, base)[0] == 2 * p
    # Extension: the old part was cached, the new page is added.
    ext = base + seq(p, start=50)
    known, pages = put(pool, cache, ext)
    assert known == 2 * p
    assert cache.total_pages == 3
    assert cache.match_prefix(ext).pages[2] == pages[2]
    # Divergence after one page: one page known, split and a new branch.
    branch = base[:p] + seq(2 * p, start=70)
    known, pages = put(pool, cache, branch)
    assert known == p
    assert cache.total_pages == 5
    m = cache.match_prefix(branch)
    assert m.length == 3 * p and m.pages[1:] == pages[1:]
    # A prefix of something cached is entirely known.
    assert put(pool, cache, base[:p])[0] == p
    assert cache.total_pages == 5


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_partial_match_splits_and_keeps_locks(p):
    pool, cache = make(page_size=p)
    tokens = seq(3 * p, start=1)
    _, pages = put(pool, cache, tokens)
    whole = cache.match_prefix(tokens)
    cache.lock(whole.node)
    assert whole.node.lock_ref == 1
    assert cache.locked_pages == 3 and cache.evictable_pages == 0
    cache.check_integrity()

    # Matching only the first page splits the node in two.
    part = cache.match_prefix(tokens[:p])
    assert part.length == p and part.pages == pages[:1]
    assert part.node is not whole.node
    assert whole.node.parent is part.node
    assert part.node.lock_ref == 1 and whole.node.lock_ref == 1  # the split copies the lock
    assert cache.locked_pages == 3 and cache.evictable_pages == 0
    assert path_tokens(cache, whole.node) == tokens  # the locked node still ends at the same place
    check(pool, cache)

    # Locking the upper part as well: two locks above, one below.
    cache.lock(part.node)
    assert part.node.lock_ref == 2 and whole.node.lock_ref == 1
    cache.unlock(whole.node)
    assert part.node.lock_ref == 1 and whole.node.lock_ref == 0
    assert cache.locked_pages == 1 and cache.evictable_pages == 2
    check(pool, cache)
    cache.unlock(part.node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 3
    check(pool, cache)
    # The split node still matches as a whole.
    assert cache.match_prefix(tokens).pages == pages


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_insert_splits_locked_node(p):
    pool, cache = make(page_size=p)
    tokens = seq(3 * p, start=1)
    put(pool, cache, tokens)
    node = cache.match_prefix(tokens).node
    cache.lock(node)
    # A branch after the first page splits the locked node; the new branch is evictable.
    known, _ = put(pool, cache, tokens[:p] + seq(p, start=500))
    assert known == p
    assert cache.locked_pages == 3 and cache.evictable_pages == 1
    assert node.parent.lock_ref == 1 and node.parent is not cache.root
    cache.unlock(node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 4
    check(pool, cache)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_lock_unlock_counters(p):
    pool, cache = make(page_size=p)
    a = seq(2 * p, start=0)
    b = a[:p] + seq(p, start=300)  # shares the first page with a
    put(pool, cache, a)
    put(pool, cache, b)
    assert cache.evictable_pages == 3 and cache.locked_pages == 0
    na = cache.match_prefix(a).node
    nb = cache.match_prefix(b).node
    cache.lock(na)
    assert (cache.evictable_pages, cache.locked_pages) == (1, 2)
    check(pool, cache)
    cache.lock(nb)
    assert (cache.evictable_pages, cache.locked_pages) == (0, 3)
    cache.lock(na)  # a second lock moves nothing
    assert (cache.evictable_pages, cache.locked_pages) == (0, 3)
    check(pool, cache)
    cache.unlock(na)
    assert (cache.evictable_pages, cache.locked_pages) == (0, 3)
    cache.unlock(na)
    assert (cache.evictable_pages, cache.locked_pages) == (1, 2)
    check(pool, cache)
    cache.unlock(nb)
    assert (cache.evictable_pages, cache.locked_pages) == (3, 0)
    check(pool, cache)
    with pytest.raises(AssertionError):
        cache.unlock(nb)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_lock_root_is_noop(p):
    pool, cache = make(page_size=p)
    put(pool, cache, seq(p))
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 1
    assert (cache.evictable_pages, cache.locked_pages) == (1, 0)
    check(pool, cache)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_evict_lru_first_and_never_locked(p):
    pool, cache = make(page_size=p)
    a, b, c = seq(p, start=10), seq(p, start=20), seq(p, start=30)
    _, pa = put(pool, cache, a)
    _, pb = put(pool, cache, b)
    _, pc = put(pool, cache, c)
    # Touch a: b is now the least recently used.
    cache.match_prefix(a)
    free_before = pool.free_pages
    assert cache.evict(1) == 1
    assert pool.free_pages == free_before | set(pb)
    assert cache.match_prefix(b).length == 0
    assert cache.match_prefix(a).length == p  # touches a again
    check(pool, cache)

    # Lock c (the oldest now): eviction of everything takes only a.
    cache.lock(cache.match_prefix(c).node)
    cache.match_prefix(a)
    assert cache.evict(10) == 1
    assert cache.match_prefix(a).length == 0
    assert cache.match_prefix(c).pages == pc
    assert cache.locked_pages == 1 and cache.evictable_pages == 0
    assert cache.evict(10) == 0  # nothing evictable left
    check(pool, cache)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_evict_takes_leaves_then_their_parents(p):
    pool, cache = make(page_size=p)
    trunk = seq(p, start=1)
    put(pool, cache, trunk + seq(p, start=100))
    put(pool, cache, trunk + seq(p, start=200))
    assert cache.total_pages == 3
    locked_leaf = cache.match_prefix(trunk + seq(p, start=200)).node
    cache.lock(locked_leaf)
    # Only the unlocked leaf can go; the trunk is locked through its other child.
    assert cache.evict(3) == 1
    assert cache.total_pages == 2
    check(pool, cache)
    cache.unlock(locked_leaf)
    # Now the leaf goes, and then its parent as it became a leaf.
    assert cache.evict(3) == 2
    assert cache.total_pages == 0 and pool.num_free == pool.num_pages
    check(pool, cache)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_evict_stops_once_enough_is_freed(p):
    pool, cache = make(page_size=p)
    for i in range(4):
        put(pool, cache, seq(p, start=1000 * (i + 1)))
    assert cache.evict(2) == 2
    assert cache.total_pages == 2
    check(pool, cache)


def test_reset_and_locked_reset():
    pool, cache = make(page_size=2)
    put(pool, cache, seq(6))
    put(pool, cache, seq(4, start=50))
    node = cache.match_prefix(seq(6)).node
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.total_pages == 0 and pool.num_free == pool.num_pages
    check(pool, cache)


def test_disabled_cache_matches_nothing():
    pool, cache = make(page_size=2, enabled=False)
    pages = pool.alloc(2)
    assert cache.insert(seq(4), pages) == 0
    m = cache.match_prefix(seq(4))
    assert m.length == 0 and m.pages == [] and m.node is cache.root
    assert cache.total_pages == 0


def test_check_integrity_catches_cached_page_that_is_free():
    pool, cache = make(page_size=2)
    _, pages = put(pool, cache, seq(4))
    pool.free(pages[:1])
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_check_integrity_catches_bad_counters():
    pool, cache = make(page_size=2)
    put(pool, cache, seq(4))
    cache.evictable_pages += 1
    with pytest.raises(AssertionError, match="counters"):
        cache.check_integrity()


# ---- randomized check against a model -------------------------------------------------------------

class Model:
    """What should be cached: page-aligned prefix (tuple) -> page id, plus lock counts per prefix."""

    def __init__(self, p):
        self.p = p
        self.pages: dict[tuple, int] = {}
        self.locks: dict[tuple, int] = {}

    def prefixes(self, tokens, n_pages):
        return [tuple(tokens[:(i + 1) * self.p]) for i in range(n_pages)]

    def match(self, tokens):
        out = []
        for pre in self.prefixes(tokens, len(tokens) // self.p):
            if pre not in self.pages:
                break
            out.append(self.pages[pre])
        return len(out) * self.p, out

    def locked_pages(self):
        return sum(1 for pre in self.pages if self.locks.get(pre, 0) > 0)


def cached_prefixes(cache):
    """Every page-aligned prefix in the tree, with its page."""
    p = cache.page_size
    out = {}
    stack = [(cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        for i, page in enumerate(node.pages):
            out[tuple(prefix + node.key[:(i + 1) * p])] = page
        for child in node.children.values():
            stack.append((child, prefix + node.key))
    return out


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_against_model(p, seed):
    rng = random.Random(seed)
    num_pages = 24
    pool, cache = make(num_pages=num_pages, page_size=p)
    model = Model(p)
    held: list[tuple[TreeNode, list[int]]] = []  # locks: node and the tokens it should stand for

    def rand_tokens():
        # A small alphabet and a few common stems, so prefixes are shared and nodes split often.
        stem = rng.choice([[], [0, 1] * 4, [2] * 6, [1, 2, 0, 1, 2, 0]])
        tail = [rng.randrange(3) for _ in range(rng.randrange(0, 4 * p + 3))]
        return (stem + tail)[:rng.randrange(0, 6 * p + 1) or None]

    counts = dict.fromkeys(["insert", "match", "lock", "unlock", "evict"], 0)
    for _ in range(200):
        op = rng.choice(["insert", "insert", "match", "lock", "unlock", "evict"])
        counts[op] += 1
        if op == "insert":
            tokens = rand_tokens()
            tokens = tokens[:len(tokens) // p * p]
            n = len(tokens) // p
            expected_known, cached = model.match(tokens)
            reuse = rng.random() < 0.5  # a request that matched first reuses the cached pages
            if reuse:
                fresh = pool.alloc(n - len(cached))
                if fresh is None:
                    continue
                pages = cached + fresh
            else:
                pages = pool.alloc(n)
                if pages is None:
                    continue
            known = cache.insert(tokens, pages)
            assert known == expected_known
            if reuse:
                pool.free(pages[len(cached):known // p])  # empty: nothing changed in between
            else:
                pool.free(pages[:known // p])
            for pre, page in zip(model.prefixes(tokens, n), pages):
                model.pages.setdefault(pre, page)
        elif op == "match":
            tokens = rand_tokens()
            length, pages = model.match(tokens)
            m = cache.match_prefix(tokens)
            assert (m.length, m.pages) == (length, pages)
            assert path_tokens(cache, m.node) == tokens[:length]
        elif op == "lock":
            tokens = rand_tokens()
            m = cache.match_prefix(tokens)
            cache.lock(m.node)
            if m.node is not cache.root:
                held.append((m.node, tokens[:m.length]))
                for pre in model.prefixes(tokens, m.length // p):
                    model.locks[pre] = model.locks.get(pre, 0) + 1
        elif op == "unlock":
            if not held:
                continue
            node, tokens = held.pop(rng.randrange(len(held)))
            assert path_tokens(cache, node) == tokens  # splits kept the locked node's meaning
            cache.unlock(node)
            for pre in model.prefixes(tokens, len(tokens) // p):
                model.locks[pre] -= 1
        else:
            want = rng.randrange(1, 8)
            evictable = cache.evictable_pages
            free_before = pool.num_free
            freed = cache.evict(want)
            assert freed >= min(want, evictable)
            assert freed <= evictable
            assert pool.num_free == free_before + freed
            survivors = cached_prefixes(cache)
            assert set(survivors) <= set(model.pages)
            for pre, page in survivors.items():
                assert model.pages[pre] == page
            for pre in model.pages:
                if model.locks.get(pre, 0) > 0:
                    assert pre in survivors, "evicted a locked page"
            for pre in survivors:  # what is left is still a tree of prefixes
                assert len(pre) == p or pre[:-p] in survivors
            model.pages = survivors

        check(pool, cache)
        assert cached_prefixes(cache) == model.pages
        assert cache.locked_pages == model.locked_pages()
        assert cache.evictable_pages == len(model.pages) - model.locked_pages()

    assert all(counts.values()), counts
    # Release every lock: everything is evictable, and evicting it all empties the cache.
    for node, _ in held:
        cache.unlock(node)
    assert cache.locked_pages == 0
    cache.evict(num_pages)
    assert cache.total_pages == 0 and pool.num_free == num_pages
    check(pool, cache)

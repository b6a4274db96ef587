"""A radix-tree prefix cache over KV pages, page aligned, with lock counts and LRU eviction."""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

from tokenrouter.models.kv_pool import KVPool


class TreeNode:
    """A run of whole pages. `key` holds len(pages) * page_size token ids.

    `lock_ref` counts the locks held on this node or on any node below it: a node with
    lock_ref > 0 is in use by a request and is never evicted.
    """

    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: TreeNode | None) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class MatchResult(NamedTuple):
    length: int  # matched tokens, a multiple of the page size
    pages: list[int]
    node: TreeNode  # the deepest matched node: lock it to protect the whole match


class RadixCache:
    """Shares the KV of common prefixes between requests.

    Ownership: a page is either free (in the pool), in this tree, or private to one request. The tree
    owns its pages; a request that matched a prefix reads them while it holds a lock on the match
    node, and never writes them (matches are page aligned, so a request writes only pages it owns).
    Eviction frees unlocked leaves, least recently used first.
    """

    def __init__(self, pool: KVPool, enabled: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.enabled = enabled
        self.root = TreeNode([], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self.evictable_pages = 0
        self.locked_pages = 0

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    def _first_page(self, key: list[int], pos: int) -> tuple[int, ...]:
        return tuple(key[pos:pos + self.page_size])

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`; splits a node so the match ends on one."""
        if not self.enabled:
            return MatchResult(0, [], self.root)
        p = self.page_size
        usable = len(tokens) // p * p
        node, pos, pages = self.root, 0, []
        now = next(self._clock)
        node.last_access = now
        while pos < usable:
            child = node.children.get(self._first_page(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos, usable) * p
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += n
            node = child
        return MatchResult(pos, pages, node)

    def _common_pages(self, key: list[int], tokens: list[int], pos: int, end: int) -> int:
        """Whole pages on which `key` agrees with tokens[pos:end]."""
        p = self.page_size
        if tokens[pos:pos + len(key)] == key:
            return len(key) // p
        n = 0
        while pos + (n + 1) * p <= end and key[n * p:(n + 1) * p] == tokens[pos + n * p:pos + (n + 1) * p]:
            n += 1
        return n

    def _split(self, child: TreeNode, n_tokens: int) -> TreeNode:
        """Cut `child` after n_tokens; return the new upper node."""
        p = self.page_size
        upper = TreeNode(child.key[:n_tokens], child.pages[:n_tokens // p], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        assert child.parent is not None
        child.parent.children[self._first_page(upper.key, 0)] = upper
        child.key = child.key[n_tokens:]
        child.pages = child.pages[n_tokens // p:]
        child.parent = upper
        upper.children[self._first_page(child.key, 0)] = child
        return upper

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Add a page-aligned prefix and its pages. Returns how many leading tokens were already cached:
        the caller's pages for those positions are duplicates, and the caller frees them unless they
        are the cached pages themselves."""
        if not self.enabled:
            return 0
        p = self.page_size
        assert len(tokens) == len(pages) * p, "insert takes whole pages"
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(self._first_page(tokens, pos))
            if child is None:
                new = TreeNode(tokens[pos:], pages[pos // p:], node)
                new.last_access = now
                node.children[self._first_page(tokens, pos)] = new
                self.evictable_pages += len(new.pages)
                return pos
            n = self._common_pages(child.key, tokens, pos, len(tokens)) * p
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        return pos

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.locked_pages -= len(node.pages)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages unlocked pages (or all there are), LRU leaves first."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._first_page(leaf.key, 0)]
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every cached page (all must be unlocked)."""
        if self.locked_pages:
            raise RuntimeError("radix cache: reset while requests hold locks")
        self.evict(self.evictable_pages)

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if not n.children and n is not self.root]

    def all_pages(self) -> list[int]:
        return [pg for n in self._nodes() for pg in n.pages]

    def check_integrity(self) -> None:
        p = self.page_size
        evictable = locked = 0
        for node in self._nodes():
            if node is self.root:
                continue
            if len(node.key) != len(node.pages) * p or not node.pages:
                raise AssertionError("radix cache: node key is not whole pages")
            child_locks = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < child_locks:
                raise AssertionError("radix cache: lock count below its children's")
            for first, child in node.children.items():
                if child.parent is not node or tuple(child.key[:p]) != first:
                    raise AssertionError("radix cache: broken child link")
            if node.lock_ref > 0:
                locked += len(node.pages)
            else:
                evictable += len(node.pages)
        if (evictable, locked) != (self.evictable_pages, self.locked_pages):
            raise AssertionError(
                f"radix cache: counters {self.evictable_pages}/{self.locked_pages} "
                f"!= recount {evictable}/{locked}"
            )
        pages = self.all_pages()
        if len(set(pages)) != len(pages):
            raise AssertionError("radix cache: a page is cached twice")
        if set(pages) & self.pool.free_pages:
            raise AssertionError("radix cache: a cached page is also free")

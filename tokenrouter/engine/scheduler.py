"""Continuous batching over one model: admission, chunked prefill, preemption, PENDING skips.

No I/O and no model here: the scheduler decides which requests feed how many tokens, and keeps the
page bookkeeping; the engine runs the step and commits. The same scheduler serves the offline API,
the server and the tests.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from tokenrouter.engine.launch_policy import EagerLaunch, LaunchPolicy
from tokenrouter.engine.radix_cache import MatchResult, RadixCache
from tokenrouter.engine.req import Req, ReqStatus
from tokenrouter.models.kv_pool import KVPool


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048  # tokens per step, decodes included

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < self.max_running_requests:
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be at least "
                f"max_running_requests ({self.max_running_requests}): every running request decodes each step"
            )


class ScheduledBatch(NamedTuple):
    reqs: list[Req]
    extend_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class Scheduler:
    """Owns the queue and the page bookkeeping of one model.

    `running` holds admitted requests, RUNNING or PENDING, in admission order. A PENDING request keeps
    its pages and its prefix lock but is never scheduled. Preemption picks the most recently admitted
    RUNNING request, returns its pages (its computed prefix goes to the prefix cache) and puts it at
    the head of the queue; it later recomputes from its tokens, outputs included.
    """

    def __init__(self, cfg: SchedulerConfig, pool: KVPool, cache: RadixCache,
                 launch: LaunchPolicy | None = None) -> None:
        if pool.page_size != cfg.page_size:
            raise ValueError("scheduler and KV pool disagree on the page size")
        self.cfg = cfg
        self.pool = pool
        self.cache = cache
        self.launch = launch or EagerLaunch()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0

    # ---- queue -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        if req.status is not ReqStatus.WAITING or req.pages:
            raise ValueError(f"request {req.rid} must be WAITING with no pages to be queued")
        self.waiting.append(req)

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        """Something a step launches for (a look-ahead row only rides along)."""
        return bool(self.waiting) or any(r.status is ReqStatus.RUNNING and not r.look_ahead for r in self.running)

    def find(self, rid: str) -> Req | None:
        return next((r for r in (*self.running, *self.waiting) if r.rid == rid), None)

    # ---- pages -------------------------------------------------------------------------------
    def _pages_for(self, req: Req, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.cfg.page_size) - len(req.pages)

    def _alloc(self, n: int) -> list[int] | None:
        short = n - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        return self.pool.alloc(n)

    def _available_pages(self) -> int:
        return self.pool.num_free + self.cache.evictable_pages

    def release(self, req: Req) -> None:
        """Give back a request's pages: computed whole pages go to the prefix cache, the rest are freed."""
        p = self.cfg.page_size
        if self.cache.enabled:
            full = req.kv_len // p * p
            known = self.cache.insert(req.tokens[:full], req.pages[:full // p])
            self.pool.free(req.pages[req.cached_len // p:known // p])  # duplicates of cached pages
            self.pool.free(req.pages[full // p:])
        else:
            self.pool.free(req.private_pages(p))
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.pages, req.cached_len, req.cache_node, req.kv_len = [], 0, None, 0

    def finish(self, req: Req) -> None:
        """Remove a request (finished or aborted) from this scheduler and free what it holds."""
        if req in self.running:
            self.running.remove(req)
            self.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- PENDING -----------------------------------------------------------------------------
    def set_pending(self, req: Req) -> None:
        if req.status is not ReqStatus.RUNNING:
            raise ValueError(f"only a RUNNING request can go PENDING, {req.rid} is {req.status.value}")
        self._pending(req)

    def end_look_ahead(self, req: Req) -> None:
        """req's look-ahead is over (its row ran, or will not): PENDING now, as any request at a peer."""
        req.look_ahead = False
        self._pending(req)

    @staticmethod
    def _pending(req: Req) -> None:
        req.status = ReqStatus.PENDING
        req.pending_since = time.monotonic()

    def resume(self, req: Req) -> None:
        if req.status is not ReqStatus.PENDING:
            raise ValueError(f"only a PENDING request can resume, {req.rid} is {req.status.value}")
        req.status = ReqStatus.RUNNING

    def truncate(self, req: Req, loc: int) -> None:
        """Cut req's tokens to `loc` and roll its KV back to at most loc (a peer rewrote from loc on).
        Pages past the new end are freed; a cut into the cached prefix re-locks the shorter match."""
        if loc < 0 or loc > len(req.tokens):
            raise ValueError(f"request {req.rid}: cut at {loc} outside its {len(req.tokens)} tokens")
        del req.tokens[loc:]
        if req.kv_len <= loc:
            return
        p = self.cfg.page_size
        if loc < req.cached_len:
            assert req.cache_node is not None
            self.pool.free(req.private_pages(p))
            self.cache.unlock(req.cache_node)
            match = self.cache.match_prefix(req.tokens[:loc])
            self.cache.lock(match.node)
            req.pages, req.cache_node = list(match.pages), match.node
            req.cached_len = req.kv_len = match.length
            return
        req.kv_len = loc
        keep = math.ceil(loc / p)
        self.pool.free(req.pages[keep:])
        del req.pages[keep:]

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's batch, allocating the pages it writes; None when nothing launches."""
        running = ReqStatus.RUNNING
        runs = [r for r in self.running if r.status is running]
        ahead = [r for r in runs if r.look_ahead]
        if ahead:
            runs = [r for r in runs if not r.look_ahead]
        if not self.launch.should_launch(len(runs) + len(self.waiting), self.num_active):
            return None
        budget = self.cfg.chunked_prefill_size
        p = self.cfg.page_size
        reqs: list[Req] = []
        lens: list[int] = []
        # Running requests first, decodes before unfinished prefills, oldest first. A request whose
        # pages already cover its extend (most decodes) skips _grow: this loop runs every step.
        prefills = [r for r in runs if len(r.tokens) - r.kv_len > 1]
        order = [r for r in runs if len(r.tokens) - r.kv_len <= 1] + prefills if prefills else runs
        for req in order:
            if req.status is not running or budget == 0:
                continue  # preempted by an earlier request of this loop, or out of budget
            n = _chunk(req, len(req.tokens) - req.kv_len, budget, self.cfg.chunked_prefill_size)
            if n == 0:
                continue
            if -(-(req.kv_len + n) // p) > len(req.pages) and not self._grow(req, req.kv_len + n, protect=reqs):
                continue
            reqs.append(req)
            lens.append(n)
            budget = max(0, budget - n)  # a run of drafts may go over it (_chunk)
        # Then admit from the queue, first come first served, while pages and budget allow.
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            # PENDING requests count too: they come back and grow, and a request admitted into
            # their room would only be preempted again.
            n = self._admit(self.waiting[0], budget, headroom=len(self.running))
            if n == 0:
                break
            req = self.waiting.popleft()
            self.running.append(req)
            reqs.append(req)
            lens.append(n)
            budget = max(0, budget - n)  # a run of drafts may go over it (_chunk)
        # Look-ahead rows last, on a step that launched for other work, with what is left: the
        # budget and free pages only (no eviction, no preemption), and none that a running request
        # may need to run through its tokens and the one it samples next: a page taken here would
        # otherwise push one out at the next step. Without a page one gives up.
        if ahead and reqs:
            spare = self.pool.num_free + self.cache.evictable_pages - sum(
                max(0, self._pages_for(r, len(r.tokens) + 1)) for r in self.running
                if r.status is running and not r.look_ahead)
            for req in ahead:
                if budget == 0:
                    break
                need = max(0, self._pages_for(req, len(req.tokens)))
                pages = self.pool.alloc(need) if need <= spare else None
                if pages is None:
                    self.end_look_ahead(req)
                    continue
                spare -= need
                req.pages.extend(pages)
                reqs.append(req)
                lens.append(1)
                budget -= 1
        return ScheduledBatch(reqs, lens) if reqs else None

    def _grow(self, req: Req, num_tokens: int, protect: list[Req]) -> bool:
        """Give req pages up to num_tokens, preempting newer requests (never those in `protect`)
        when the pool runs dry. False if req itself had to be preempted."""
        need = self._pages_for(req, num_tokens)
        while True:
            pages = self._alloc(need) if need > 0 else []
            if pages is not None:
                req.pages.extend(pages)
                return True
            victims = [r for r in self.running
                       if r.status is ReqStatus.RUNNING and not r.look_ahead and r not in protect]
            victim = victims[-1]  # req itself is a candidate, so this is never empty
            self._preempt(victim)
            if victim is req:
                if not self.running:
                    raise RuntimeError(
                        f"KV pool too small: request {req.rid} alone needs {num_tokens} tokens, the pool "
                        f"holds {self.pool.capacity_tokens}")
                return False

    def _admit(self, req: Req, budget: int, headroom: int) -> int:
        """Admit req with a prefix-cache match and pages for its first chunk; return the chunk length
        (0: not admitted). `headroom` pages stay free for running requests to grow into."""
        p = self.cfg.page_size
        # At least the last token must run: it produces the logits to sample from. A request that
        # still wants prompt logprobs takes no cache hit: every prompt position must run through the model.
        # Drafts to verify: the token before them runs too (Req.drafts).
        match = self.cache.match_prefix([] if req.wants_prompt_logprobs else req.tokens[:-1 - req.drafts])
        n = _chunk(req, len(req.tokens) - match.length, budget, self.cfg.chunked_prefill_size)
        if n == 0:
            return 0
        need = math.ceil((match.length + n) / p) - len(match.pages)
        if need + headroom > self._available_pages() - self._evictable_in(match):
            if self.running:
                return 0
            if need > self._available_pages() - self._evictable_in(match):
                raise RuntimeError(
                    f"KV pool too small: {need} free pages needed for a {n}-token chunk, pool has "
                    f"{self.pool.num_pages} pages of {p} tokens"
                )
        self.cache.lock(match.node)
        pages = self._alloc(need)
        assert pages is not None
        req.pages = match.pages + pages
        req.cached_len = req.kv_len = match.length
        req.cache_node = match.node
        req.prefix_hit_tokens = match.length
        req.status = ReqStatus.RUNNING
        return n

    def _evictable_in(self, match: MatchResult) -> int:
        """Pages of the match that are now evictable but will be locked by admitting it."""
        node, n = match.node, 0
        while node is not self.cache.root and node.lock_ref == 0:
            n += len(node.pages)
            assert node.parent is not None
            node = node.parent
        return n

    def commit(self, batch: ScheduledBatch) -> None:
        """Record that the batch's extends now have KV."""
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
            req.extended_tokens += n

    # ---- checks ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + cached + private == total pages, with no page owned twice."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        p = self.cfg.page_size
        private: list[int] = []
        for req in self.running:
            if len(req.pages) * p < req.kv_len:
                raise AssertionError(f"request {req.rid}: kv_len {req.kv_len} beyond its pages")
            if req.cached_len % p or req.cached_len > req.kv_len:
                raise AssertionError(f"request {req.rid}: bad cached_len {req.cached_len}")
            if req.cache_node is not None and req.cache_node is not self.cache.root and req.cache_node.lock_ref <= 0:
                raise AssertionError(f"request {req.rid}: its prefix is not locked")
            private.extend(req.private_pages(p))
        for req in self.waiting:
            if req.pages or req.cache_node is not None:
                raise AssertionError(f"waiting request {req.rid} holds pages")
        if len(set(private)) != len(private):
            raise AssertionError("a page is private to two requests")
        cached = set(self.cache.all_pages())
        free = self.pool.free_pages
        if set(private) & (cached | free):
            raise AssertionError("a private page is also cached or free")
        total = len(free) + len(cached) + len(private)
        if total != self.pool.num_pages:
            raise AssertionError(
                f"page leak: free {len(free)} + cached {len(cached)} + private {len(private)} "
                f"!= total {self.pool.num_pages}"
            )


def _chunk(req: Req, remaining: int, budget: int, whole: int) -> int:
    """How many of req's `remaining` tokens run this step: all that the budget takes, but a chunk
    that stops short leaves the drafts and the token before them whole for the last chunk (0: wait).
    Those rows cannot split: where they are more than a step's `whole` budget they run together over
    it (by at most a run of drafts), else no step would ever run them."""
    if remaining <= budget:
        return remaining
    if not req.drafts:
        return budget
    head = remaining - req.drafts - 1
    if head > 0:
        return min(budget, head)
    return remaining if remaining > whole else 0

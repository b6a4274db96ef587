"""The paged KV cache: one K and one V tensor per model, cut into pages, and their allocator."""

from __future__ import annotations

import os

import torch


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available host memory (CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVPool:
    """K/V storage of shape [layers, num_pages * page_size, kv_heads, head_dim] and a page allocator.

    A token at position `i` of a request lives in slot `pages[i // page_size] * page_size +
    i % page_size`. The pool only knows which pages are free; ownership of the others (a request's
    private pages or the prefix cache's) is tracked by their owners, and `Scheduler.check_integrity`
    checks that the three sets add up to the whole pool.

    One more page past the last, never handed out, is scratch: the padding rows of a compiled decode
    step (batches padded to a fixed size) write their K/V there, so they touch no request's pages.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.scratch_slot = num_pages * page_size  # first slot of the scratch page
        shape = (num_layers, (num_pages + 1) * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Pop from the end: low page ids are handed out first, which keeps runs deterministic.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def alloc(self, n: int) -> list[int] | None:
        """Take n pages, or None (and take nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("KV pool: a page is on the free list twice")
        if free and (min(free) < 0 or max(free) >= self.num_pages):
            raise AssertionError("KV pool: a free page id is out of range")

    @property
    def free_pages(self) -> set[int]:
        return set(self._free)

"""The attention backend seam: every kernel implementation sits behind this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.kv_pool import KVPool


class KernelPlan(NamedTuple):
    """A planned step whose every row attends through the paged kernel (paged_decode_kernel.py): the
    kernel's per-row arguments, and the slot each row's K/V goes to."""

    reqs: torch.Tensor  # [T] int64: the row's request (its row of the page table)
    rows: torch.Tensor  # [T] int64: the row in the flat batch
    lens: torch.Tensor  # [T] int64: keys it attends (its position + 1)
    page_table: torch.Tensor  # int64, contiguous
    out_slots: torch.Tensor  # [T] int64


class AttentionBackend(ABC):
    """Paged attention over a flat batch of extends.

    Contract: `plan(batch)` is called once per forward before any layer runs, and may precompute
    index tensors shared by all layers. `forward(layer, q, k, v)` first writes this step's k and v
    into the pool at `batch.out_slots`, then returns, for every row t of request i, attention of
    q[t] over request i's tokens 0 .. prefix_lens[i] + (t's offset in the extend), i.e. the cached
    prefix plus a causal mask within the extend. Shapes: q [T, H, D], k and v [T, Hkv, D],
    output [T, H, D]; H is a multiple of Hkv (grouped-query attention).
    """

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def kernel_plan(self) -> KernelPlan | None:
        """After `plan`: where every row of the step attends through the paged CPU kernel, its
        arguments, so a caller may run the layers' attention (K/V writes included) in C itself
        (models/layer_loop.py); None otherwise."""
        return None

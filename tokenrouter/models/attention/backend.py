"""The attention backend seam: every kernel implementation sits behind this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.kv_pool import KVPool


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

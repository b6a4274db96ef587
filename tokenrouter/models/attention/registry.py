"""The attention backends by name: the kernel seam's one factory."""

from __future__ import annotations

from tokenrouter.models.attention.backend import AttentionBackend
from tokenrouter.models.attention.reference_backend import ReferenceAttentionBackend
from tokenrouter.models.attention.torch_backend import TorchAttentionBackend
from tokenrouter.models.kv_pool import KVPool

BACKENDS = ("torch", "torch-reference")


def make_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    """`torch`: the default, tuned for CPU (torch_backend.py: PyTorch, and on CPU the paged C kernel
    of paged_decode.c for decodes and short extends). `torch-reference`: the original simple SDPA
    version that the tests compare against (reference_backend.py)."""
    if name == "torch":
        return TorchAttentionBackend(pool, num_heads, num_kv_heads, head_dim)
    if name == "torch-reference":
        return ReferenceAttentionBackend(pool, num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")

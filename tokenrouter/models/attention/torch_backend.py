"""Paged attention tuned for the CPU, pure PyTorch but for one native kernel; runs on CUDA as well.

On CPU with a float32 pool, every request that extends by at most `KERNEL_MAX_EXTEND` tokens
(decodes, short catch-ups), or by up to `KERNEL_WIDE_EXTEND` over few keys, goes to the paged kernel
(paged_decode_kernel.py): one call per layer, each query row reading its request's pages in place.
Everything else, and everything when the kernel is off or cannot be built, takes the pure PyTorch
paths below. The kernel is single-threaded; it is kept at any torch thread count, where the
gather-and-bmm path measured slower at decode sizes (a step's attention is a small share of its
products there).

Requests are split into up to three groups, each attended in padded calls:

- decodes (extend 1): on CPU without scaled_dot_product_attention. The query is viewed as
  [B * Hkv, G, D] (G query heads share a KV head), and K and V are gathered straight into
  [B * Hkv, S, D] by `index_select` over the pool viewed as [slots * Hkv, D] (index
  `slot * Hkv + kv_head`), so no permute copy follows. Then baddbmm (scores plus an additive mask
  built once per step in `plan`), softmax and bmm. The work goes in chunks of about
  `CPU_DECODE_CHUNK_BYTES` of gathered K, so each chunk's K and V are still in cache when the
  matmuls read them. On other devices decodes get their own masked SDPA call (the last path below).
- extends with no cached prefix: SDPA with `is_causal=True` and no mask. Padding keys sit after
  every real query's position, so causality alone hides them, and the CPU flash kernel skips the
  blocks above the diagonal.
- extends over a cached prefix: SDPA with a boolean mask.

Gathers use `index_select` on flat indices (a row copy), not advanced indexing on a 2-D index,
which on CPU goes through the generic element-wise index kernel and is several times slower.
`ReferenceAttentionBackend` (reference_backend.py) is the original simple version; this one must
match it (tests/test_attention_backend.py).
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tokenrouter.models.attention.backend import AttentionBackend, KernelPlan
from tokenrouter.models.attention.paged_decode_kernel import PagedDecodeKernel, load_kernel
from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.kv_pool import KVPool

# Gathered K per decode chunk on CPU (V adds as much again). Measured on a 2-core EPYC, one thread,
# batch 64, 4 KV heads x 64: chunks of 1-2 MiB were fastest at contexts 165 and 1000; one chunk of
# the whole batch was 1.4x (context 165) to 4x (context 1000) slower, the K/V copies falling out of cache.
CPU_DECODE_CHUNK_BYTES = 3 << 19  # 1.5 MiB
# Requests extending by at most this many tokens go to the paged kernel. Measured on SmolLM2's
# shapes, 8 requests over 150 cached tokens (30 layers): the kernel 1.9x the gather path at 1 and 2
# new tokens, 1.3-1.6x at 4, 1.0-1.1x at 8, 0.6-0.7x at 16-32, where SDPA's matrix products win.
# A step whose every row is on the kernel runs all its layers in one C call where the model has the
# loop (models/layer_loop.py; a routed pair's five-token catch-up: 27.5 -> 11.1 ms on SmolLM2).
KERNEL_MAX_EXTEND = 8
# Longer extends, up to KERNEL_WIDE_EXTEND tokens, go to the kernel too while they attend at most
# KERNEL_MAX_PAIRS query-key pairs (extend x keys): the kernel's work grows with both, and what it saves
# is the eager path's per-layer calls. A routed pair's catch-up after a long run of the small model's
# tokens is such an extend at one request. SmolLM2 on its GGUF blocks, one request, whole step, two
# threads (2-core Xeon, 2026-12-07, the two paths alternated in one process): 9 / 12 / 16 new tokens
# over 64 keys 1.97x / 1.68x / 1.37x the eager path, over 256 keys 1.57x / 1.38x / 1.21x, over 512
# 1.38x / 1.21x / 0.97x; 24 new tokens 1.04x over 64 keys, 0.88x over 256. Without the loop (the float
# weights) the kernel's attention at 9-16 tokens matched SDPA over 64 keys (0.99-1.04x) and lost at
# 16 over 416 keys (0.93x).
KERNEL_WIDE_EXTEND = 16
KERNEL_MAX_PAIRS = 4096
# SDPA's backends off the CPU: all but cuDNN's, which builds a graph on the CPU for every new shape,
# and key lengths change every step. Measured on an H200 (torch 2.11, SmolLM2's shapes, an eager
# decode step at batch 1): 9.0 ms of CPU per call against 4 us on the GPU, 88 % of the step
# (docs/BENCHMARKS.md, "The engine and the pair on an H200").
GPU_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_scope(device: torch.device) -> AbstractContextManager[None]:
    """The backends SDPA may pick for a call on `device`: `GPU_SDPA_BACKENDS` off the CPU, any on it."""
    return nullcontext() if device.type == "cpu" else sdpa_kernel(list(GPU_SDPA_BACKENDS))


def _kernel_takes(extend: int, prefix: int) -> bool:
    """Whether the paged kernel attends a request's `extend` new tokens over `prefix` cached ones."""
    return extend <= KERNEL_MAX_EXTEND or (
        extend <= KERNEL_WIDE_EXTEND and extend * (prefix + extend) <= KERNEL_MAX_PAIRS)


class _KernelRows(NamedTuple):
    """The query rows the paged kernel attends: one entry per row."""

    reqs: torch.Tensor  # [N] the row's request in the batch (its row of the page table)
    rows: torch.Tensor  # [N] the row in the flat batch
    lens: torch.Tensor  # [N] keys it attends (its position + 1)
    page_table: torch.Tensor  # the batch's page table, contiguous
    whole: bool  # the rows are the whole batch


class _Decode(NamedTuple):
    """All decode requests: one query row each."""

    rows: torch.Tensor | None  # [B] flat-batch row of each request (None: the batch is rows 0..B-1, all decodes)
    seq: int  # S, the longest context (keys are padded to it)
    # (first, end) row range of [B * Hkv] rows, K/V index into the pool's [slots * Hkv, D] view
    # ((end - first) * S entries, padding points at slot 0), additive mask [end - first, 1, S].
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]]


class _Extend(NamedTuple):
    """Requests attended in one padded SDPA call."""

    batch: int  # requests in the call
    ext: int  # E, the longest extend (query rows are padded to it)
    seq: int  # S, the longest context
    rows: torch.Tensor | None  # [batch * E] flat-batch row of each query; padding repeats a valid row (None: identity)
    kv_slots: torch.Tensor  # [batch * S] KV slot of each key; padding points at slot 0
    mask: torch.Tensor | None  # [batch, 1, E, S] True where the query may attend the key; None: is_causal
    src: torch.Tensor | None  # indices into the flattened [batch * E] output that are real rows (None: all)
    dest: torch.Tensor | None  # flat-batch rows those outputs go to (None: the output is the whole batch)


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 bmm_decode: bool | None = None, decode_chunk_bytes: int | None = None,
                 kernel: bool | None = None) -> None:
        """`bmm_decode`: decodes by gather + bmm (default: on CPU) instead of SDPA.
        `decode_chunk_bytes`: gathered K per decode chunk (default: `CPU_DECODE_CHUNK_BYTES` on CPU,
        no chunking elsewhere). `kernel`: short extends on the paged kernel (default: on CPU with a
        float32 pool, when the kernel builds); True where it cannot run is an error."""
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        on_cpu = pool.k.device.type == "cpu"
        fits = on_cpu and pool.k.dtype == torch.float32
        self.kernel: PagedDecodeKernel | None = None
        if kernel or (kernel is None and fits):
            if not fits:
                raise ValueError(f"the paged kernel runs on a float32 CPU pool, not {pool.k.dtype} on {pool.k.device}")
            self.kernel = load_kernel()
            if kernel and self.kernel is None:
                raise RuntimeError("the paged kernel could not be built (see the log)")
        self.bmm_decode = on_cpu if bmm_decode is None else bmm_decode
        if decode_chunk_bytes is None:
            decode_chunk_bytes = CPU_DECODE_CHUNK_BYTES if on_cpu else 1 << 62
        self.decode_chunk_bytes = decode_chunk_bytes
        # Reduced-precision pools are attended in float32, as SDPA's kernels accumulate.
        dt = pool.k.dtype
        self.compute_dtype = dt if dt in (torch.float32, torch.float64) else torch.float32

    def plan(self, batch: ForwardBatch) -> None:
        self._out_slots = batch.out_slots
        self._decode: _Decode | None = None
        self._extends: list[_Extend] = []
        self._kernel_rows: _KernelRows | None = None
        ext_l, pre_l = batch.extend_lens_list, batch.prefix_lens_list
        on_kernel = [self.kernel is not None and _kernel_takes(e, k) for e, k in zip(ext_l, pre_l)]
        short = [i for i, taken in enumerate(on_kernel) if taken]
        if short:
            self._kernel_rows = self._plan_kernel(batch, short)
        rest = [i for i, taken in enumerate(on_kernel) if not taken]
        dec = [i for i in rest if ext_l[i] == 1]
        fresh = [i for i in rest if ext_l[i] != 1 and pre_l[i] == 0]
        cont = [i for i in rest if ext_l[i] != 1 and pre_l[i] > 0]
        ext = batch.extend_lens
        starts = torch.cumsum(ext, 0) - ext
        if dec and self.bmm_decode:
            self._decode = self._plan_decode(batch, dec, starts)
        elif dec:
            self._extends.append(self._plan_extend(batch, dec, starts, causal=False))
        if fresh:
            self._extends.append(self._plan_extend(batch, fresh, starts, causal=True))
        if cont:
            self._extends.append(self._plan_extend(batch, cont, starts, causal=False))

    @staticmethod
    def _plan_kernel(batch: ForwardBatch, sel: list[int]) -> _KernelRows:
        ext_l, pre_l = batch.extend_lens_list, batch.prefix_lens_list
        starts = list(itertools.accumulate(ext_l, initial=0))
        reqs = [i for i in sel for _ in range(ext_l[i])]
        rows = [starts[i] + j for i in sel for j in range(ext_l[i])]
        lens = [pre_l[i] + j + 1 for i in sel for j in range(ext_l[i])]
        table = batch.page_table.contiguous()
        assert table.dtype == torch.int64, "the kernel reads an int64 page table"
        return _KernelRows(torch.tensor(reqs), torch.tensor(rows), torch.tensor(lens), table,
                           len(rows) == batch.num_tokens)

    def _plan_decode(self, batch: ForwardBatch, sel: list[int], starts: torch.Tensor) -> _Decode:
        dev = batch.extend_lens.device
        hkv, d, p = self.num_kv_heads, self.head_dim, batch.page_size
        all_rows = len(sel) == batch.batch_size  # every request decodes: rows 0..B-1 in order
        idx = torch.tensor(sel, dtype=torch.long, device=dev)
        total = batch.prefix_lens[idx] + 1
        s = max(batch.prefix_lens_list[i] for i in sel) + 1
        kpos = torch.arange(s, device=dev)
        pages = batch.page_table[idx].gather(1, (kpos // p).expand(len(sel), -1))
        slots = pages * p + kpos % p  # [B, S]
        heads = torch.arange(hkv, device=dev)
        index = (slots[:, None, :] * hkv + heads[:, None]).reshape(len(sel) * hkv, s)
        mask = torch.zeros(len(sel), s, dtype=self.compute_dtype, device=dev)
        mask.masked_fill_(kpos >= total[:, None], float("-inf"))  # key 0 is always visible: no all -inf row
        mask = mask[:, None, :].expand(-1, hkv, -1).reshape(len(sel) * hkv, 1, s)
        elem = torch.empty((), dtype=self.compute_dtype).element_size()
        step = max(1, self.decode_chunk_bytes // (s * d * elem))
        n = len(sel) * hkv
        chunks = [(a, min(a + step, n), index[a:a + step].reshape(-1), mask[a:a + step]) for a in range(0, n, step)]
        return _Decode(None if all_rows else starts[idx], s, chunks)

    def _plan_extend(self, batch: ForwardBatch, sel: list[int], starts: torch.Tensor, causal: bool) -> _Extend:
        dev = batch.extend_lens.device
        idx = torch.tensor(sel, dtype=torch.long, device=dev)
        ext = batch.extend_lens[idx]
        pre = batch.prefix_lens[idx]
        e_list = [batch.extend_lens_list[i] for i in sel]
        e_max = max(e_list)
        s_max = max(batch.extend_lens_list[i] + batch.prefix_lens_list[i] for i in sel)
        p = batch.page_size
        kpos = torch.arange(s_max, device=dev)[None, :]
        pages = batch.page_table[idx].gather(1, (kpos // p).expand(len(sel), -1))
        kv_slots = (pages * p + kpos % p).reshape(-1)
        if len(sel) == batch.batch_size and min(e_list) == e_max:
            # The whole batch, no padding: the query rows are the batch's rows in order.
            mask = None if causal else self._mask(pre, ext, e_max, s_max)
            return _Extend(len(sel), e_max, s_max, None, kv_slots, mask, None, None)
        offs = torch.arange(e_max, device=dev)[None, :]
        valid = offs < ext[:, None]
        rows = torch.where(valid, starts[idx][:, None] + offs, starts[idx][:, None])
        flat_valid = valid.reshape(-1)
        if min(e_list) == e_max:
            src, dest = None, rows.reshape(-1)
        else:
            src = flat_valid.nonzero().squeeze(1)
            dest = rows.reshape(-1)[src]
        mask = None if causal else self._mask(pre, ext, e_max, s_max)
        return _Extend(len(sel), e_max, s_max, rows.reshape(-1), kv_slots, mask, src, dest)

    @staticmethod
    def _mask(pre: torch.Tensor, ext: torch.Tensor, e_max: int, s_max: int) -> torch.Tensor:
        dev = pre.device
        offs = torch.arange(e_max, device=dev)[None, :]
        kpos = torch.arange(s_max, device=dev)[None, :]
        qpos = pre[:, None] + offs
        total = pre + ext
        mask = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] < total[:, None, None])
        # A padded query row still sees key 0, so no row is all -inf (which would give NaN).
        mask[:, :, 0] = True
        return mask.unsqueeze(1)

    def kernel_plan(self) -> KernelPlan | None:
        kr = self._kernel_rows
        if kr is None or not kr.whole or self.pool.k.dtype != torch.float32 or self._out_slots.dtype != torch.int64:
            return None
        return KernelPlan(kr.reqs, kr.rows, kr.lens, kr.page_table, self._out_slots.contiguous())

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        slots = self._out_slots
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)
        if self._decode is not None and self._decode.rows is None:
            return self._forward_decode(self._decode, q, kc, vc, None)
        kr = self._kernel_rows
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the kernel writes it
        if kr is not None:
            assert self.kernel is not None
            self.kernel(q.contiguous(), kc, vc, kr.page_table, kr.reqs, kr.rows, kr.lens, self.pool.page_size,
                        self.scale, out)
            if kr.whole:
                return out
        if self._decode is not None:
            self._forward_decode(self._decode, q, kc, vc, out)
        for g in self._extends:
            self._forward_extend(g, q, kc, vc, out)
        return out

    def _forward_decode(self, g: _Decode, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                        out: torch.Tensor | None) -> torch.Tensor:
        h, hkv, d, s = self.num_heads, self.num_kv_heads, self.head_dim, g.seq
        cdt = self.compute_dtype
        qd = q if g.rows is None else q.index_select(0, g.rows)
        qd = qd.reshape(-1, h // hkv, d).to(cdt)  # [B * Hkv, G, D]: query head j uses KV head j // G
        od = torch.empty_like(qd)
        kf, vf = kc.view(-1, d), vc.view(-1, d)  # [slots * Hkv, D]
        for a, b, index, mask in g.chunks:
            keys = kf.index_select(0, index).view(b - a, s, d).to(cdt)
            scores = torch.baddbmm(mask, qd[a:b], keys.transpose(1, 2), alpha=self.scale)
            probs = torch.softmax(scores, dim=-1)
            values = vf.index_select(0, index).view(b - a, s, d).to(cdt)
            torch.bmm(probs, values, out=od[a:b])
        od = od.view(-1, h, d).to(q.dtype)
        if out is None:
            return od
        out.index_copy_(0, g.rows, od)
        return out

    def _forward_extend(self, g: _Extend, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                        out: torch.Tensor) -> None:
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qe = q if g.rows is None else q.index_select(0, g.rows)
        keys = kc.index_select(0, g.kv_slots).view(g.batch, g.seq, hkv, d)
        values = vc.index_select(0, g.kv_slots).view(g.batch, g.seq, hkv, d)
        with sdpa_scope(q.device):
            o = F.scaled_dot_product_attention(
                qe.reshape(g.batch, g.ext, h, d).transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=g.mask,
                is_causal=g.mask is None,
                scale=self.scale,
                enable_gqa=h != hkv,
            )
        o = o.transpose(1, 2).reshape(-1, h, d)
        if g.dest is None:
            out.copy_(o)
        else:
            out.index_copy_(0, g.dest, o if g.src is None else o[g.src])

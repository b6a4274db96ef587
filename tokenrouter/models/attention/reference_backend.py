"""The reference paged attention: gather each request's pages with advanced indexing, then one
masked scaled_dot_product_attention per group.

This is the original, simplest implementation, kept (as backend "torch-reference") to anchor the
tests: `TorchAttentionBackend` and any faster kernel must match it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenrouter.models.attention.backend import AttentionBackend
from tokenrouter.models.forward_batch import ForwardBatch


class _Group(NamedTuple):
    """Requests attended in one padded SDPA call."""

    rows: torch.Tensor  # [G, E] flat-batch row of each (request, extend offset); padding repeats a valid row
    kv_slots: torch.Tensor  # [G, S] KV slot of each (request, key position); padding points at slot 0
    mask: torch.Tensor  # [G, 1, E, S] True where the query may attend the key
    src: torch.Tensor | None  # indices into the flattened [G * E] output that are real rows (None: all)
    dest: torch.Tensor  # flat-batch rows those outputs go to


class ReferenceAttentionBackend(AttentionBackend):
    """Decodes (extend 1) and longer extends go in two padded calls, so one long prefill does not
    pad every decode to its length."""

    def plan(self, batch: ForwardBatch) -> None:
        ext = batch.extend_lens
        starts = torch.cumsum(ext, 0) - ext
        is_decode = torch.tensor([e == 1 for e in batch.extend_lens_list], dtype=torch.bool)
        self._out_slots = batch.out_slots
        self._groups: list[_Group] = []
        for sel in (is_decode, ~is_decode):
            idx = sel.nonzero().squeeze(1).to(ext.device)
            if idx.numel():
                self._groups.append(self._make_group(batch, idx, starts))

    def _make_group(self, batch: ForwardBatch, idx: torch.Tensor, starts: torch.Tensor) -> _Group:
        dev = batch.extend_lens.device
        ext = batch.extend_lens[idx]
        pre = batch.prefix_lens[idx]
        total = pre + ext
        host_idx = idx.tolist()
        e_max = max(batch.extend_lens_list[i] for i in host_idx)
        s_max = max(batch.extend_lens_list[i] + batch.prefix_lens_list[i] for i in host_idx)
        p = batch.page_size
        offs = torch.arange(e_max, device=dev)[None, :]
        valid = offs < ext[:, None]
        rows = torch.where(valid, starts[idx][:, None] + offs, starts[idx][:, None])
        kpos = torch.arange(s_max, device=dev)[None, :]
        pages = batch.page_table[idx].gather(1, (kpos // p).expand(len(host_idx), -1))
        kv_slots = pages * p + kpos % p
        qpos = pre[:, None] + offs
        mask = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] < total[:, None, None])
        # A padded query row still sees key 0, so no row is all -inf (which would give NaN).
        mask[:, :, 0] = True
        flat_valid = valid.reshape(-1)
        if bool(flat_valid.all()):
            src, dest = None, rows.reshape(-1)
        else:
            src = flat_valid.nonzero().squeeze(1)
            dest = rows.reshape(-1)[src]
        return _Group(rows, kv_slots, mask.unsqueeze(1), src, dest)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        slots = self._out_slots
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)
        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        for g in self._groups:
            o = F.scaled_dot_product_attention(
                q[g.rows].transpose(1, 2),
                kc[g.kv_slots].transpose(1, 2),
                vc[g.kv_slots].transpose(1, 2),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=gqa,
            )
            o = o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
            out.index_copy_(0, g.dest, o if g.src is None else o[g.src])
        return out

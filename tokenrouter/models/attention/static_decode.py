"""Decode attention in static shapes, for a compiled or graph-captured decode step.

Every row of the batch is one new token of a request at its position: a decode's, or one of a short
extend's rows, which share their request's pages. Each row's K/V is written before any row attends,
and a row sees its request's keys up to its own position, so an extend's later rows see its earlier
ones as causal attention would. The runner pads the batch to a bucket size and
fills `DecodeInputs` (padding rows write their K/V to the pool's scratch slot and attend only it);
`bind` hands them to the layers, whose `forward` is pure tensor code with no host-side planning, so
torch.compile traces it whole and a CUDA graph can replay it. The math is the torch backend's CPU
decode path (tokenrouter/models/attention/torch_backend.py) in one chunk: K and V gathered into
[B * Hkv, S, D] by `index_select`, then baddbmm with an additive mask, softmax and bmm.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenrouter.models.attention.backend import AttentionBackend
from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.kv_pool import KVPool


class DecodeInputs(NamedTuple):
    """The tensors of one padded decode step of B rows over keys padded to S."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    out_slots: torch.Tensor  # [B] int64: KV slot each row writes (the scratch slot for padding)
    kv_index: torch.Tensor  # [B * Hkv, S] int64: row of the pool's [slots * Hkv, D] view per key
    kv_mask: torch.Tensor  # [B * Hkv, 1, S]: 0 for a visible key, -inf past the request's length


def decode_inputs(pool: KVPool, num_kv_heads: int, tokens: list[int], kv_lens: list[int], pages: list[list[int]],
                  batch: int, seq: int, mask_dtype: torch.dtype) -> DecodeInputs:
    """Host-built inputs for rows feeding `tokens[i]` at position `kv_lens[i]` (a row per new token: an
    extend's rows repeat its request's pages), padded to `batch` rows and `seq` >= max(kv_lens) + 1
    keys. `pages[i]` must cover position kv_lens[i]."""
    p, hkv, n = pool.page_size, num_kv_heads, len(tokens)
    scratch_page = pool.scratch_slot // p
    width = -(-seq // p)
    table = torch.full((batch, width), scratch_page, dtype=torch.int64)
    for i, pg in enumerate(pages):
        m = min(len(pg), width)
        table[i, :m] = torch.tensor(pg[:m], dtype=torch.int64)
    lens = torch.zeros(batch, dtype=torch.int64)  # padding rows: position 0 of the scratch page
    lens[:n] = torch.tensor(kv_lens, dtype=torch.int64)
    kpos = torch.arange(seq)
    slots = table.gather(1, (kpos // p).expand(batch, -1)) * p + kpos % p  # [B, S]
    heads = torch.arange(hkv)
    index = (slots[:, None, :] * hkv + heads[:, None]).reshape(batch * hkv, seq)
    mask = torch.zeros(batch, seq, dtype=mask_dtype)
    mask.masked_fill_(kpos >= lens[:, None] + 1, float("-inf"))  # key 0 always visible: no all -inf row
    mask = mask[:, None, :].expand(-1, hkv, -1).reshape(batch * hkv, 1, seq)
    ids = torch.zeros(batch, dtype=torch.int64)
    ids[:n] = torch.tensor(tokens, dtype=torch.int64)
    out_slots = slots.gather(1, lens[:, None]).squeeze(1)
    return DecodeInputs(ids, lens, out_slots, index, mask)


class StaticDecodeAttention(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        dt = pool.k.dtype  # reduced-precision pools are attended in float32, as the torch backend does
        self.compute_dtype = dt if dt in (torch.float32, torch.float64) else torch.float32

    def plan(self, batch: ForwardBatch) -> None:
        raise TypeError("StaticDecodeAttention takes padded DecodeInputs through bind(), not a ForwardBatch")

    def bind(self, inputs: DecodeInputs) -> None:
        self.inputs = inputs

    def enter_layer(self, layer: int) -> None:
        """Select the layer's KV by a tensor offset into the whole pool, set before the layer runs:
        a compiled layer then reads no layer number, so one graph serves every layer."""
        if not hasattr(self, "_offsets"):
            layers, slots, dev = self.pool.k.shape[0], self.pool.k.shape[1], self.pool.k.device
            self._offsets = [torch.tensor(i * slots * self.num_kv_heads, device=dev) for i in range(layers)]
        self.layer_offset = self._offsets[layer]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        inp, cdt, off = self.inputs, self.compute_dtype, self.layer_offset
        kf, vf = self.pool.k.view(-1, d), self.pool.v.view(-1, d)  # [layers * slots * Hkv, D]
        dest = (inp.out_slots[:, None] * hkv + torch.arange(hkv, device=q.device) + off).reshape(-1)
        kf.index_copy_(0, dest, k.reshape(-1, d))
        vf.index_copy_(0, dest, v.reshape(-1, d))
        rows, seq = inp.kv_index.shape
        index = inp.kv_index.reshape(-1) + off
        qd = q.reshape(rows, h // hkv, d).to(cdt)  # query head j uses KV head j // G
        keys = kf.index_select(0, index).view(rows, seq, d).to(cdt)
        values = vf.index_select(0, index).view(rows, seq, d).to(cdt)
        scores = torch.baddbmm(inp.kv_mask, qd, keys.transpose(1, 2), alpha=self.scale)
        out = torch.bmm(torch.softmax(scores, dim=-1), values)
        return out.view(-1, h, d).to(q.dtype)

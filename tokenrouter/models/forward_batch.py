"""The tensors of one forward step over a flat batch of extends."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A flat batch: request i feeds `extend_lens[i]` new tokens after `prefix_lens[i]` cached ones.

    Token rows are laid out request after request. `out_slots[t]` is the KV slot that row t writes;
    `page_table[i]` lists request i's pages (padded with 0 past its end). `sample_rows` are the rows
    whose logits are wanted (the last row of each extend that reaches the end of its tokens).
    The `*_list` fields are host copies, for planning without device syncs.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [B, max_pages] int64
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    sample_rows: torch.Tensor  # [S] int64
    prefix_lens_list: list[int]
    extend_lens_list: list[int]
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

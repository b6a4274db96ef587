"""The step messages rank 0 broadcasts to the other tensor-parallel ranks.

Each step is two broadcasts: a header of six int64s (op, tokens T, requests B, page-table width W,
sampled rows S, page size), then one int64 payload holding the ForwardBatch tensors back to back:
input_ids [T], positions [T], out_slots [T], page_table [B * W], prefix_lens [B], extend_lens [B],
sample_rows [S]. A header with op STOP ends the worker's loop. Both go over the CPU (gloo) backend
whatever the device, so an idle worker waits on gloo only; on CUDA the payload is copied over.
"""

from __future__ import annotations

import datetime

import torch

from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.tp_group import FOREVER, TPGroup

OP_STOP, OP_STEP = 0, 1
HEADER_LEN = 6


def broadcast_batch(group: TPGroup, batch: ForwardBatch) -> None:
    """Rank 0: send this step's batch to the other ranks."""
    b, w = batch.page_table.shape
    header = torch.tensor([OP_STEP, batch.num_tokens, b, w, int(batch.sample_rows.shape[0]), batch.page_size],
                          dtype=torch.int64)
    group.broadcast(header)
    payload = torch.cat([batch.input_ids, batch.positions, batch.out_slots, batch.page_table.reshape(-1),
                         batch.prefix_lens, batch.extend_lens, batch.sample_rows]).cpu()
    group.broadcast(payload)


def broadcast_stop(group: TPGroup, timeout: datetime.timedelta | None = None) -> None:
    """Rank 0: tell the other ranks to leave their loop."""
    group.broadcast(torch.tensor([OP_STOP, 0, 0, 0, 0, 0], dtype=torch.int64), timeout)


def receive_batch(group: TPGroup, device: torch.device) -> ForwardBatch | None:
    """Ranks > 0: wait (as long as rank 0 is idle) for the next batch; None on STOP."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    group.broadcast(header, timeout=FOREVER)
    op, t, b, w, s, page_size = header.tolist()
    if op == OP_STOP:
        return None
    payload = torch.empty(3 * t + b * w + 2 * b + s, dtype=torch.int64)
    group.broadcast(payload)
    lens = 3 * t + b * w
    prefix_list, ext_list = payload[lens:lens + b].tolist(), payload[lens + b:lens + 2 * b].tolist()
    ids, pos, slots, table, prefix, ext, rows = payload.to(device).split([t, t, t, b * w, b, b, s])
    return ForwardBatch(
        input_ids=ids, positions=pos, out_slots=slots, page_table=table.view(b, w), prefix_lens=prefix,
        extend_lens=ext, sample_rows=rows, prefix_lens_list=prefix_list, extend_lens_list=ext_list,
        page_size=page_size,
    )

"""`TPGroup`: one engine's tensor-parallel ranks and the three collectives the model needs.

Each engine owns its own process group, built directly on a c10d backend (gloo on CPU, NCCL on CUDA)
over a TCPStore that rank 0 hosts on 127.0.0.1 with a port the OS picks. Nothing touches
torch.distributed's global default group, so a process may hold several engines (TP or not) at once.
A group of size 1 (`TPGroup.single()`) is what an ordinary engine uses: every collective is a no-op.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

if TYPE_CHECKING:
    from tokenrouter.models.config import ModelConfig

# A worker waits for rank 0's next step for as long as rank 0 is idle.
FOREVER = datetime.timedelta(days=3650)


def check_tp_divisible(cfg: ModelConfig, tp_size: int, model: str = "the model") -> None:
    """Raise ValueError unless every dimension tensor parallelism splits divides by tp_size."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    bad = [f"{what} {n}" for what, n in (("num_attention_heads", cfg.num_heads),
                                         ("num_key_value_heads", cfg.num_kv_heads),
                                         ("intermediate_size", cfg.intermediate_size)) if n % tp_size]
    if bad:
        raise ValueError(
            f"tp_size {tp_size} does not divide {', '.join(bad)} of {model}: tensor parallelism gives each "
            f"rank an equal share of the attention heads, KV heads and MLP columns "
            f"(this model allows tp_size in {divisors(cfg)})")


def divisors(cfg: ModelConfig) -> list[int]:
    return [d for d in range(1, cfg.num_kv_heads + 1)
            if cfg.num_heads % d == 0 and cfg.num_kv_heads % d == 0 and cfg.intermediate_size % d == 0]


class TPGroup:
    """Rank `rank` of `size` tensor-parallel ranks on `device`.

    Two backends: `backend` for the model's collectives on `device` (NCCL on CUDA, gloo on CPU) and
    `cpu_backend` (gloo; the same object on CPU) for the control messages (step batches, start-up
    checks), so a worker idle for hours waits on gloo, not under NCCL's watchdog. Each collective
    picks the backend by its tensor's device. Both are None when size == 1.
    """

    def __init__(self, rank: int, size: int, backend: Any = None, device: torch.device | None = None,
                 cpu_backend: Any = None) -> None:
        self.rank, self.size, self.backend = rank, size, backend
        self.cpu_backend = cpu_backend if cpu_backend is not None else backend
        self.device = device or torch.device("cpu")

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1, None)

    @classmethod
    def create(cls, store: dist.Store, rank: int, size: int, device: torch.device,
               timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> TPGroup:
        """Join the group (blocks until every rank has joined)."""
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        opts._threads = 2  # measured: one gloo thread makes each small all_reduce ~10x slower
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("tokenrouter-tp-gloo", store), rank, size, opts)
        if device.type != "cuda":
            return cls(rank, size, gloo, device)
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("tokenrouter-tp-nccl", store), rank, size, nccl_opts)
        return cls(rank, size, nccl, device, cpu_backend=gloo)

    def _for(self, tensor: torch.Tensor) -> Any:
        return self.cpu_backend if tensor.device.type == "cpu" else self.backend

    def broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> torch.Tensor:
        """In place, from rank 0."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            if timeout is not None:
                opts.timeout = timeout
            self._for(tensor).broadcast([tensor], opts).wait()
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            self._for(tensor).allreduce([tensor], opts).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor (same shape everywhere), concatenated along dim in rank order."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._for(tensor).allgather([outs], [tensor], AllgatherOptions()).wait()
        return torch.cat(outs, dim=dim)

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly (n divisible by size)."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

"""Rank 0's handle on its tensor-parallel workers, and the worker process (ranks 1..tp_size-1).

Start-up, with rank 0 the engine's own process:

1. rank 0 hosts a TCPStore on 127.0.0.1 (port picked by the OS) and spawns tp_size - 1 worker
   processes (torch.multiprocessing, spawn; daemonic, and killed by the kernel if rank 0 dies);
2. every rank joins the process group (gloo on CPU, NCCL on CUDA: worker r uses rank 0's GPU index + r);
3. every rank loads its shard of the weights, then all report success or failure (a failing rank
   leaves its message in the store, and rank 0 raises with it);
4. rank 0 sizes the KV pool and broadcasts the page count; every rank allocates a pool of the same
   pages holding only its own KV heads, and all report again.

Then each worker loops: receive a batch (tokenrouter/engine/tp_step.py) -> forward -> the LM head's
all-gather when the step samples; rank 0 schedules and samples. `shutdown` broadcasts STOP and joins
the workers (killing any that do not leave in time).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from tokenrouter.engine.lifetime import die_with_parent
from tokenrouter.engine.tp_step import broadcast_stop, receive_batch
from tokenrouter.models.tp_group import TPGroup

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = datetime.timedelta(seconds=300)  # to spawn the workers and join the group
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)  # any one collective (loading weights included)
STOP_GRACE_S = 10.0


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed to start, load its shard or allocate its KV pool."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the same CPU, or the GPU r places after rank 0's."""
    if device.type != "cuda":
        return device
    base = device.index if device.index is not None else torch.cuda.current_device()
    if base + rank >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank {rank} needs cuda:{base + rank}, but only "
                         f"{torch.cuda.device_count()} GPU(s) are visible")
    return torch.device("cuda", base + rank)


def _sync_flags(group: TPGroup, failed: bool) -> list[int]:
    """Every rank says whether its last stage failed; the ranks that did."""
    flags = torch.zeros(group.size, dtype=torch.int64)  # on CPU: the control backend
    flags[group.rank] = int(failed)
    group.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


class TensorParallel:
    """Rank 0's side: the process group, the worker processes, start-up checks and shutdown."""

    def __init__(self, engine_cfg: Any, device: torch.device) -> None:
        size = engine_cfg.tp_size
        self.size = size
        self.procs: list[Any] = []
        self.serving = False
        self._stopped = False
        devices = [rank_device(device, r) for r in range(size)]
        self.store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=STARTUP_TIMEOUT, wait_for_workers=False)
        ctx = torch.multiprocessing.get_context("spawn")
        try:
            cfg = dataclasses.asdict(engine_cfg)
            for r in range(1, size):
                proc = ctx.Process(target=worker_main, name=f"tokenrouter-tp{r}", daemon=True,
                                   args=(cfg, r, size, self.store.port, str(devices[r]), os.getpid()))
                proc.start()
                self.procs.append(proc)
            self._wait_joined(time.monotonic() + STARTUP_TIMEOUT.total_seconds())
            self.group = TPGroup.create(self.store, 0, size, device, COLLECTIVE_TIMEOUT)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead_workers(self, wait: float = 0.0) -> str | None:
        """Which workers have exited (for the error when a step's collectives fail), or None. A peer's
        reset connection can reach rank 0 before its exit is visible here, so this keeps looking for
        up to `wait` seconds."""
        deadline = time.monotonic() + wait
        while True:
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, start=1)
                    if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return ", ".join(dead) or None
            time.sleep(0.02)

    def _wait_joined(self, deadline: float) -> None:
        keys = [f"joined/{r}" for r in range(1, self.size)]
        while not self.store.check(keys):
            for r, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    raise TPWorkerError(f"tensor-parallel worker rank {r} exited with code {proc.exitcode} "
                                        "before joining the group")
            if time.monotonic() > deadline:
                raise TPWorkerError("tensor-parallel workers did not join within "
                                    f"{STARTUP_TIMEOUT.total_seconds():.0f} s")
            time.sleep(0.02)

    def sync(self, stage: str, error: BaseException | None = None) -> None:
        """All ranks report on `stage`; on any failure stop the workers and raise (rank 0's own error
        as it is, a worker's as TPWorkerError with its message)."""
        failed = _sync_flags(self.group, error is not None)
        if not failed:
            return
        # Every rank saw the failure and leaves; wait for the workers, then raise.
        self.kill(grace=STOP_GRACE_S)
        if error is not None:
            raise error
        msgs = []
        for r in failed:
            key = f"error/{r}"
            msg = self.store.get(key).decode() if self.store.check([key]) else "no message"
            msgs.append(f"rank {r}: {msg}")
        raise TPWorkerError(f"tensor-parallel worker failed while {stage}: {'; '.join(msgs)}")

    def broadcast_int(self, value: int) -> None:
        self.group.broadcast(torch.tensor([value], dtype=torch.int64))

    def shutdown(self) -> None:
        """Send STOP and join the workers (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self.serving and all(p.is_alive() for p in self.procs):
            try:
                broadcast_stop(self.group, datetime.timedelta(seconds=STOP_GRACE_S))
            except Exception as e:  # a worker already gone: the joins below settle it
                logger.warning("tensor-parallel STOP broadcast failed: %s", e)
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self, grace: float = 0.0) -> None:
        """Wait up to `grace` seconds for the workers to leave, then terminate (and kill) the rest."""
        self._stopped = True
        deadline = time.monotonic() + grace
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.pid is not None and proc.is_alive():
                proc.terminate()
                proc.join(2.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2.0)
        self.group = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


# ---- the worker process ------------------------------------------------------------------------

def _worker_sync(group: TPGroup, store: Any, error: BaseException | None) -> bool:
    if error is not None:
        store.set(f"error/{group.rank}", f"{type(error).__name__}: {error}")
    return not _sync_flags(group, error is not None)


def worker_main(cfg: dict[str, Any], rank: int, size: int, port: int, device_name: str, parent_pid: int) -> None:
    """Process entry point of tensor-parallel rank `rank` (spawned by rank 0's engine)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when we stop
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.getppid() != parent_pid:
        return  # rank 0 died while we started
    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.model_loader import load_model
    from tokenrouter.models.attention.registry import make_backend
    from tokenrouter.models.kv_pool import KVPool

    ecfg = EngineConfig(**cfg)
    torch.set_num_threads(ecfg.num_threads or 1)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=STARTUP_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    group = TPGroup.create(store, rank, size, device, COLLECTIVE_TIMEOUT)
    model = backend = None
    error: BaseException | None = None
    try:
        model = load_model(ecfg.model_path, ecfg.torch_dtype(device), device, group)
    except Exception as e:
        error = e
    if not _worker_sync(group, store, error):
        sys.exit(1 if error is not None else 0)
    pages = torch.zeros(1, dtype=torch.int64)
    num_pages = int(group.broadcast(pages).item())
    try:
        assert model is not None
        mc = model.config
        pool = KVPool(num_pages, ecfg.page_size, mc.num_layers, mc.num_kv_heads // size, mc.head_dim,
                      ecfg.torch_dtype(device), device)
        backend = make_backend(ecfg.attention_backend, pool, mc.num_heads // size, mc.num_kv_heads // size,
                               mc.head_dim)
    except Exception as e:
        error = e
    if not _worker_sync(group, store, error):
        sys.exit(1 if error is not None else 0)
    assert model is not None and backend is not None
    try:
        serve(group, model, backend, device)
    except Exception as e:  # rank 0 gone, or a collective failed: nothing left to serve
        print(f"tokenrouter tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


@torch.inference_mode()
def serve(group: TPGroup, model: Any, backend: Any, device: torch.device) -> None:
    """The worker loop: receive a batch, run the model, join the collectives; until STOP."""
    while True:
        batch = receive_batch(group, device)
        if batch is None:
            return
        backend.plan(batch)
        hidden = model(batch, backend)
        if batch.sample_rows.shape[0]:
            model.compute_logits(hidden[batch.sample_rows])  # the LM head's all-gather

"""The process a subserver runs in: threads and cores as its spec asks, the Subserver served until
Shutdown, and a failure to start or serve reported to the entry before the process exits. The entry
spawns `subserver_main`; a joiner (runtime/subserver/joiner.py) and a Ray actor (runtime/subserver/ray_actor.py)
call `configure_process` and `serve_subserver` themselves."""

from __future__ import annotations

import os
import signal
import traceback
from typing import Any

import zmq

from tokenrouter.engine.lifetime import die_with_parent
from tokenrouter.runtime.group_config import GroupConfig, ModelSpec
from tokenrouter.runtime.messages import ReqError, encode
from tokenrouter.runtime.subserver.subserver import Subserver
from tokenrouter.runtime.transport_security import secure_client


def configure_process(model: ModelSpec) -> None:
    """Threads and cores as the spec asks (oversubscribed cores make torch 5-13x slower)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model.cores:
        os.sched_setaffinity(0, model.cores)
    import torch

    if model.engine.num_threads is not None:
        torch.set_num_threads(model.engine.num_threads)


def serve_subserver(model: ModelSpec, cfg: GroupConfig, bind_address: str, entry_address: str,
                    parent_pid: int | None = None, advertise_host: str | None = None,
                    watch_entry: bool = False, board: str | None = None) -> None:
    """Load and serve until Shutdown; a failure is reported to the entry (which turns it into a clear
    error) and raised again."""
    server = None
    try:
        server = Subserver(model, cfg, bind_address, entry_address, parent_pid, advertise_host, watch_entry,
                           board)
        server.run()
    except BaseException as e:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        secure_client(sock, cfg.curve_keys())
        sock.connect(entry_address)
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
        sock.send(encode(ReqError(model.name, None, msg)))
        sock.close()
        raise
    finally:
        if server is not None:
            server.close()


def subserver_main(name: str, group: dict[str, Any], bind_address: str, entry_address: str, parent_pid: int,
                   board: str | None = None) -> None:
    """Process entry point (spawned by the entry): serve model `name` of the group (its config as
    GroupConfig.to_dict gives it); configure threads and cores, then serve."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the entry decides when we stop
    cfg = GroupConfig.from_dict(group)
    model = cfg.spec(name)
    configure_process(model)
    try:
        serve_subserver(model, cfg, bind_address, entry_address, parent_pid, board=board)
    except BaseException as e:
        raise SystemExit(1) from e

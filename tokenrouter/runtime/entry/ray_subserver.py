"""Subservers as Ray actors on an existing Ray cluster (`start: ray`; `pip install tokenrouter[ray]`): the
entry's side.

Each actor asks Ray for the resources its model needs (a GPU per tensor-parallel rank on CUDA, a CPU
per core or thread otherwise), binds its inbox on its node's IP and then runs like any subserver
(SubserverActor, runtime/subserver/ray_actor.py): it reports Ready to the entry, which sends Topology
as usual. The entry's process is the actors' owner, so Ray ends them when it exits, however it exits
(no orphans).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from tokenrouter.runtime.group_config import ModelSpec, RayConfig
from tokenrouter.runtime.subserver.ray_actor import SubserverActor

logger = logging.getLogger(__name__)


def resources(spec: ModelSpec) -> dict[str, float]:
    """What the actor reserves: on CUDA one GPU per rank; CPUs for its cores, else its threads per rank."""
    eng = spec.engine
    gpus = eng.tp_size if eng.device.startswith("cuda") else 0
    cpus = len(spec.cores) if spec.cores else (eng.num_threads or 1) * eng.tp_size
    return {"num_cpus": float(cpus), "num_gpus": float(gpus)}


def connect(settings: RayConfig) -> Any:
    """Import Ray and join the cluster of the group's `ray` section, once per process."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("start: ray needs Ray in the entry's environment: pip install 'tokenrouter[ray]'") from e
    if not ray.is_initialized():
        ray.init(address=settings.address, namespace=settings.namespace, log_to_driver=True)
    return ray


class RaySubserver:
    """The entry's handle on one actor: its `run` call ending means the subserver has gone."""

    def __init__(self, spec: ModelSpec, group: dict[str, Any], entry_address: str, settings: RayConfig) -> None:
        self.ray = connect(settings)
        self.name = spec.name
        opts = resources(spec)
        actor_cls = self.ray.remote(SubserverActor)
        self.actor = actor_cls.options(name=f"tokenrouter-{spec.name}-{uuid.uuid4().hex[:8]}", max_restarts=0,
                                       **opts).remote()
        self.done = self.actor.run.remote(spec.name, group, entry_address)
        logger.info("model %r: Ray actor asked for %g CPU and %g GPU", spec.name, opts["num_cpus"], opts["num_gpus"])

    def failure(self) -> str | None:
        finished, _ = self.ray.wait([self.done], timeout=0)
        if not finished:
            return None
        try:
            self.ray.get(self.done)
        except Exception as e:  # the actor's error, as Ray relays it
            return f"Ray actor of subserver {self.name!r} failed: {e}"
        return f"Ray actor of subserver {self.name!r} stopped"

    def wait(self, timeout: float) -> bool:
        finished, _ = self.ray.wait([self.done], timeout=timeout)
        return bool(finished)

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        """Nothing held here beyond the handle; Ray reclaims the actor's resources when it ends."""

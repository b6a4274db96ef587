"""A subserver as a Ray actor (`start: ray`): the class Ray runs in the actor's own worker process.

The entry asks Ray for the actor (RaySubserver, on the entry's side: its resources, and the entry's
handle on it); here the actor binds its inbox on its node's IP and then runs like any subserver: it
reports Ready to the entry, which sends Topology as usual.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenrouter.runtime.group_config import GroupConfig


class SubserverActor:
    """Runs in the actor's own worker process; `run` serves until Shutdown (or its entry disappears)."""

    def run(self, name: str, group: dict[str, Any], entry_address: str) -> None:
        """Serve model `name` of the group (its config as GroupConfig.to_dict gives it)."""
        import ray

        from tokenrouter.runtime.subserver.process import configure_process, serve_subserver

        cfg = GroupConfig.from_dict(group)
        model = cfg.spec(name)
        if model.engine.device.startswith("cuda"):
            # Ray shows the actor only the GPUs it reserved, as cuda:0..tp_size-1.
            model = dataclasses.replace(model, engine=dataclasses.replace(model.engine, device="cuda:0"))
        configure_process(model)
        ip = ray.util.get_node_ip_address()
        serve_subserver(model, cfg, f"tcp://{ip}:{model.port or '*'}", entry_address, watch_entry=True)

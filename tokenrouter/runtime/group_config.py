"""A routed group: the models (with placement) and the algorithm that routes between them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.engine.launch_policy import Thresholds, check_deadlock_free
from tokenrouter.routing import absolute_spec, algorithm_class
from tokenrouter.runtime.transport_security import CurveKeys, keys_from_secret

LAUNCHERS = ("spawn", "join", "ray")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ModelSpec:
    """One model of the group and where its subserver runs."""

    name: str
    path: str
    dtype: str = "auto"
    device: str = "cpu"
    threads: int = 1  # torch threads in the subserver
    cores: list[int] | None = None  # pin the subserver to these CPU cores
    page_size: int = 16
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    kv_cache_tokens: int | None = None
    mem_fraction: float | None = None
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    attention_backend: str = "torch"
    host: str = "127.0.0.1"  # interface the subserver listens on with the tcp transport
    port: int = 0  # its inbox port with the tcp transport (0: any free port), for firewalls
    # Who starts the subserver: "spawn" (a child of the entry), "join" (started by hand on its host with
    # `tokenrouter subserver --join`), or "ray" (a Ray actor on the cluster of the group's `ray` section).
    launcher: str = "spawn"
    # Co-location: this model's fraction of its device's KV memory; models without one split the rest so
    # that they hold equal tokens (admission reserves the same tokens on every model a request visits).
    kv_share: float | None = None
    # Tensor parallelism: the subserver is rank 0 and spawns tp_size - 1 worker processes (each with
    # `threads` torch threads; on CUDA rank r uses the GPU r places after `device`).
    tp_size: int = 1

    def engine_config(self, seed: int) -> EngineConfig:
        return EngineConfig(
            model_path=self.path, dtype=self.dtype, device=self.device, page_size=self.page_size,
            max_running_requests=self.max_running_requests, chunked_prefill_size=self.chunked_prefill_size,
            kv_cache_tokens=self.kv_cache_tokens, mem_fraction=self.mem_fraction,
            max_model_len=self.max_model_len, enable_prefix_cache=self.enable_prefix_cache,
            attention_backend=self.attention_backend, seed=seed, num_threads=self.threads, tp_size=self.tp_size,
        )


@dataclass
class GroupConfig:
    models: list[ModelSpec]
    # The routing algorithm: a registered name (built-in, or an installed package's entry point in the
    # group tokenrouter.algorithms), "package.module:Class", or "path/to/file.py:Class" (a relative
    # path is made absolute against the working directory, so every process imports the same file).
    algorithm: str = "single"
    algorithm_params: dict[str, Any] = field(default_factory=dict)
    name: str = "tokenrouter"  # the model name the server answers to
    seed: int = 0
    transport: str = "ipc"  # "ipc" (one machine) or "tcp"
    # tcp only: every process derives CURVE keys from this secret (or $TOKENROUTER_SECRET); required
    # with tcp on every interface, loopback included (any local user could reach a loopback port).
    secret: str | None = None
    # Delayed batching: {"policy": "eager"} or {"policy": "threshold", "thresholds": {model: B or {n: B}}}
    launch: dict[str, Any] = field(default_factory=lambda: {"policy": "eager"})
    # {"mode": "model"} runs the models; {"mode": "latency", "profile": path or dict} is the
    # latency-model executor (model folders then give only config and tokenizer, no weights).
    executor: dict[str, Any] = field(default_factory=lambda: {"mode": "model"})
    startup_timeout: float = 300.0  # seconds to wait for every subserver to load its model
    # Where the entry's inbox listens with the tcp transport; joiners and Ray actors connect here, so
    # with either give an address they can reach (and a fixed port for `--join`).
    entry_host: str = "127.0.0.1"
    entry_port: int = 0
    join_timeout: float = 600.0  # seconds to wait for every "join" model to join
    ray: dict[str, Any] = field(default_factory=dict)  # {"address": "auto" | "HOST:PORT", "namespace": ...}
    # Share of each device's memory (host memory on CPU) that the models placed on it may use for
    # weights and KV together; the entry splits it between their KV pools (placement.py). None: each
    # engine sizes its own pool, except that co-located CUDA models are planned with 0.9.
    memory_fraction: float | None = None
    # Router folders by kind ({citer: PATH, r2r: PATH, co_llm: PATH}): `--algorithm KIND` on the
    # command line serves KIND with the folder named here (and its calibrated threshold).
    routers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a group needs at least one model")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.secret is None:
            self.secret = os.environ.get("TOKENROUTER_SECRET") or None
        if self.transport == "tcp" and not self.secret:
            hosts = ", ".join(dict.fromkeys([self.entry_host, *(m.host for m in self.models)]))
            raise ValueError(f"transport: tcp needs a shared secret (secret: in the config, or $TOKENROUTER_SECRET; "
                             f"at least 16 characters), even on loopback: any process that can reach {hosts} could "
                             "otherwise send the group's processes messages")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be distinct, got {names}")
        for m in self.models:
            if not m.name or not m.name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"model name {m.name!r} must be letters, digits, '-' or '_'")
            if isinstance(m.tp_size, bool) or not isinstance(m.tp_size, int) or m.tp_size < 1:
                raise ValueError(f"model {m.name!r}: tp_size must be an integer >= 1, got {m.tp_size!r}")
            self._check_placement(m)
        self._check_algorithm()
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction < 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1), got {self.memory_fraction}")
        if not 0 <= self.entry_port <= 65535:
            raise ValueError(f"entry_port must be in [0, 65535], got {self.entry_port}")
        self.launch_thresholds()  # validates the launch settings
        mode = self.executor.get("mode", "model")
        if mode not in ("model", "latency"):
            raise ValueError(f"executor mode must be 'model' or 'latency', got {mode!r}")
        if mode == "latency":
            missing = sorted(set(self.names) - set(self.latency_profile().models))
            if missing:
                raise ValueError(f"the latency profile has no step latency for model(s) {', '.join(missing)}")

    def _check_algorithm(self) -> None:
        """Import the algorithm's class here, so a bad spec fails before any subserver starts (its
        parameters are checked when the entry builds it, also before)."""
        self.algorithm = absolute_spec(self.algorithm)
        algorithm_class(self.algorithm)
        for kind in self.routers:
            try:
                needs = algorithm_class(kind).needs_router
            except ValueError as e:
                raise ValueError(f"routers: unknown router kind {kind!r} ({e})") from None
            if not needs:
                raise ValueError(f"routers: algorithm {kind!r} reads no router folder")

    def _check_placement(self, m: ModelSpec) -> None:
        if m.launcher not in LAUNCHERS:
            raise ValueError(f"model {m.name!r}: launcher must be one of {', '.join(LAUNCHERS)}, got {m.launcher!r}")
        if m.launcher != "spawn":
            if self.transport != "tcp":
                raise ValueError(f"model {m.name!r}: launcher {m.launcher!r} runs it in another process tree "
                                 "(often another host), which only the tcp transport reaches: set transport: tcp")
            if self.executor.get("mode") == "latency":
                raise ValueError(f"model {m.name!r}: the latency executor's interference flags live in this "
                                 "machine's shared memory; use launcher: spawn with it")
        if not 0 <= m.port <= 65535:
            raise ValueError(f"model {m.name!r}: port must be in [0, 65535], got {m.port}")
        if m.kv_share is not None and not 0.0 < m.kv_share <= 1.0:
            raise ValueError(f"model {m.name!r}: kv_share must be in (0, 1], got {m.kv_share}")
        if self.memory_fraction is not None and m.mem_fraction is not None:
            raise ValueError(f"model {m.name!r}: mem_fraction sizes one pool from what is free when it starts; "
                             "with the group's memory_fraction the entry splits the device, use kv_share")

    def planner_profile(self) -> LatencyProfile | None:
        """The step latencies the planner uses: the launch section's profile, or the latency
        executor's, or None (then each subserver measures its own at start-up)."""
        prof = self.launch.get("profile")
        if prof is not None:
            return LatencyProfile.from_dict(prof) if isinstance(prof, dict) else LatencyProfile.load(prof)
        if self.executor.get("mode") == "latency":
            return self.latency_profile()
        return None

    def latency_profile(self) -> LatencyProfile:
        prof = self.executor.get("profile")
        if prof is None:
            raise ValueError("the latency executor needs a profile (a path or an inline dict)")
        return LatencyProfile.from_dict(prof) if isinstance(prof, dict) else LatencyProfile.load(prof)

    def launch_thresholds(self) -> dict[str, Thresholds]:
        """Per-model launch thresholds (models not named launch eagerly); checked deadlock free."""
        policy = self.launch.get("policy", "eager")
        if policy == "eager":
            return {}
        if policy == "planner":
            if len(self.models) != 2:
                raise ValueError("the planner launch policy plans for two models (small first, large second)")
            alpha = float(self.launch.get("alpha", 0.0))
            if not 0.0 <= alpha <= 1.0:
                raise ValueError(f"planner alpha (interference) must be in [0, 1], got {alpha}")
            return {}  # the entry sends the large model its thresholds once it knows the latencies
        if policy != "threshold":
            raise ValueError(f"launch policy must be 'eager', 'threshold' or 'planner', got {policy!r}")
        raw = self.launch.get("thresholds") or {}
        unknown = sorted(set(raw) - set(self.names))
        if unknown:
            raise ValueError(f"launch thresholds name unknown model(s): {', '.join(unknown)}")
        table = {m: Thresholds(v) for m, v in raw.items()}
        largest = max((max(t.as_dict()) for t in table.values()), default=1)
        check_deadlock_free(table, largest + 64)
        return table

    def curve_keys(self) -> CurveKeys | None:
        return keys_from_secret(self.secret) if self.transport == "tcp" and self.secret else None

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def spec(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: str | Path | None = None) -> GroupConfig:
        """`base`: the folder a relative `path/to/file.py:Class` algorithm is found from (the YAML
        file's, for from_yaml); the working directory by default."""
        known = {f.name for f in dataclasses.fields(ModelSpec)}
        models = []
        for i, m in enumerate(d.get("models") or []):
            unknown = sorted(set(m) - known)
            if unknown:
                raise ValueError(f"models[{i}]: unknown field(s) {', '.join(unknown)}")
            models.append(ModelSpec(**m))
        algo = d.get("algorithm", "single")
        params: dict[str, Any] = dict(d.get("algorithm_params") or {})
        if isinstance(algo, dict):  # YAML style: algorithm: {name: bernoulli, p: 0.1}
            params.update({k: v for k, v in algo.items() if k != "name"})
            algo = algo.get("name", "single")
        if isinstance(algo, str):
            algo = absolute_spec(algo, base)
        rest = {k: v for k, v in d.items() if k not in ("models", "algorithm", "algorithm_params")}
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(rest) - allowed)
        if unknown:
            raise ValueError(f"unknown group config field(s): {', '.join(unknown)}")
        return cls(models=models, algorithm=algo, algorithm_params=params, **rest)

    @classmethod
    def from_yaml(cls, path: str | Path) -> GroupConfig:
        import yaml

        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {}, base=Path(path).parent)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

"""A routed group: the models (with placement) and the algorithm that routes between them.

One config system: GroupConfig.from_dict reads the YAML shape once, checks every field and names the
YAML field in its errors (`models[1].kv_share`, `launch.alpha`); from then on every section is a typed,
frozen dataclass. to_dict gives the same shape back, which is how the entry hands the group to
subservers in other processes and on other hosts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.engine.launch_policy import Thresholds, check_deadlock_free
from tokenrouter.routing import absolute_spec, algorithm_class
from tokenrouter.runtime.adapt_config import AdaptConfig
from tokenrouter.runtime.transport_security import CurveKeys, keys_from_secret

logger = logging.getLogger(__name__)

STARTS = ("spawn", "join", "ray")  # who starts a model's subserver process
LAUNCH_POLICIES = ("eager", "threshold", "planner")
EXECUTOR_MODES = ("model", "latency")
LOOPBACK = ("127.0.0.1", "localhost", "::1")

# A model's YAML entry is flat: ModelSpec's own fields next to its engine's (EngineConfig). Two engine
# fields have shorter names there; the seed comes from the group's.
_ENGINE_KEY = {"path": "model_path", "threads": "num_threads"}  # YAML key -> EngineConfig field
_YAML_KEY = {v: k for k, v in _ENGINE_KEY.items()}
_NOT_IN_YAML = {"seed", "load_tokenizer"}
# A group places every model explicitly, so an unplaced one runs on the CPU with one torch thread (a
# single EngineConfig leaves both to torch).
_MODEL_DEFAULTS = {"device": "cpu", "num_threads": 1}


def _engine_yaml_keys() -> set[str]:
    return {_YAML_KEY.get(f.name, f.name) for f in dataclasses.fields(EngineConfig)} - _NOT_IN_YAML


def _unknown(where: str, given: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}")


def _number(where: str, value: Any, kind: type = float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"{where} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _profile(where: str, value: Any) -> LatencyProfile | None:
    """A latency profile given as a path or inline."""
    if value is None or isinstance(value, LatencyProfile):
        return value
    try:
        return LatencyProfile.from_dict(value) if isinstance(value, dict) else LatencyProfile.load(value)
    except (ValueError, OSError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class LaunchConfig:
    """When each model's scheduler launches a step (engine/launch_policy.py). `eager`: as soon as it has
    work; `threshold`: once B(n) of its requests are ready, n the group's live requests; `planner`: the
    entry plans the large model's B(n) from step latencies and the routing probability it measures."""

    policy: str = "eager"
    thresholds: Mapping[str, Thresholds] = field(default_factory=dict)  # threshold: {model: B(n)}; others eager
    alpha: float = 0.0  # planner: interference between the two models' steps, in [0, 1]
    p: float = 0.1  # planner: the routing probability planned for until one is measured
    n_max: int | None = None  # planner: plan B(n) up to this n (default: min(64, small's max_running_requests))
    profile: LatencyProfile | None = None  # planner: step latencies (default: the latency executor's, else measured)
    # A model that hands a request back with its own token runs that token in its next step, for the
    # request's likely return (routing/algorithm.py looks_ahead; engine.py Engine.hand_off).
    look_ahead: bool = True
    # On CPU, a model spawned here (not pinned to cores, one rank) runs a step of few rows on every
    # core while no co-located model steps, alone on its host at any load, beside others while it
    # holds one live request (engine/step_board.py CoreShare; GroupConfig.core_sharing); false keeps
    # every model on its `threads`.
    share_cores: bool = True

    def __post_init__(self) -> None:
        for name in ("look_ahead", "share_cores"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"launch.{name} must be true or false, got {getattr(self, name)!r}")
        if self.policy not in LAUNCH_POLICIES:
            raise ValueError(f"launch.policy must be one of {', '.join(LAUNCH_POLICIES)}, got {self.policy!r}")
        if self.thresholds and self.policy != "threshold":
            raise ValueError(f"launch.thresholds apply with policy: threshold, not {self.policy!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"launch.alpha (interference) must be in [0, 1], got {self.alpha}")
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"launch.p must be in (0, 1], got {self.p}")
        if self.n_max is not None and self.n_max < 1:
            raise ValueError(f"launch.n_max must be >= 1, got {self.n_max}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LaunchConfig:
        """The fields the YAML section gives, parsed; the others keep the class's defaults."""
        _unknown("launch", d, {f.name for f in dataclasses.fields(cls)})

        def thresholds(tables: Mapping[str, Any] | None) -> dict[str, Thresholds]:
            out = {}
            for model, table in (tables or {}).items():
                try:
                    out[model] = Thresholds(table)
                except (ValueError, TypeError, AttributeError) as e:
                    raise ValueError(f"launch.thresholds.{model}: {e}") from None
            return out

        parse: dict[str, Callable[[Any], Any]] = {
            "thresholds": thresholds,
            "alpha": lambda v: _number("launch.alpha", v),
            "p": lambda v: _number("launch.p", v),
            "n_max": lambda v: None if v is None else _number("launch.n_max", v, int),
            "profile": lambda v: _profile("launch.profile", v),
        }
        return cls(**{k: parse.get(k, lambda v: v)(v) for k, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"policy": self.policy, "alpha": self.alpha, "p": self.p, "look_ahead": self.look_ahead,
                             "share_cores": self.share_cores}
        if self.thresholds:
            d["thresholds"] = {m: t.as_dict() for m, t in self.thresholds.items()}
        if self.n_max is not None:
            d["n_max"] = self.n_max
        if self.profile is not None:
            d["profile"] = self.profile.to_dict()
        return d


@dataclass(frozen=True)
class ExecutorConfig:
    """`model` runs the models; `latency` is the latency-model executor: each step waits the profile's
    latency (model folders then give only config and tokenizer, no weights)."""

    mode: str = "model"
    profile: LatencyProfile | None = None  # latency: a path or an inline dict in the YAML

    def __post_init__(self) -> None:
        if self.mode not in EXECUTOR_MODES:
            raise ValueError(f"executor.mode must be one of {', '.join(EXECUTOR_MODES)}, got {self.mode!r}")
        if self.mode == "latency" and self.profile is None:
            raise ValueError("executor.profile: the latency executor needs a profile (a path or an inline dict)")
        if self.mode != "latency" and self.profile is not None:
            raise ValueError(f"executor.profile applies with mode: latency, not {self.mode!r}")

    @property
    def latency(self) -> bool:
        return self.mode == "latency"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExecutorConfig:
        _unknown("executor", d, {f.name for f in dataclasses.fields(cls)})
        return cls(**{k: _profile("executor.profile", v) if k == "profile" else v for k, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode}
        if self.profile is not None:
            d["profile"] = self.profile.to_dict()
        return d


@dataclass(frozen=True)
class RayConfig:
    """The Ray cluster that `start: ray` models run on."""

    address: str = "auto"  # "auto" (the local node's cluster) or HOST:PORT
    namespace: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(f"ray.address must be 'auto' or HOST:PORT, got {self.address!r}")
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise ValueError(f"ray.namespace must be a string, got {self.namespace!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RayConfig:
        _unknown("ray", d, {f.name for f in dataclasses.fields(cls)})
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the group: its engine, and where and how its subserver runs."""

    name: str
    engine: EngineConfig
    cores: list[int] | None = None  # pin the subserver to these CPU cores
    host: str = "127.0.0.1"  # interface the subserver listens on with the tcp transport
    port: int = 0  # its inbox port with the tcp transport (0: any free port), for firewalls
    # Who starts the subserver: "spawn" (a child of the entry), "join" (started by hand on its host with
    # `tokenrouter subserver --join`), or "ray" (a Ray actor on the cluster of the group's `ray` section).
    start: str = "spawn"
    # Co-location: this model's fraction of its device's KV memory; models without one split the rest so
    # that they hold equal tokens (admission reserves the same tokens on every model a request visits).
    kv_share: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], seed: int, where: str) -> ModelSpec:
        """A model's flat YAML entry (`where` names it in errors, e.g. models[1])."""
        d = dict(d)
        if "launcher" in d:  # its old name; "launch" is the launch policy
            if "start" in d:
                raise ValueError(f"{where}: give start (launcher is its old name), not both")
            logger.warning("%s: `launcher` is deprecated, write `start: %s`", where, d["launcher"])
            d["start"] = d.pop("launcher")
        own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        _unknown(where, d, own | _engine_yaml_keys())
        if "name" not in d or "path" not in d:
            raise ValueError(f"{where}: a model needs a name and a path")
        engine = {**_MODEL_DEFAULTS, **{_ENGINE_KEY.get(k, k): v for k, v in d.items() if k not in own}}
        try:
            config = EngineConfig(**engine, seed=seed)
        except ValueError as e:  # EngineConfig's messages start with the field they are about
            first, _, rest = str(e).partition(" ")
            raise ValueError(f"{where}.{_YAML_KEY.get(first, first)} {rest}" if first in engine
                             else f"{where}: {e}") from None
        return cls(engine=config, **{k: v for k, v in d.items() if k in own})

    def to_dict(self) -> dict[str, Any]:
        engine = {_YAML_KEY.get(k, k): v for k, v in dataclasses.asdict(self.engine).items() if k not in _NOT_IN_YAML}
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"}
        return {"name": own.pop("name"), **engine, **own}


@dataclass(frozen=True)
class GroupConfig:
    models: list[ModelSpec]
    # The routing algorithm: a registered name (built-in, or an installed package's entry point in the
    # group tokenrouter.algorithms), "package.module:Class", or "path/to/file.py:Class" (from_dict makes
    # a relative path absolute, so every process imports the same file).
    algorithm: str = "single"
    algorithm_params: dict[str, Any] = field(default_factory=dict)
    name: str = "tokenrouter"  # the model name the server answers to
    seed: int = 0  # model i's engine seeds requests that bring none from seed + i
    transport: str = "ipc"  # "ipc" (one machine) or "tcp"
    # tcp only: every process derives CURVE keys from this secret (or $TOKENROUTER_SECRET); required
    # with tcp on every interface, loopback included (any local user could reach a loopback port).
    secret: str | None = None
    launch: LaunchConfig = field(default_factory=LaunchConfig)  # delayed batching
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    startup_timeout: float = 300.0  # seconds to wait for every subserver to load its model
    # Where the entry's inbox listens with the tcp transport; joiners and Ray actors connect here, so
    # with either give an address they can reach (and a fixed port for `--join`).
    entry_host: str = "127.0.0.1"
    entry_port: int = 0
    join_timeout: float = 600.0  # seconds to wait for every "join" model to join
    ray: RayConfig = field(default_factory=RayConfig)
    # Share of each device's memory (host memory on CPU) that the models placed on it may use for
    # weights and KV together; the entry splits it between their KV pools (entry/placement.py). None: each
    # engine sizes its own pool, except that co-located CUDA models are planned with 0.9.
    memory_fraction: float | None = None
    # Router folders by kind ({citer: PATH, r2r: PATH, co_llm: PATH}): `--algorithm KIND` on the
    # command line serves KIND with the folder named here (and its calibrated threshold).
    routers: dict[str, str] = field(default_factory=dict)
    # Load adaptation (runtime/adapt_config.py): hold a p99 TPOT target by moving the algorithm's share
    # knob toward a floor under load. None: every request runs at the served point.
    adapt: AdaptConfig | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models: a group needs at least one model")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.secret is None:
            object.__setattr__(self, "secret", os.environ.get("TOKENROUTER_SECRET") or None)
        if self.transport == "tcp" and not self.secret:
            hosts = ", ".join(dict.fromkeys([self.entry_host, *(m.host for m in self.models)]))
            raise ValueError(f"transport: tcp needs a shared secret (secret: in the config, or $TOKENROUTER_SECRET; "
                             f"at least 16 characters), even on loopback: any process that can reach {hosts} could "
                             "otherwise send the group's processes messages")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: model names must be distinct, got {names}")
        for i, m in enumerate(self.models):
            self._check_model(f"models[{i}]", m)
        self._check_algorithm()
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction < 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1), got {self.memory_fraction}")
        if not 0 <= self.entry_port <= 65535:
            raise ValueError(f"entry_port must be in [0, 65535], got {self.entry_port}")
        self._check_launch()
        if self.executor.latency:
            assert self.executor.profile is not None
            missing = sorted(set(self.names) - set(self.executor.profile.models))
            if missing:
                raise ValueError(f"executor.profile: the latency profile has no step latency for model(s) "
                                 f"{', '.join(missing)}")

    def _check_model(self, where: str, m: ModelSpec) -> None:
        if not m.name or not m.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{where}.name {m.name!r} must be letters, digits, '-' or '_'")
        if m.start not in STARTS:
            raise ValueError(f"{where}.start must be one of {', '.join(STARTS)}, got {m.start!r}")
        if m.start != "spawn":
            if self.transport != "tcp":
                raise ValueError(f"{where}.start: {m.start} runs model {m.name!r} in another process tree (often "
                                 "another host), which only the tcp transport reaches: set transport: tcp")
            if self.executor.latency:
                raise ValueError(f"{where}.start: the latency executor's interference flags live in this "
                                 "machine's shared memory; use start: spawn with it")
        if not 0 <= m.port <= 65535:
            raise ValueError(f"{where}.port must be in [0, 65535], got {m.port}")
        if m.kv_share is not None and not 0.0 < m.kv_share <= 1.0:
            raise ValueError(f"{where}.kv_share must be in (0, 1], got {m.kv_share}")
        if self.memory_fraction is not None and m.engine.mem_fraction is not None:
            raise ValueError(f"{where}.mem_fraction sizes one pool from what is free when it starts; with the "
                             "group's memory_fraction the entry splits the device, use kv_share")

    def _check_algorithm(self) -> None:
        """Import the algorithm's class here, so a bad spec fails before any subserver starts (its
        parameters are checked when the entry builds it, also before)."""
        algorithm_class(self.algorithm)
        for kind in self.routers:
            try:
                needs = algorithm_class(kind).needs_router
            except ValueError as e:
                raise ValueError(f"routers: unknown router kind {kind!r} ({e})") from None
            if not needs:
                raise ValueError(f"routers: algorithm {kind!r} reads no router folder")

    def _check_launch(self) -> None:
        if self.launch.policy == "planner" and len(self.models) != 2:
            raise ValueError("launch.policy: the planner plans for two models (small first, large second)")
        table = self.launch.thresholds
        unknown = sorted(set(table) - set(self.names))
        if unknown:
            raise ValueError(f"launch.thresholds name unknown model(s): {', '.join(unknown)}")
        if table:
            largest = max(max(t.as_dict()) for t in table.values())
            check_deadlock_free(dict(table), largest + 64)

    def planner_profile(self) -> LatencyProfile | None:
        """The step latencies the planner uses: the launch section's profile, or the latency
        executor's, or None (then each subserver measures its own at start-up)."""
        return self.launch.profile if self.launch.profile is not None else self.executor.profile

    def curve_keys(self) -> CurveKeys | None:
        return keys_from_secret(self.secret) if self.transport == "tcp" and self.secret else None

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def spec(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)

    def core_sharing(self, name: str) -> str | None:
        """How model `name` sizes its steps' threads (engine/step_board.py CoreShare): "alone" when it
        is the only model spawned here (every core for a small step at any load), "colocated" beside
        other spawned models (every core only while it holds one live request, when the models take
        turns), None when it keeps its `threads` (launch.share_cores off, pinned to cores, several
        ranks, a GPU, or started elsewhere)."""
        spec = self.spec(name)
        if not (self.launch.share_cores and spec.start == "spawn" and spec.cores is None
                and spec.engine.tp_size == 1 and spec.engine.torch_device().type == "cpu"):
            return None
        return "alone" if [m.start for m in self.models].count("spawn") == 1 else "colocated"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: str | Path | None = None) -> GroupConfig:
        """`base`: the folder a relative `path/to/file.py:Class` algorithm is found from (the YAML
        file's, for from_yaml); the working directory by default."""
        seed = _number("seed", d.get("seed", 0), int)
        models = [ModelSpec.from_dict(m, seed + i, f"models[{i}]") for i, m in enumerate(d.get("models") or [])]
        algo = d.get("algorithm", "single")
        params: dict[str, Any] = dict(d.get("algorithm_params") or {})
        if isinstance(algo, dict):  # YAML style: algorithm: {name: bernoulli, p: 0.1}
            params.update({k: v for k, v in algo.items() if k != "name"})
            algo = algo.get("name", "single")
        if isinstance(algo, str):
            algo = absolute_spec(algo, base)
        sections = {"launch": LaunchConfig, "executor": ExecutorConfig, "ray": RayConfig, "adapt": AdaptConfig}
        rest = {k: v for k, v in d.items() if k not in ("models", "algorithm", "algorithm_params", "seed")}
        _unknown("the group config", rest, {f.name for f in dataclasses.fields(cls)})
        for key, section in sections.items():
            if key in rest:
                if not isinstance(rest[key], Mapping):
                    raise ValueError(f"{key} must be a mapping of its fields, got {rest[key]!r}")
                rest[key] = section.from_dict(rest[key])
        return cls(models=models, algorithm=algo, algorithm_params=params, seed=seed, **rest)

    @classmethod
    def from_yaml(cls, path: str | Path) -> GroupConfig:
        import yaml

        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {}, base=Path(path).parent)

    def to_dict(self) -> dict[str, Any]:
        """The YAML shape (from_dict reads it back)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["models"] = [m.to_dict() for m in self.models]
        for key in ("launch", "executor", "ray"):
            d[key] = d[key].to_dict()
        if self.adapt is None:
            del d["adapt"]
        else:
            d["adapt"] = self.adapt.to_dict()
        return d

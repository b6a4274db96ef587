"""The group config is read once: every section typed, a bad field named by its YAML path, and the YAML
shape given back by to_dict (the entry sends it to subservers in other processes that way)."""

from __future__ import annotations

import logging

import pytest

from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.runtime.group_config import ExecutorConfig, GroupConfig, LaunchConfig, RayConfig

PROFILE = {"models": {"small": {"base": 0.01}, "large": {"base": 0.02}}}


def pair(**extra) -> dict:
    return {"models": [{"name": "small", "path": "/x"}, {"name": "large", "path": "/y"}], **extra}


def with_model(i: int, **fields) -> dict:
    d = pair()
    d["models"][i] = {**d["models"][i], **fields}
    return d


@pytest.mark.parametrize("config, message", [
    (with_model(1, kv_share=1.5), r"models\[1\]\.kv_share must be in \(0, 1\], got 1.5"),
    (with_model(0, tp_size=0), r"models\[0\]\.tp_size must be an integer >= 1, got 0"),
    (with_model(1, dtype="int3"), r"models\[1\]\.dtype must be auto or one of"),
    (with_model(0, start="fork"), r"models\[0\]\.start must be one of spawn, join, ray, got 'fork'"),
    (with_model(1, port=70000), r"models\[1\]\.port must be in \[0, 65535\]"),
    (with_model(1, name="a b"), r"models\[1\]\.name 'a b' must be letters"),
    (with_model(0, kv_cache_tokenz=8), r"models\[0\]: unknown field\(s\) kv_cache_tokenz"),
    (with_model(1, start="join"), r"models\[1\]\.start: join .* set transport: tcp"),
    (pair(launch={"policy": "sometimes"}), r"launch\.policy must be one of eager, threshold, planner"),
    (pair(launch={"policy": "planner", "alpha": 2}), r"launch\.alpha \(interference\) must be in \[0, 1\], got 2"),
    (pair(launch={"policy": "planner", "alpha": "high"}), r"launch\.alpha must be a number, got 'high'"),
    (pair(launch={"policy": "planner", "p": 0}), r"launch\.p must be in \(0, 1\]"),
    (pair(launch={"policy": "planner", "n_max": 0}), r"launch\.n_max must be >= 1"),
    (pair(launch={"policy": "planner", "alpah": 0.5}), r"launch: unknown field\(s\) alpah"),
    (pair(launch={"policy": "threshold", "thresholds": {"large": {0: 2}}}), r"launch\.thresholds\.large: thresholds"),
    (pair(launch={"policy": "eager", "thresholds": {"large": 2}}), r"launch\.thresholds apply with policy: threshold"),
    (pair(launch={"policy": "planner", "profile": "/no/such/profile.json"}), r"launch\.profile: .*No such file"),
    (pair(executor={"mode": "fast"}), r"executor\.mode must be one of model, latency, got 'fast'"),
    (pair(executor={"mode": "latency"}), r"executor\.profile: the latency executor needs a profile"),
    (pair(executor={"mode": "model", "profile": PROFILE}), r"executor\.profile applies with mode: latency"),
    (pair(executor={"mode": "latency", "profile": {"models": {"small": {"base": 0.01}}}}),
     r"executor\.profile: the latency profile has no step latency for model\(s\) large"),
    (pair(executor={"mode": "latency", "profil": "p.json"}), r"executor: unknown field\(s\) profil"),
    (pair(ray={"adress": "auto"}), r"ray: unknown field\(s\) adress; known: address, namespace"),
    (pair(ray={"address": 6379}), r"ray\.address must be 'auto' or HOST:PORT, got 6379"),
    (pair(ray="auto"), r"ray must be a mapping of its fields"),
    (pair(lauch={"policy": "eager"}), r"unknown field\(s\) lauch"),
    (pair(launch={"share_cores": "yes"}), r"launch\.share_cores must be true or false, got 'yes'"),
    (pair(models=[{"name": "small", "path": "/x", "quantization": "q4"}, {"name": "large", "path": "/y"}]),
     r"quantization must be one of auto, none, int8"),
])
def test_a_bad_field_is_named(config, message):
    with pytest.raises(ValueError, match=message):
        GroupConfig.from_dict(config)


def test_sections_are_typed_and_the_yaml_shape_round_trips():
    cfg = GroupConfig.from_dict({
        "models": [{"name": "small", "path": "/x", "threads": 2, "cores": [0], "page_size": 4},
                   {"name": "large", "path": "/y", "kv_cache_tokens": 96, "tp_size": 2}],
        "seed": 7, "launch": {"policy": "threshold", "thresholds": {"large": {4: 2, 8: 3}}, "share_cores": False},
        "executor": {"mode": "latency", "profile": PROFILE}, "ray": {"namespace": "tr"}})
    small, large = cfg.models
    # The flat per-model fields are the model's EngineConfig; model i seeds from the group's seed + i.
    assert (small.engine.model_path, small.engine.num_threads, small.engine.page_size, small.cores) == ("/x", 2, 4, [0])
    assert (large.engine.kv_cache_tokens, large.engine.tp_size, large.engine.device) == (96, 2, "cpu")
    assert (small.engine.seed, large.engine.seed) == (7, 8)
    assert isinstance(cfg.launch, LaunchConfig) and cfg.launch.thresholds["large"](8) == 3
    assert not cfg.launch.share_cores
    assert GroupConfig.from_dict({"models": [{"name": "m", "path": "/x"}]}).launch.share_cores
    assert isinstance(cfg.executor, ExecutorConfig) and isinstance(cfg.executor.profile, LatencyProfile)
    assert cfg.ray == RayConfig(address="auto", namespace="tr")
    d = cfg.to_dict()
    assert d["models"][0]["path"] == "/x" and d["models"][0]["threads"] == 2 and "engine" not in d["models"][0]
    assert GroupConfig.from_dict(d).to_dict() == d


def test_the_old_launcher_key_still_reads(caplog):
    with caplog.at_level(logging.WARNING, logger="tokenrouter.runtime.group_config"):
        cfg = GroupConfig.from_dict(with_model(1, launcher="spawn"))
    assert cfg.models[1].start == "spawn"
    assert "models[1]: `launcher` is deprecated, write `start: spawn`" in caplog.text
    with pytest.raises(ValueError, match=r"models\[1\]: give start"):
        GroupConfig.from_dict(with_model(1, launcher="spawn", start="spawn"))

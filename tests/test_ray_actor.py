"""Subservers as Ray actors (`start: ray`). Ray is an optional extra that CI does not install: the
cluster test runs where Ray is importable (a local cluster bound to 127.0.0.1) and skips elsewhere."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tokenrouter import SamplingParams
from tokenrouter.engine.config import EngineConfig
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.group_config import GroupConfig, ModelSpec, RayConfig
from tokenrouter.runtime.remote.ray_actor import connect, resources

SECRET = "correct horse battery staple"


def group(pair_paths, start: str, **extra) -> dict:
    return {"models": [{"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 2048, "page_size": 4},
                       {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 2048, "page_size": 4,
                        "start": start}],
            "algorithm": {"name": "bernoulli", "p": 0.5}, "transport": "tcp", "secret": SECRET, **extra}


def test_actor_resources_follow_the_model_spec():
    def spec(cores: list[int] | None = None, **engine) -> ModelSpec:
        return ModelSpec("m", EngineConfig("/x", **{"num_threads": 1, **engine}), cores=cores)

    assert resources(spec(device="cuda:0", tp_size=2, num_threads=4)) == {"num_cpus": 8.0, "num_gpus": 2.0}
    assert resources(spec(cores=[0, 1, 2])) == {"num_cpus": 3.0, "num_gpus": 0.0}
    assert resources(spec(num_threads=2)) == {"num_cpus": 2.0, "num_gpus": 0.0}


def test_ray_needs_the_tcp_transport(pair_paths):
    with pytest.raises(ValueError, match="start: ray .* set transport: tcp"):
        GroupConfig.from_dict({**group(pair_paths, "ray"), "transport": "ipc"})


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_without_ray_the_error_says_what_to_install():
    with pytest.raises(ValueError, match=r"pip install 'tokenrouter\[ray\]'"):
        connect(RayConfig(address="auto"))


# Ray turns 127.0.0.1 into the machine's outward address unless told it is not a cluster (its switch for
# Windows and macOS, read at import): so the test cluster, and every inbox on it, stays on loopback.
# No auth token written to the home folder either.
_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def ray_cluster():
    saved = {k: os.environ.get(k) for k in _RAY_ENV}
    os.environ.update(_RAY_ENV)
    try:
        ray = pytest.importorskip("ray")
        repo = str(Path(__file__).resolve().parents[1])
        env = {"PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **_RAY_ENV}
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), address
        yield address
        ray.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_ray_actor_subserver_is_token_exact(pair_paths, ray_cluster):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5]]
    with RoutedLLM(group(pair_paths, "spawn")) as llm:
        want = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=60)
    with RoutedLLM(group(pair_paths, "ray", ray={"address": ray_cluster})) as llm:
        assert llm.entry.info["large"].address.startswith("tcp://127.0.0.1:")
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=60)
        handle = llm.entry.remote["large"]
    assert handle.wait(0)  # Shutdown ended the actor's run
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].token_models == b.outputs[0].token_models

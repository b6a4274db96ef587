"""Subservers as Ray actors (`start: ray`) on a one-node Ray cluster the module starts on loopback
(2 CPUs, a 150 MiB object store, no dashboard): a routed pair whose large model is a Ray actor gives
the same tokens, from the same models, as the pair on local processes; a killed actor fails the
requests in flight within seconds with an error naming it, and a server with --restart-on-failure
serves again on a fresh actor. Ray is in the test dependencies: under CI this module never skips."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess

from tokenrouter import SamplingParams
from tokenrouter.engine.config import EngineConfig
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.entry.ray_subserver import connect, resources
from tokenrouter.runtime.group_config import GroupConfig, ModelSpec, RayConfig

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


def test_without_ray_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
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
        if os.environ.get("CI") or importlib.util.find_spec("ray") is not None:
            import ray  # under CI a missing Ray is a failure: it is in the test dependencies
        else:
            pytest.skip("Ray is not installed (pip install -e '.[test]' installs it)")
        repo = str(Path(__file__).resolve().parents[1])
        env = {"PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **_RAY_ENV}
        started = time.monotonic()
        ray.init(num_cpus=2, object_store_memory=150 * 2**20, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
        print(f"Ray up in {time.monotonic() - started:.1f} s")
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


PROMPTS = [[3, 4, 5], [9, 8, 7, 6, 5], [11, 12], [40, 41, 42, 43]]
SEEDED = {"temperature": 0.8, "seed": 7, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def local_tokens(pair_paths) -> list[tuple[list[int], list[str]]]:
    """The seeded requests through the same group with every model a local process."""
    params = SamplingParams(**SEEDED)
    with RoutedLLM(group(pair_paths, "spawn")) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False, timeout=60)
    return [(o.outputs[0].token_ids, o.outputs[0].token_models) for o in outs]


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory, pair_paths, ray_cluster):
    """`tokenrouter serve` of the group with its large model a Ray actor on the test's cluster."""
    import yaml

    cfg = tmp_path_factory.mktemp("ray") / "group.yaml"
    cfg.write_text(yaml.safe_dump({**group(pair_paths, "ray", ray={"address": ray_cluster}), "name": "pair"}))
    started = time.monotonic()
    srv = ServerProcess(["--config", str(cfg), "--restart-on-failure"])
    print(f"server with a Ray actor up in {time.monotonic() - started:.1f} s")
    yield srv
    assert srv.stop() == 0


def served_tokens(url: str) -> list[tuple[list[int], list[str]]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "pair", "prompt": prompt, "return_token_ids": True, **SEEDED})
        assert r.status_code == 200, r.text
        out.append((r.json()["choices"][0]["token_ids"], r.json()["routing"]["token_models"]))
    return out


def large_actors() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("tokenrouter-large-")]


def test_ray_actor_subserver_is_token_exact(ray_server, local_tokens):
    assert len(large_actors()) == 1
    got = served_tokens(ray_server.url)
    assert got == local_tokens  # every token, and the model that wrote it
    assert {m for _, models in got for m in models} == {"small", "large"}


def test_a_killed_actor_fails_its_requests_and_the_group_is_restarted(ray_server, local_tokens):
    """Every request of a routed pair may visit both models, so losing one fails every request in
    flight (the entry raises SubserverDied); the server answers them with a clear error and, with
    --restart-on-failure, starts the group again on a fresh actor, which gives the same tokens."""
    import ray

    results: list = []

    def stream() -> None:
        body = {"model": "pair", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{ray_server.url}/v1/completions", json=body, timeout=60) as s:
            lines = []
            for line in s.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    results.append(("streaming", time.monotonic()))
        results.append(("\n".join(lines), time.monotonic()))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while not results:
        assert time.monotonic() < deadline and t.is_alive(), "the stream never started"
        time.sleep(0.05)
    (first,) = large_actors()
    ray.kill(ray.get_actor(first["name"], namespace=first["namespace"]), no_restart=True)
    killed = time.monotonic()
    t.join(30)
    text, ended = results[-1]
    print(f"killed actor -> stream ended in {ended - killed:.2f} s")
    assert ended - killed < 10.0
    assert '"service_unavailable"' in text and "subserver 'large' failed" in text, text[-500:]
    assert text.rstrip().endswith("data: [DONE]") and "Traceback" not in text
    while httpx.get(f"{ray_server.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() - killed < 90, "the group did not come back"
        time.sleep(0.5)
    print(f"killed actor -> group serving again in {time.monotonic() - killed:.1f} s")
    assert [a["name"] for a in large_actors()] not in ([], [first["name"]])
    assert served_tokens(ray_server.url) == local_tokens

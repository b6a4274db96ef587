"""Schema fuzzing of the HTTP API with hypothesis, through a routed pair (so fuzzed values reach the
subservers and the messages between them): any JSON a client sends gets a 2xx or a 4xx with an
OpenAI-style error body, never a 5xx or a hang, and afterwards the group serves a normal request with
no request and no KV page left behind."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess, pair_group_yaml

MODEL = "fuzz"

# Integers around every width the engine, torch and msgpack use, floats to the extremes (inf and
# nan as the JSON extensions Python writes), and bodies nested far deeper than any schema.
edges = [2**k + d for k in (31, 32, 53, 63, 64, 100) for d in (-1, 0, 1)]
huge_ints = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from(edges + [-e for e in edges]),
                      st.integers(min_value=-(10**400), max_value=10**400))
extreme_floats = st.one_of(st.floats(), st.sampled_from([1e-300, 5e-324, 1e308, -1e308, 1e-7, 1e-45]))
scalars = st.one_of(st.none(), st.booleans(), huge_ints, extreme_floats, st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs", "echo",
          "ignore_eos", "return_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty",
          "logit_bias", "min_tokens", "include_stop_str_in_output", "response_format"]
# Mostly-valid bodies with one or two fields replaced by anything: they reach deep into the handlers.
valid_completion = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
valid_chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
mutations = st.dictionaries(st.sampled_from(FIELDS), values, max_size=3)
deep = st.one_of(
    st.integers(50, 20_000).map(lambda n: "[" * n + "]" * n),
    st.integers(50, 20_000).map(lambda n: '{"model": "fuzz", "prompt": ' + "[" * n + "]" * n + "}"),
    st.integers(50, 5_000).map(lambda n: json.dumps({**valid_chat})[:-1] + ', "messages": '
                               + '[{"role": "user", "content": ' * n + '"x"' + "}]" * n + "}"),
)
bodies = st.one_of(
    deep,
    values.map(json.dumps),
    st.builds(lambda m: json.dumps({**valid_completion, **m}), mutations),
    st.builds(lambda m: json.dumps({**valid_chat, **m}), mutations),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    cfg = pair_group_yaml(tmp_path_factory.mktemp("fuzz"), pair_paths, p=0.5, name=MODEL)
    srv = ServerProcess(["--config", str(cfg)])
    yield srv
    srv.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_no_5xx_for_any_body(server, path, body):
    r = httpx.post(server.url + path, content=body.encode("utf-8", "surrogatepass"), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
    elif "text/event-stream" not in r.headers.get("content-type", ""):
        assert r.json()["choices"]


def in_use(server) -> tuple[float, float]:
    """(requests the models hold, share of KV pages held by requests), summed over the models."""
    live = used = 0.0
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        for s in fam.samples:
            live += s.value if s.name == "tokenrouter_model_live_requests" else 0.0
            used += s.value if s.name == "tokenrouter_kv_usage_ratio" else 0.0
    return live, used


def test_still_serving_after_fuzzing(server):
    r = httpx.post(server.url + "/v1/completions", json=valid_completion, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 20
    while in_use(server) != (0.0, 0.0):
        assert time.monotonic() < deadline, f"left behind (requests, KV usage): {in_use(server)}"
        time.sleep(0.2)

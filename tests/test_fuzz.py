"""Schema fuzzing of the HTTP API with hypothesis: any JSON a client sends gets a 2xx or a 4xx with
an OpenAI-style error body, never a 5xx or a hang, and the server serves a normal request after."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import ServerProcess

MODEL = "fuzz"

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=40))
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
bodies = st.one_of(
    values.map(json.dumps),
    st.builds(lambda m: json.dumps({**valid_completion, **m}), mutations),
    st.builds(lambda m: json.dumps({**valid_chat, **m}), mutations),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)


@pytest.fixture(scope="module")
def server(pair_paths):
    srv = ServerProcess(["--model-path", str(pair_paths["small"]), "--served-model-name", MODEL,
                         "--kv-cache-tokens", "4096", "--page-size", "4", "--context-length", "256"])
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


def test_still_serving_after_fuzzing(server):
    r = httpx.post(server.url + "/v1/completions", json=valid_completion, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200

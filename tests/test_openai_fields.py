"""The OpenAI fields vLLM users send, through `tokenrouter serve` over a routed pair with the real
`openai` client: logits processing (token-exact where greedy), stop strings, stream_options as
vLLM's tests define them."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from sampling_utils import check_processed_greedy
from server_utils import ServerProcess, pair_group_yaml

from tokenrouter.sampling_params import SamplingParams

MODEL = "pair"


@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    cfg = pair_group_yaml(tmp_path_factory.mktemp("srv"), pair_paths, p=0.5, name=MODEL)
    srv = ServerProcess(["--config", str(cfg), "--grace-period", "5"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(pair_paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair_paths["small"])


@pytest.fixture(scope="module")
def hf_pair(pair_paths):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for n, path in pair_paths.items()}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


# ---- logits processing ----------------------------------------------------------------------------

def test_penalties_and_bias_are_token_exact(client, hf_pair, tokenizer):
    prompt = [11, 200, 37, 90, 5, 61, 150]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=14, temperature=0, seed=3, frequency_penalty=0.7,
        presence_penalty=0.3, logit_bias={"17": 1, "40": -2},
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    models = r.model_extra["routing"]["token_models"]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.7, presence_penalty=0.3, logit_bias={17: 1.0, 40: -2.0})
    assert len(ids) == 14
    assert len(check_processed_greedy(hf_pair, prompt, ids, models, params, {tokenizer.eos_token_id})) >= 10
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=14, temperature=0, seed=3,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert plain.choices[0].model_extra["token_ids"] != ids


def test_logit_bias_in_chat_streaming_and_not(client, tokenizer):
    a = str(tokenizer.convert_tokens_to_ids("a"))
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0.7, seed=1,
              logit_bias={a: 100}, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(**kw).choices[0].message.content == "aaaaa"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "aaaaa"


def test_min_tokens_holds_eos_back(client, tokenizer):
    eos = str(tokenizer.eos_token_id)
    kw = dict(model=MODEL, prompt="Hi", max_tokens=10, temperature=0, logit_bias={eos: 100})
    eager = client.completions.create(**kw)
    assert eager.usage.completion_tokens == 1 and eager.choices[0].finish_reason == "stop"
    held = client.completions.create(**kw, extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("include,text", [(False, "aa"), (True, "aaa")])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_with_include_stop_str_in_output(client, tokenizer, include, text, stream):
    a = str(tokenizer.convert_tokens_to_ids("a"))
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=10, temperature=0, stop=["a"],
                                  logit_bias={a: 100}, stream=stream,
                                  extra_body={"min_tokens": 2, "include_stop_str_in_output": include})
    if stream:
        chunks = list(r)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    else:
        assert r.choices[0].text == text and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,needle", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -9}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_bad_fields_get_a_400_naming_them(server, body, needle):
    r = post(server, "/v1/completions", {"prompt": "x", **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


# ---- stream_options, as vLLM's tests define them ---------------------------------------------------

def test_completion_stream_options(client):
    kw = dict(model=MODEL, prompt="What is the capital", max_tokens=6, temperature=0, stream=True,
              extra_body={"ignore_eos": True})
    # continuous_usage_stats counts only together with include_usage
    for ch in client.completions.create(stream_options={"include_usage": False, "continuous_usage_stats": True}, **kw):
        assert ch.usage is None
    stream = client.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": False}, **kw)
    for ch in stream:
        assert ch.usage is None
        if ch.choices[0].finish_reason is not None:
            final = next(stream)
            assert final.choices == [] and final.usage.prompt_tokens > 0
            assert final.usage.completion_tokens == 6
            assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
            break
    else:
        pytest.fail("no finish chunk")
    seen = 0
    # With token ids every token has a chunk (a random model's text may be held back as partial UTF-8).
    every = {**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    stream = client.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       **every)
    for ch in stream:
        assert ch.usage is not None and ch.usage.prompt_tokens > 0 and ch.usage.completion_tokens > 0
        assert ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
        seen += 1
        if ch.choices and ch.choices[0].finish_reason is not None:
            final = next(stream)
            assert final.choices == [] and final.usage.completion_tokens == 6
            break
    assert seen == 7  # a chunk per token, then the finish chunk


def test_chat_stream_options(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True,
              extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}, **kw))
    assert all(ch.usage is not None for ch in chunks)
    assert [ch.usage.completion_tokens for ch in chunks] == sorted(ch.usage.completion_tokens for ch in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("options", [{"include_usage": None}, {"include_usage": True},
                                     {"continuous_usage_stats": None}, {"continuous_usage_stats": True}])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_a_400(server, options, path):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = post(server, path, {**body, "max_tokens": 2, "stream": False, "stream_options": options})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


# ---- /tokenize, /detokenize, /version, /v1/models ---------------------------------------------------

def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    r = post(server, "/tokenize", {"prompt": "Hello, world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tokenizer.encode("Hello, world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and len(out["token_strs"]) == out["count"]
    back = post(server, "/detokenize", {"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello, world"}


def test_tokenize_chat_matches_what_the_chat_endpoint_counts(server, client):
    messages = [{"role": "user", "content": "hi there"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)  # model is optional
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < r.json()["count"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model"),
])
def test_tokenize_errors(server, path, body, status, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_version_and_models(server, client):
    import tokenrouter

    assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": tokenrouter.__version__}
    model = client.models.list().data[0]
    assert model.id == MODEL and model.model_extra["max_model_len"] == 512


# ---- metrics in vLLM's names -------------------------------------------------------------------------

def scrape(server) -> dict[str, dict[tuple, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def test_vllm_metric_names(server, client):
    before = scrape(server)
    r = client.completions.create(model=MODEL, prompt="Count me", max_tokens=7, temperature=0, seed=2,
                                  extra_body={"ignore_eos": True})
    after = scrape(server)
    tpm = r.model_extra["routing"]["tokens_per_model"]

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total", model_name=MODEL) == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total", model_name=MODEL) == 7
    for member in ("small", "large"):
        assert delta("vllm:generation_tokens_total", model_name=member) == tpm.get(member, 0)
    assert delta("vllm:request_success_total", model_name=MODEL, finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert delta("vllm:e2e_request_latency_seconds_count", model_name=MODEL) == 1
    assert delta("vllm:inter_token_latency_seconds_count", model_name=MODEL) == 6
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert {dict(k)["model_name"] for k in after[gauge]} == {MODEL, "small", "large"}, gauge
        assert all(0 <= v for v in after[gauge].values())
    assert all(v <= 1 for v in after["vllm:kv_cache_usage_perc"].values())
    assert "tokenrouter_generated_tokens_total" in after  # our own names stay


def test_the_grafana_dashboard_reads_only_names_we_export(server, client):
    import json
    import re
    from pathlib import Path

    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    dash = json.loads((Path(__file__).parents[1] / "examples" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"(vllm:[a-z0-9_]+|tokenrouter_[a-z0-9_]+)", e)}
    exported = scrape(server)
    assert names and not names - set(exported), sorted(names - set(exported))
    assert {n for n in names if n.startswith("vllm:")} >= {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket"}


# ---- n, lists of prompts, echo ----------------------------------------------------------------------

def test_n_choices_are_routed_requests_of_their_own(client):
    kw = dict(model=MODEL, prompt="Pick a word", max_tokens=6, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert all(len(x) == 6 for x in ids) and len({tuple(x) for x in ids}) > 1, "seeded choices differ (seed + j)"
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(b"Pick a word")
    # choice j samples as a request with seed + j would (vLLM's rule), so each is reproducible alone
    for j in range(3):
        alone = client.completions.create(**{**kw, "seed": 11 + j})
        assert alone.choices[0].model_extra["token_ids"] == ids[j]
    streamed: dict[int, str] = {}
    for ch in client.completions.create(n=3, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_a_list_of_prompts_numbers_choices_as_openai(client):
    prompts = ["first prompt", "second", "ABC"]
    kw = dict(model=MODEL, max_tokens=4, temperature=0, seed=4, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    for c in r.choices:
        if c.index % 2 == 0:  # choice 0 of prompt i has the request's own seed: the same as prompt i alone
            assert c.text == singles[c.index // 2]
    assert r.usage.prompt_tokens == len(b"first prompt") + len(b"second") + 3
    assert r.usage.completion_tokens == 24


def test_chat_n(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
                                       temperature=1.0, seed=8, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=5, temperature=1.0, seed=8, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = {0: "", 1: ""}
    for ch in chunks[:-1]:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
    assert text == {c.index: c.message.content for c in r.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_echo(client, tokenizer, stream):
    kw = dict(model=MODEL, prompt=["Echo this", "Hi"], max_tokens=3, temperature=0, seed=1, echo=True,
              stream=stream, extra_body={"ignore_eos": True})
    plain = client.completions.create(**{**kw, "echo": False, "stream": False})
    r = client.completions.create(**kw)
    if stream:
        text: dict[int, str] = {}
        for ch in r:
            for c in ch.choices:
                text[c.index] = text.get(c.index, "") + c.text
    else:
        text = {c.index: c.text for c in r.choices}
    assert text == {0: "Echo this" + plain.choices[0].text, 1: "Hi" + plain.choices[1].text}
    ids = client.completions.create(**{**kw, "prompt": tokenizer.encode("Hi"), "stream": False})
    assert ids.choices[0].text == "Hi" + plain.choices[1].text  # token ids are echoed as their text


@pytest.mark.parametrize("body,needle", [
    ({"n": 0}, "n: Input should be greater than or equal to 1"),
    ({"n": 200}, "n: Input should be less than or equal to 128"),
    ({"prompt": ["a"] * 50, "n": 3}, "choices"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
])
def test_refused_fields(server, body, needle):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_choices_past_the_time_limit_are_all_aborted(tmp_path, pair_paths):
    import time

    # The latency-model executor makes every step take 10 ms, so 480 tokens take seconds on any machine.
    cfg = tmp_path / "slow.yaml"
    cfg.write_text("name: pair\nmodels:\n"
                   f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 8192, page_size: 4}}\n"
                   f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 8192, page_size: 4}}\n"
                   "algorithm: {name: bernoulli, p: 0.3}\n"
                   "executor: {mode: latency, profile: {models: {small: {base: 0.01}, large: {base: 0.01}}}}\n")
    srv = ServerProcess(["--config", str(cfg), "--request-timeout", "0.5"])
    try:
        body = {"model": "pair", "prompt": ["x", "y"], "n": 3, "max_tokens": 480, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 408
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            text = "".join(s.iter_text())
        assert "request_timeout" in text and text.rstrip().endswith("data: [DONE]")
        deadline = time.monotonic() + 20
        while True:  # every choice of both requests was aborted: no model holds a request
            m = scrape(srv)
            if sum(m["tokenrouter_model_live_requests"].values()) == 0:
                break
            assert time.monotonic() < deadline, m["tokenrouter_model_live_requests"]
            time.sleep(0.2)
        ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 6
    finally:
        srv.stop()

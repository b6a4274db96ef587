"""The OpenAI-compatible server, driven by the real `openai` client over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess, alive, pair_group_yaml

MODEL = "pair"
KEY = "sekret"


@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    cfg = pair_group_yaml(tmp_path_factory.mktemp("srv"), pair_paths, p=0.3, name=MODEL)
    srv = ServerProcess(["--config", str(cfg), "--api-key", KEY, "--grace-period", "5"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(server) -> dict[str, dict[tuple, float]]:
    text = httpx.get(f"{server.url}/metrics", timeout=10, headers={"Authorization": f"Bearer {KEY}"}).text
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def wait_idle(server, timeout: float = 20.0) -> dict:
    """Poll /metrics until no model holds a request and every KV page is free or cached."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        live = sum(m.get("tokenrouter_model_live_requests", {}).values())
        used = sum(m.get("tokenrouter_kv_usage_ratio", {}).values())
        if live == 0 and used == 0:
            return m
        assert time.monotonic() < deadline, f"still {live} live requests, KV usage {used}"
        time.sleep(0.2)


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and isinstance(c.text, str)
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(b"Hello there")
    routing = r.model_extra["routing"]
    assert sum(routing["tokens_per_model"].values()) == 12
    assert set(routing["tokens_per_model"]) <= {"small", "large"}


def test_completion_matches_streaming(client):
    # The seed fixes the router's draws too, so both runs route alike.
    kw = dict(model=MODEL, prompt="Stream me", max_tokens=10, temperature=0, seed=5, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, seed=3, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and r.usage.completion_tokens == 8
    assert len(c.logprobs.content) == 8
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, temperature=0, seed=3, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content


def test_completion_logprobs(client):
    kw = dict(model=MODEL, prompt="Log me", max_tokens=6, temperature=0, seed=4, logprobs=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    c = r.choices[0]
    lp = c.logprobs
    assert lp is not None and r.usage.completion_tokens == 6
    assert len(c.model_extra["token_ids"]) == len(lp.tokens) == len(lp.token_logprobs) == 6
    assert len(lp.top_logprobs) == len(lp.text_offset) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Two of the byte-level vocabulary's tokens may render as the same text (U+FFFD), so the dict,
        # keyed by text as OpenAI's is, holds one or two entries (the later one wins a clash).
        assert 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        assert chosen <= 0 and chosen >= max(top.values()) - 1e-4  # greedy: the sampled token is the top one
        if len(top) == 2:
            assert chosen == pytest.approx(max(top.values()), abs=1e-4)
    streamed = [ch.choices[0].logprobs for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert sum(len(x.tokens) for x in streamed if x is not None) == 6


def test_chat_without_a_template_uses_chatml(tmp_path, pair_paths):
    import shutil

    from tokenrouter.engine.tokenizer import load_tokenizer
    from tokenrouter.server.chat import chat_prompt

    folder = tmp_path / "notemplate"
    shutil.copytree(pair_paths["small"], folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    tok = load_tokenizer(folder)
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chatml = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt(tok, msgs) == chatml
    srv = ServerProcess(["--model-path", str(folder), "--kv-cache-tokens", "1024", "--page-size", "4"])
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="notemplate", messages=msgs, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert r.usage.prompt_tokens == len(tok.encode(chatml, add_special_tokens=False))
        assert "no chat template; chat requests use ChatML" in srv.log_tail(20000)
    finally:
        assert srv.stop() == 0


def test_stop_string(client):
    free = client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, seed=2,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((free[i:i + 2] for i in range(4, len(free) - 1) if "\ufffd" not in free[i:i + 2]), None)
    if stop is None:
        pytest.skip("the random model produced no clean two-character stop string")
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, seed=2, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == free[:free.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="abc", max_tokens=16, temperature=0, seed=2, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text


def test_sixteen_concurrent_streams(server):
    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await ac.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=20, temperature=0,
                                             seed=i, stream=True, extra_body={"ignore_eos": True})
        text, final = "", None
        async for ch in stream:
            text += ch.choices[0].text
            final = ch
        return text, sum(final.model_extra["routing"]["tokens_per_model"].values())

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(16)))

    results = asyncio.run(main())
    assert all(n == 20 for _, n in results)
    sync = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    for i, (text, _) in enumerate(results):  # each stream's text is the one its request gives alone
        alone = sync.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=20, temperature=0, seed=i,
                                        extra_body={"ignore_eos": True})
        assert alone.choices[0].text == text, i
    m = wait_idle(server)
    assert m["tokenrouter_handoffs_total"][()] > 0


def test_disconnect_mid_stream_frees_everything(server):
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", f"{server.url}/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {KEY}"}) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got += 1
                if got >= 3:
                    break
    m = wait_idle(server)
    assert m["tokenrouter_kv_usage_ratio"]  # the per-model gauges are there
    total = sum(m["tokenrouter_kv_pages_total"].values())
    free = sum(m["tokenrouter_kv_pages_free"].values()) + sum(m["tokenrouter_kv_pages_cached"].values())
    assert free == total


@pytest.mark.parametrize("body,status,needle", [
    ("{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": 12}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "maximum context length"),
    ({"model": MODEL, "prompt": "a" * 600, "max_tokens": 4}, 400, "maximum context length"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x"}, 400, "model"),
])
def test_bad_input_gets_an_openai_error(server, client, body, status, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/completions", content=data, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    ok = client.completions.create(model=MODEL, prompt="still fine", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_bad_chat_input(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 400 and "error" in r.json()


def test_wrong_api_key(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401  # every endpoint but /health
    for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):  # closed with a key, even with it
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}"}):
            r = httpx.get(f"{server.url}{path}", timeout=10, headers=headers)
            assert r.status_code in (401, 404) and "openapi" not in r.text.lower(), (path, r.status_code)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    m = metrics(server)
    for name in ("tokenrouter_requests_total", "tokenrouter_generated_tokens_total", "tokenrouter_handoffs_total",
                 "tokenrouter_queue_waiting", "tokenrouter_kv_usage_ratio", "tokenrouter_step_latency_seconds_bucket",
                 "tokenrouter_time_to_first_token_seconds_count"):
        assert name in m, name
    models = {dict(k)["model"] for k in m["tokenrouter_step_latency_seconds_count"]}
    assert models == {"small", "large"}


def test_sigterm_drains_and_leaves_no_orphans(pair_paths):
    srv = ServerProcess(["--model-path", str(pair_paths["small"]), "--kv-cache-tokens", "2048", "--page-size", "4",
                         "--grace-period", "3"])
    assert srv.subservers and all(alive(p) for p in srv.subservers)
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    assert c.completions.create(model="small", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    rc = srv.stop(timeout=30)
    assert rc == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in srv.subservers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in srv.subservers)


def test_sigterm_mid_stream_ends_the_stream_and_exits_cleanly(tmp_path, pair_paths):
    # The latency-model executor makes every step take 50 ms: 480 tokens would take 24 s, far past the
    # 2 s grace period, so SIGTERM lands mid-stream and the grace period runs out before it completes.
    cfg = pair_group_yaml(tmp_path, pair_paths, p=0.3,
                          extra="executor: {mode: latency, profile: {models: "
                                "{small: {base: 0.05}, large: {base: 0.05}}}}\n")
    grace = 2.0
    srv = ServerProcess(["--config", str(cfg), "--grace-period", str(grace)])
    procs = set(srv.pids) | set(srv.subservers)  # the server, its two subservers and any helper process
    body = {"model": "pair", "prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        assert len(srv.subservers) >= 2 and all(alive(p) for p in procs)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=httpx.Timeout(30.0)) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            for line in lines:  # bounded: the first token event
                if line.startswith("data: {"):
                    events.append(line[6:])
                    break
            srv.terminate()  # SIGTERM with the request in flight
            with contextlib.suppress(httpx.HTTPError):  # the server may cut the connection instead
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
        rc = srv.proc.wait(timeout=grace + 30)  # the grace period plus a generous bound for shutdown
    finally:
        srv.stop()
    assert rc == 0, srv.log_tail()
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    finished = [ch["finish_reason"] for ch in choices if ch.get("finish_reason")]
    # The stream ends recognisably: [DONE] after either the finish reason (it completed within the
    # grace period: not with 24 s of work) or an error event saying why it was cut short.
    assert events and events[-1] == "[DONE]", f"the stream was cut off: {events[-3:]}"
    assert not finished, "a 24 s request finished within the 2 s grace period"
    assert "error" in chunks[-1], f"no error event before [DONE]: {events[-3:]}"
    assert "shutting down" in chunks[-1]["error"]["message"]
    assert 1 <= len(choices) < 480
    deadline = time.monotonic() + 10
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in procs), "orphan processes remain after SIGTERM"


def test_return_token_ids(client):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0, seed=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 6 and all(isinstance(t, int) for t in ids)
    streamed = [t for ch in client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0, seed=1, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True}) for t in ch.choices[0].model_extra["token_ids"]]
    assert streamed == ids


def test_body_size_limit(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{" + b" " * (9 << 20) + b"}", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]

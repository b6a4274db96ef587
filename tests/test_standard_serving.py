"""The standard-serving baseline (tokenrouter.bench.baselines.standard): two plain single-model servers and
an outside coordinator that asks for one token per request. With the same seed it must write exactly
the tokens, and give each position to exactly the model, that the routed runtime does."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tokenrouter.bench.baselines.standard_stack import StandardStack
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.sampling_params import SamplingParams

SERVER_ARGS = ["--kv-cache-tokens", "4096", "--page-size", "4"]
PROMPTS = [[5, 6, 7, 8, 9], [100, 42, 7, 250, 3, 19, 64, 64, 2, 77, 31]]
# (temperature, seed): greedy under two seeds (the seed only moves the routing draws), and sampled.
CASES = [(0.0, 7), (0.0, 1234), (0.8, 99)]
PS = {0.3: "standard", 0.0: "standard-p0", 1.0: "standard-p1"}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(pair_paths, tmp_path_factory):
    st = StandardStack(pair_paths["small"], pair_paths["large"], p=0.3, server_args=SERVER_ARGS,
                       log_dir=tmp_path_factory.mktemp("standard-logs"))
    st.start()
    try:
        extra = {p: st.add_coordinator(p, name, wait=False) for p, name in PS.items() if p != 0.3}
        for proc in extra.values():
            proc.wait_healthy(120)
        urls = {0.3: st.url, **{p: proc.url for p, proc in extra.items()}}
        yield st, urls
    finally:
        st.stop()
        left = st.alive_pids()
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def routed(pair_paths):
    """The routed runtime's outputs: {(p, prompt index, temperature, seed): (token_ids, token_models)}. One
    group start: each p other than the group's own is the request's routing override of it."""
    out = {}
    cfg = {"models": [{"name": n, "path": str(pair_paths[n]), "kv_cache_tokens": 4096, "page_size": 4}
                      for n in ("small", "large")],
           "algorithm": {"name": "bernoulli", "p": 0.3}}
    with RoutedLLM(cfg) as llm:
        for p in PS:
            for i, prompt in enumerate(PROMPTS):
                for temp, seed in CASES:
                    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=temp, seed=seed, ignore_eos=True)
                    c = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False, timeout=60,
                                     routing=None if p == 0.3 else {"p": p})[0].outputs[0]
                    out[(p, i, temp, seed)] = (list(c.token_ids), list(c.token_models))
    return out


def complete(url: str, model: str, prompt: list[int], **kw) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "return_token_ids": True,
            "ignore_eos": True, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, model: str, prompt: list[int], **kw) -> list[dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **kw}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


@pytest.mark.parametrize("p", list(PS))
def test_identical_to_the_routed_runtime(stack, routed, p):
    _, urls = stack
    for i, prompt in enumerate(PROMPTS):
        for temp, seed in CASES:
            out = complete(urls[p], PS[p], prompt, temperature=temp, seed=seed)
            choice, routing = out["choices"][0], out["routing"]
            want_ids, want_models = routed[(p, i, temp, seed)]
            assert choice["token_ids"] == want_ids, (p, i, temp, seed)
            assert routing["token_models"] == want_models, (p, i, temp, seed)
            assert choice["finish_reason"] == "length"
            assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                                    "total_tokens": len(prompt) + MAX_TOKENS}
            assert sum(routing["tokens_per_model"].values()) == MAX_TOKENS
            assert routing["handoffs"] == sum(a != b for a, b in zip(want_models, want_models[1:]))
            # One small request per position, one more per position handed to the large model.
            assert routing["backend_requests"] == MAX_TOKENS + want_models.count("large")
            if p == 0.0:
                assert set(want_models) == {"small"}
            if p == 1.0:
                assert set(want_models) == {"large"}
    # p = 0.3 over these cases writes with both models.
    if p == 0.3:
        assert {m for (q, *_), (_, ms) in routed.items() if q == 0.3 for m in ms} == {"small", "large"}


def test_stream_matches_non_streaming(stack):
    st, _ = stack
    prompt = PROMPTS[1]
    full = complete(st.url, "standard", prompt, temperature=0.0, seed=5)
    chunks = stream(st.url, "standard", prompt, temperature=0.0, seed=5)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    assert final[0]["routing"] == full["routing"]
    assert sum(final[0]["routing"]["tokens_per_model"].values()) == MAX_TOKENS
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    # With token ids requested, every token comes in its own chunk.
    ids_chunks = stream(st.url, "standard", prompt, temperature=0.0, seed=5, return_token_ids=True)
    ids = [t for c in ids_chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert ids == full["choices"][0]["token_ids"]


def test_stop_token_ends_the_request_like_the_routed_runtime(stack, routed):
    """A stop token id comes back from a backend as finish_reason "stop" (the EOS path); a dropped
    small token does not stop the request, exactly as in the routed runtime."""
    st, _ = stack
    ids, models = routed[(0.3, 0, 0.0, 7)]
    stop_at = next(k for k in range(2, MAX_TOKENS) if ids[k] not in ids[:k])
    out = complete(st.url, "standard", PROMPTS[0], temperature=0.0, seed=7, stop_token_ids=[ids[stop_at]])
    assert out["choices"][0]["token_ids"] == ids[:stop_at + 1]
    assert out["routing"]["token_models"] == models[:stop_at + 1]
    assert out["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_interleave(stack):
    """Concurrent client requests are served concurrently (their tokens interleave), and each one's
    writers follow the router's draws exactly whatever the batching on the servers."""
    st, urls = stack
    n = 4

    async def one(client: httpx.AsyncClient, k: int) -> tuple[float, float, dict]:
        body = {"model": "standard", "prompt": PROMPTS[k % 2], "max_tokens": 24, "temperature": 0.0,
                "seed": 40 + k, "ignore_eos": True, "stream": True}
        first = None
        final = None
        async with client.stream("POST", f"{st.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                c = json.loads(line[6:])
                first = first or time.monotonic()
                if c["choices"] and c["choices"][0]["finish_reason"]:
                    final = c
        assert final is not None
        return first, time.monotonic(), final["routing"]

    async def run() -> list[tuple[float, float, dict]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, k) for k in range(n)))

    results = asyncio.run(run())
    assert max(r[0] for r in results) < min(r[1] for r in results)
    for k, (_, _, routing) in enumerate(results):
        serial = complete(st.url, "standard", PROMPTS[k % 2], max_tokens=24, temperature=0.0, seed=40 + k)
        assert routing["token_models"] == serial["routing"]["token_models"]
        assert sum(routing["tokens_per_model"].values()) == 24


def test_errors_and_models(stack):
    st, _ = stack
    r = httpx.post(f"{st.url}/v1/completions", json={"model": "nope", "prompt": [1, 2]}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{st.url}/v1/completions", json={"model": "standard", "prompt": [1] * 500, "max_tokens": 100},
                   timeout=10)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(f"{st.url}/v1/completions", json={"model": "standard", "prompt": []}, timeout=10)
    assert r.status_code == 400
    m = httpx.get(f"{st.url}/v1/models", timeout=10).json()["data"][0]
    assert m["id"] == "standard" and m["members"] == ["small", "large"] and m["max_model_len"] == 512
    assert httpx.get(f"{st.url}/health", timeout=10).json() == {"status": "ok"}
    # A text prompt is tokenized with the small model's tokenizer.
    out = complete(st.url, "standard", "Hello", temperature=0.0, seed=1)  # type: ignore[arg-type]
    assert out["usage"]["prompt_tokens"] == 5

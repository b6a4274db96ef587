"""The requests of `vllm bench serve` (--backend openai, openai-chat) and SGLang's bench_serving
(--backend sglang-oai, sglang-oai-chat), byte for byte as their request functions build them, against
`tokenrouter serve` over a routed pair; their streams read the way those clients read them (SSE
messages split on blank lines, `data: ` prefix, a usage chunk without choices, [DONE]).
benchmarks/bench_clients.py runs the clients themselves."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_utils import ServerProcess, pair_group_yaml

MODEL = "pair"


@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    cfg = pair_group_yaml(tmp_path_factory.mktemp("clients"), pair_paths, p=0.5, name=MODEL)
    srv = ServerProcess(["--config", str(cfg), "--grace-period", "5"])
    yield srv
    srv.stop()


def read_stream(resp: httpx.Response, chat: bool) -> dict[str, Any]:
    """What vLLM's async_request_openai_(chat_)completions take from a stream: the token chunks (TTFT,
    ITL), the text, and completion_tokens from a usage chunk that has no choices."""
    buffer, chunks, text, usage, done = "", 0, "", None, False
    for piece in resp.iter_text():
        buffer += piece
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            message = message.strip()
            if not message or message.startswith(":"):
                continue
            assert message.startswith("data: "), message
            data = message.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            obj = json.loads(data)
            assert "error" not in obj, obj
            if choices := obj.get("choices"):
                chunks += 1
                text += (choices[0]["delta"].get("content") if chat else choices[0].get("text")) or ""
                assert obj.get("usage") is None  # usage only in its own chunk (no continuous_usage_stats)
            elif obj.get("usage"):
                usage = obj["usage"]
    assert done and buffer.strip() == ""
    return {"chunks": chunks, "text": text, "usage": usage}


def vllm_completion(prompt: str, output_len: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def vllm_chat(prompt: str, output_len: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": output_len, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}


def sglang_completion(prompt: str | list[int], output_len: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "best_of": 1, "max_tokens": output_len, "stream": True,
            "temperature": 0.0, "ignore_eos": True}


def sglang_chat(prompt: str, output_len: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": output_len,
            "stream": True, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("client,build,path", [
    ("vllm openai", vllm_completion, "/v1/completions"),
    ("vllm openai-chat", vllm_chat, "/v1/chat/completions"),
    ("sglang-oai", sglang_completion, "/v1/completions"),
    ("sglang-oai-chat", sglang_chat, "/v1/chat/completions"),
])
def test_benchmark_clients_request_shapes(server, client, build, path):
    # Random bytes as vLLM's random dataset makes them (decoded random token ids), EOS ignored.
    body = build("xq7 Lm:;,ZZ'k\u00e9 wq", 12)
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60,
                      headers={"x-request-id": "bench-1-0"}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        out = read_stream(resp, chat=path.endswith("chat/completions"))
    # vLLM counts a success by a chunk with choices, and the output tokens by the usage chunk, which
    # it asks for with stream_options; SGLang counts the chunks' text. Neither may come short.
    assert out["chunks"] >= 1 and out["text"]
    if "stream_options" in body:
        assert out["usage"]["completion_tokens"] == 12 and out["usage"]["prompt_tokens"] > 0
    else:
        assert out["usage"] is None


def test_sglang_random_ids_prompt_as_token_ids(server):
    body = sglang_completion([5, 17, 200, 33, 90, 41, 7, 8], 6)
    with httpx.stream("POST", f"{server.url}/v1/completions",
                      json={**body, "stream_options": {"include_usage": True}}, timeout=60) as resp:
        out = read_stream(resp, chat=False)
    assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14}


def test_model_card_has_what_the_clients_read(server, pair_paths):
    # `vllm bench serve` without --model reads data[0]["id"] and data[0]["root"] (its tokenizer's
    # folder when --tokenizer is not given); SGLang's reads data[0]["id"].
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "tokenrouter"
    assert card["root"] == str(pair_paths["small"]) and card["parent"] is None
    assert card["max_model_len"] == 512 and card["created"] > 0 and card["members"] == ["small", "large"]
    assert card["permission"][0]["object"] == "model_permission"


def test_tokenrouter_bench_random_workload(server, pair_paths):
    import asyncio

    from tokenrouter.bench.loadgen import BenchConfig, run_bench
    from tokenrouter.bench.workloads import random_id_prompts
    from tokenrouter.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(pair_paths["small"])
    prompts = random_id_prompts(4, 16, tok, seed=1)
    assert prompts == random_id_prompts(4, 16, tok, seed=1) and all(len(p) == 16 for p in prompts)
    assert not set(tok.all_special_ids) & {t for p in prompts for t in p}
    cfg = BenchConfig(base_url=server.url, model=MODEL, prompts=prompts, max_tokens=5, num_requests=4,
                      concurrency=2, warmup=0)
    summary, _ = asyncio.run(run_bench(cfg, progress=False))
    assert (summary["completed"], summary["failed"]) == (4, 0)
    assert summary["input_tokens"] == 64 and summary["output_tokens"] == 20
    assert summary["tpot_s"]["mean"] is not None and summary["tpot_s"]["mean"] > 0

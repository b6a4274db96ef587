"""Prompt logprobs (SamplingParams.prompt_logprobs; /v1/completions with echo and logprobs) equal those of
a direct transformers forward of the same random model, through chunked prefill, a prefix-cache hit,
the routed entry and the server, streaming and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from server_utils import ServerProcess, pair_group_yaml

from tokenrouter.llm import LLM
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.sampling_params import SamplingParams

MODEL = "pair"
PROMPT = [11, 200, 37, 90, 5, 61, 150, 7, 7, 42, 250, 3, 19, 88]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_small(pair_paths):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pair_paths["small"], dtype=torch.float32).eval()


def reference(hf, prompt: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    """The logprob of each prompt token from the second on, and the top-k ids at each position."""
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    values = lsm[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()
    return values, lsm[:-1].topk(k, dim=-1).indices.tolist()


def check(entries, hf, prompt: list[int], k: int) -> None:
    """vLLM's shape: None, then {token: logprob, **top-k} per prompt token."""
    want, top_ids = reference(hf, prompt, k)
    assert entries[0] is None and len(entries) == len(prompt)
    for tok, entry, lp, top in zip(prompt[1:], entries[1:], want, top_ids):
        assert entry[tok] == pytest.approx(lp, abs=TOL)
        assert set(top) <= set(entry) and len(entry) <= k + 1


def test_offline_chunked_prefill_and_prefix_cache(pair_paths, hf_small):
    llm = LLM(str(pair_paths["small"]), kv_cache_tokens=1024, page_size=4, chunked_prefill_size=4,
              max_running_requests=2)
    prompt = PROMPT * 2  # 28 tokens in chunks of 4 (minus the decodes sharing the budget)
    plain = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=3, temperature=0))[0]
    assert plain.prompt_logprobs is None
    # The same prompt again: its pages are in the prefix cache, yet every prompt position is scored.
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=3, temperature=0, prompt_logprobs=2))[0]
    check(out.prompt_logprobs, hf_small, prompt, 2)
    assert out.metrics.num_cached_tokens == 0 and out.outputs[0].token_ids == plain.outputs[0].token_ids
    # A request without prompt logprobs takes the cache hit as before.
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=3, temperature=0))[0]
    assert again.metrics.num_cached_tokens > 0


def test_routed_llm(pair_paths, hf_small):
    cfg = {"models": [{"name": n, "path": str(pair_paths[n]), "kv_cache_tokens": 4096, "page_size": 4}
                      for n in ("small", "large")], "algorithm": {"name": "bernoulli", "p": 0.5}}
    with RoutedLLM(cfg) as llm:
        outs = llm.generate(prompt_token_ids=[PROMPT, PROMPT[:5]], sampling_params=SamplingParams(
            max_tokens=6, temperature=1.0, seed=4, prompt_logprobs=0), use_tqdm=False, timeout=120)
    for o, prompt in zip(outs, (PROMPT, PROMPT[:5])):
        check(o.prompt_logprobs, hf_small, prompt, 0)
        assert len(o.outputs[0].token_ids) == 6


@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    cfg = pair_group_yaml(tmp_path_factory.mktemp("srv"), pair_paths, p=0.5, name=MODEL)
    srv = ServerProcess(["--config", str(cfg), "--grace-period", "5"])
    yield srv
    srv.stop()


def completion(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=60)


def test_echo_with_logprobs_through_the_server(server, hf_small):
    want, _ = reference(hf_small, PROMPT, 2)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.8, echo=True, logprobs=2,
                                  n=2, seed=1)
    for choice in r.choices:
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(PROMPT) + 4
        assert lp.token_logprobs[1:len(PROMPT)] == pytest.approx(want, abs=TOL)
        assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
        assert all(x is not None for x in lp.token_logprobs[len(PROMPT):])
        assert lp.text_offset == sorted(lp.text_offset)
        assert choice.text.startswith("".join(lp.tokens[:len(PROMPT)]))
    # echo without logprobs keeps its plain echo; logprobs without echo cover the output only
    plain = completion(server, max_tokens=2, temperature=0, logprobs=1).json()["choices"][0]["logprobs"]
    assert len(plain["tokens"]) == 2


def test_echo_with_logprobs_streaming(server, hf_small):
    want, _ = reference(hf_small, PROMPT, 1)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][1:len(PROMPT)] == pytest.approx(want, abs=TOL)
    tokens = [t for c in chunks for ch in c["choices"] for t in (ch["logprobs"] or {}).get("tokens", [])]
    assert len(tokens) == len(PROMPT) + 3

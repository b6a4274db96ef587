"""Routed decoding is token-exact: every output token is the greedy choice of the model that wrote
it, given the prompt and the preceding output (checked against transformers' forward)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import check_exact, prompts_of

from tokenrouter import LLM, SamplingParams
from tokenrouter.routed_llm import RoutedLLM


def group(pair_paths, p: float, transport: str = "ipc") -> dict:
    return {
        "transport": transport,
        "models": [
            {"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 4096, "page_size": 4},
            {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 4096, "page_size": 4},
        ],
        "algorithm": {"name": "bernoulli", "p": p},
    }


@pytest.fixture(scope="module")
def hf_pair(pair_paths):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for n, path in pair_paths.items()}


@pytest.fixture(scope="module")
def routed(pair_paths):
    """One group at p = 0.3 for the tests below (a request overrides p through `routing`)."""
    with RoutedLLM(group(pair_paths, 0.3)) as llm:
        yield llm


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_token_exact_under_greedy(routed, hf_pair, p):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for batch in (1, 4, 16):
        prompts = prompts_of([3 + (7 * i) % 29 for i in range(batch)], seed=100 + batch)
        outs = routed.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120,
                               routing={"p": p})
        written = {"small": 0, "large": 0}
        checked = 0
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            assert len(c.token_ids) == 10 and c.finish_reason == "length"
            assert c.token_models is not None and len(c.token_models) == 10
            checked += check_exact(hf_pair, prompt, c.token_ids, c.token_models)
            for m in c.token_models:
                written[m] += 1
        assert checked >= 9 * batch
        if p == 0.0:
            assert written["large"] == 0
        elif p == 1.0:
            assert written["small"] == 0  # every small token is dropped and rewritten
        elif p == 0.5 and batch == 16:
            assert written["small"] > 0 and written["large"] > 0
        run = routed.last_run
        assert run is not None and sum(run.tokens_per_model.values()) == 10 * batch
        assert (run.handoffs > 0) == (written["large"] > 0)


def test_p0_is_the_small_model_alone_and_p1_the_large(pair_paths):
    prompts = prompts_of([5, 12, 20, 9], seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = {n: [o.outputs[0].token_ids for o in
                 LLM(str(path), kv_cache_tokens=2048, page_size=4, device="cpu").generate(
                     prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
             for n, path in pair_paths.items()}
    for p, name in ((0.0, "small"), (1.0, "large")):
        with RoutedLLM(group(pair_paths, p)) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
        assert [o.outputs[0].token_ids for o in outs] == alone[name]


def test_seeded_sampling_is_reproducible_across_models(routed):
    prompts = prompts_of([6, 11, 17], seed=8)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    first = routed.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
    again = routed.generate(prompt_token_ids=prompts[::-1], sampling_params=params, use_tqdm=False, timeout=120)
    a = [(o.outputs[0].token_ids, o.outputs[0].token_models) for o in first]
    b = [(o.outputs[0].token_ids, o.outputs[0].token_models) for o in again][::-1]
    assert a == b
    assert any("large" in models for _, models in a)


def test_tcp_transport_is_exact(pair_paths, hf_pair):
    prompts = prompts_of([4, 13, 22, 8], seed=9)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tcp = {**group(pair_paths, 0.5, transport="tcp"), "secret": "tcp always needs a secret"}
    with RoutedLLM(tcp) as llm:
        assert all(r.address.startswith("tcp://127.0.0.1:") for r in llm.entry.info.values())
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert check_exact(hf_pair, prompt, c.token_ids, c.token_models) >= 9
    assert any("large" in o.outputs[0].token_models for o in outs)


def test_delayed_batching_changes_timing_not_tokens(pair_paths):
    prompts = prompts_of([5, 9, 14, 3, 20, 11, 7, 16], seed=10)
    params = SamplingParams(max_tokens=12, temperature=0.0, seed=3, ignore_eos=True)
    results = []
    for launch in ({"policy": "eager"},
                   {"policy": "threshold", "thresholds": {"large": {1: 1, 4: 3, 8: 6}}}):
        cfg = {**group(pair_paths, 0.5), "launch": launch}
        with RoutedLLM(cfg) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
        results.append([(o.outputs[0].token_ids, o.outputs[0].token_models) for o in outs])
    assert results[0] == results[1]


def test_single_model_group_preempts_instead_of_reserving(pair_paths):
    prompts = prompts_of([9, 30, 17, 25, 12, 40, 21, 6], seed=12)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = LLM(str(pair_paths["small"]), kv_cache_tokens=4096, page_size=4, device="cpu").generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    cfg = {"models": [{"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 96, "page_size": 4,
                       "max_running_requests": 8, "chunked_prefill_size": 64}], "algorithm": "single"}
    with RoutedLLM(cfg) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
        stats = llm.entry.stats()["small"]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert stats.preemptions > 0  # eight requests of up to 64 tokens in a 96-token pool
    assert stats.live_requests == 0 and stats.free_pages + stats.cached_pages == stats.total_pages

"""Our logits equal transformers' on the same weights, through every path a token can take."""

from __future__ import annotations

import pytest
import torch
from engine_utils import Logits, add, make_engine, max_logit_diff, prompts_of, run_to_end

TOL = 1e-4
ARCHS = ["llama", "qwen3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_different_lengths(arch, model_paths, hf_models):
    eng = make_engine(model_paths[arch])
    reqs = add(eng, prompts_of([1, 5, 17, 33, 64, 2]), max_tokens=6, ignore_eos=True)
    logits: Logits = {}
    run_to_end(eng, logits)
    assert all(len(logits[r.rid]) == 6 for r in reqs)
    assert max_logit_diff(hf_models[arch], reqs, logits) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [16, 23, 40])
def test_chunked_prefill(arch, chunk, model_paths, hf_models):
    eng = make_engine(model_paths[arch], chunked_prefill_size=chunk, max_running_requests=4)
    reqs = add(eng, prompts_of([70, 9, 41], seed=3), max_tokens=5, ignore_eos=True)
    logits: Logits = {}
    run_to_end(eng, logits)
    # The 70-token prompt cannot fit one step, so it really was split.
    assert eng.stats.steps > 70 // chunk
    assert max_logit_diff(hf_models[arch], reqs, logits) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_after_prefix_hit(arch, model_paths, hf_models):
    eng = make_engine(model_paths[arch])
    shared = prompts_of([30], seed=4)[0]
    first = add(eng, [shared + [7, 8, 9]], max_tokens=4, ignore_eos=True)
    run_to_end(eng)
    second = add(eng, [shared + [1, 2]], max_tokens=8, ignore_eos=True)
    logits: Logits = {}
    run_to_end(eng, logits)
    assert first[0].finished
    assert second[0].prefix_hit_tokens == 28  # 30 shared tokens, page size 4
    assert max_logit_diff(hf_models[arch], second, logits) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_after_preemption(arch, model_paths, hf_models):
    # 12 pages of 4 tokens cannot hold four requests growing to 30 tokens each.
    eng = make_engine(model_paths[arch], kv_cache_tokens=48, max_running_requests=4, chunked_prefill_size=64)
    reqs = add(eng, prompts_of([10, 12, 8, 11], seed=5), max_tokens=18, ignore_eos=True)
    logits: Logits = {}
    run_to_end(eng, logits)
    assert eng.scheduler.num_preemptions > 0
    assert all(r.num_output == 18 for r in reqs)
    assert max_logit_diff(hf_models[arch], reqs, logits) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(arch, model_paths, hf_models):
    from tokenrouter import LLM, SamplingParams

    llm = LLM(str(model_paths[arch]), kv_cache_tokens=4096, page_size=4, device="cpu")
    prompts = prompts_of([3, 9, 14, 20, 27, 33, 5, 40], seed=6)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    batch = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    single = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)
    hf = hf_models[arch]
    for prompt, out in zip(prompts, batch):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert single[0].outputs[0].token_ids == batch[0].outputs[0].token_ids
    llm.engine.check_integrity()

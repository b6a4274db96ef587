"""Our logits equal transformers' on the same weights, through every path a token can take."""

from __future__ import annotations

import pytest
import torch
from engine_utils import Logits, add, make_engine, max_logit_diff, prompts_of, run_to_end

TOL = 1e-4
ARCHS = ["llama", "qwen2", "qwen3"]


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


def half_precision_diff(hf: torch.nn.Module, reqs, logits: Logits) -> tuple[float, float]:
    """Largest |ours - reference| over every sampled row, and the largest |reference logit|."""
    worst = scale = 0.0
    device = next(hf.parameters()).device
    for req in reqs:
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([req.tokens], device=device)).logits[0].float()
        scale = max(scale, ref.abs().max().item())
        for pos, row in logits[req.rid]:
            worst = max(worst, (ref[pos] - row.to(device).float()).abs().max().item())
    return worst, scale


# Half precision against the float32 reference: within 1% (float16) or 5% (bfloat16) of the largest
# logit. Measured on CPU: float16 0.07% (llama) and 0.03% (qwen3), bfloat16 0.6% and 0.25%.
HALF_TOL = {"float16": 1e-2, "bfloat16": 5e-2}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_cpu(arch, dtype, model_paths, hf_models):
    eng = make_engine(model_paths[arch], dtype=dtype)
    assert eng.pool.k.dtype == getattr(torch, dtype)
    reqs = add(eng, prompts_of([1, 5, 17, 33], seed=3), max_tokens=6, ignore_eos=True)
    logits: Logits = {}
    run_to_end(eng, logits)
    worst, scale = half_precision_diff(hf_models[arch], reqs, logits)
    assert worst <= HALF_TOL[dtype] * scale, f"{dtype}: max diff {worst} vs largest logit {scale}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_logits_match_transformers_on_cuda(arch, dtype, model_paths):
    """On a GPU: our engine in each dtype against transformers' float32 forward on the same device
    (float32 within 1e-3, or 1e-4 of the largest logit: GPU kernels reorder sums)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_paths[arch], dtype=torch.float32).to("cuda").eval()
    eng = make_engine(model_paths[arch], dtype=dtype, device="cuda")
    assert eng.pool.k.device.type == "cuda" and eng.pool.k.dtype == getattr(torch, dtype)
    reqs = add(eng, prompts_of([1, 5, 17, 33, 64, 2]), max_tokens=6, ignore_eos=True)
    logits: Logits = {}
    run_to_end(eng, logits)
    assert all(len(logits[r.rid]) == 6 for r in reqs)
    worst, scale = half_precision_diff(hf, reqs, logits)
    tol = max(1e-3, 1e-4 * scale) if dtype == "float32" else HALF_TOL[dtype] * scale
    assert worst <= tol, f"{dtype} on cuda: max diff {worst} (largest logit {scale})"


def test_qwen2_with_a_released_config_writes_transformers_greedy_tokens(model_paths, tmp_path):
    """The tiny Qwen2 under the config.json fields DeepSeek-R1-Distill-Qwen ships (transformers 5 writes
    them otherwise): a sliding window use_sliding_window turns off, a top-level rope_theta, use_mrope."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from tokenrouter import LLM, SamplingParams

    folder = shutil.copytree(model_paths["qwen2"], tmp_path / "qwen2")
    config = json.loads((folder / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    del config["layer_types"]
    config.update(rope_theta=theta, sliding_window=32, use_sliding_window=False, max_window_layers=1,
                  use_mrope=False)
    (folder / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), kv_cache_tokens=1024, page_size=4, device="cpu")
    assert llm.engine.model_config.architecture == "qwen2"
    prompts = prompts_of([5, 40, 70], seed=7)  # longer than the window: it must stay off
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=16, temperature=0.0),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_tokenrouter_serve_writes_transformers_greedy_tokens_for_qwen2(model_paths):
    """`tokenrouter serve --model-path` on the tiny Qwen2 (q/k/v bias, no o_proj bias) answers token-id
    prompts with transformers' greedy tokens, through the HTTP server."""
    import httpx
    from server_utils import ServerProcess
    from transformers import AutoModelForCausalLM

    folder = model_paths["qwen2"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    srv = ServerProcess(["--model-path", str(folder), "--served-model-name", "q", "--kv-cache-tokens", "2048",
                         "--page-size", "4"])
    try:
        for prompt in prompts_of([6, 33], seed=11):
            body = {"model": "q", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True}
            out = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
            assert out["token_ids"] == ref[0, len(prompt):].tolist()
    finally:
        srv.stop()

"""Tensor parallelism on CPU with gloo: TP=2 computes what TP=1 computes.

Rank 0 is the test process (the engine); rank 1 a worker process the engine spawns. The tiny models
have 4 query heads, 2 KV heads and an even MLP width, so TP=2 gives each rank 2 query heads, 1 KV
head, half the MLP and half the vocabulary.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
from engine_utils import Logits, add, check_exact, make_engine, max_logit_diff, prompts_of, run_to_end

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_loader import _iter_safetensors, load_model
from tokenrouter.engine.req import Req
from tokenrouter.models import build_model
from tokenrouter.models.config import ModelConfig
from tokenrouter.models.tp_group import TPGroup
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.sampling_params import SamplingParams


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _drive(engine: Engine, logits: Logits) -> tuple[list[Req], list[list[int]]]:
    """Requests in two waves over a shared prefix: the second wave prefills (in chunks, some from the
    prefix cache) while the first decodes. Returns the requests and every step's extend lengths."""
    seen: list[list[int]] = []
    run = engine.runner.run

    def spy(reqs, extend_lens):
        seen.append(list(extend_lens))
        return run(reqs, extend_lens)

    engine.runner.run = spy  # type: ignore[method-assign]
    shared = prompts_of([12], seed=5)[0]
    first = add(engine, [shared + p for p in prompts_of([3, 9], seed=6)] + prompts_of([1], seed=7), max_tokens=12)
    for _ in range(3):
        engine.step()
    second = add(engine, [shared + p for p in prompts_of([20, 5], seed=8)] + prompts_of([40], seed=9), max_tokens=6)
    run_to_end(engine, logits)
    return first + second, seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_logits_equal_tp1_over_mixed_batches(model_paths, hf_models, arch):
    cfg = ModelConfig.from_folder(model_paths[arch])
    assert cfg.num_heads % 2 == 0 and cfg.num_kv_heads % 2 == 0 and cfg.intermediate_size % 2 == 0
    results = {}
    for tp in (1, 2):
        engine = make_engine(model_paths[arch], tp_size=tp, chunked_prefill_size=16)
        try:
            if tp == 2:
                # Rank 0 holds its own KV heads and vocabulary slice only.
                assert engine.pool.k.shape[2] == cfg.num_kv_heads // 2
                assert engine.model.model.embed_tokens.weight.shape[0] == (cfg.vocab_size + 1) // 2
                assert engine.model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == \
                    (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // 2
            logits: Logits = {}
            reqs, seen = _drive(engine, logits)
            results[tp] = reqs, logits
        finally:
            engine.shutdown()
    # Some step mixed decodes with prefills, and some prefill was chunked over a cached prefix.
    assert any(1 in ext and max(ext) > 1 for ext in seen)
    reqs1, logits1 = results[1]
    reqs2, logits2 = results[2]
    assert [r.tokens for r in reqs1] == [r.tokens for r in reqs2]
    worst = 0.0
    assert logits1.keys() == logits2.keys()
    for rid, rows in logits1.items():
        assert [p for p, _ in rows] == [p for p, _ in logits2[rid]]
        for (_, a), (_, b) in zip(rows, logits2[rid]):
            assert a.shape == b.shape == (cfg.vocab_size,)
            worst = max(worst, (a - b).abs().max().item())
    assert worst <= 1e-4
    assert max_logit_diff(hf_models[arch], reqs2, logits2) <= 1e-4  # and both agree with transformers


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_generation_equals_tp1(model_paths, arch):
    prompts = prompts_of([4, 11, 23, 2, 17], seed=21)
    out = {}
    for tp in (1, 2):
        engine = make_engine(model_paths[arch], tp_size=tp)
        try:
            reqs = add(engine, prompts, max_tokens=24, ignore_eos=True)
            run_to_end(engine)
            out[tp] = [r.tokens[r.prompt_len:] for r in reqs]
        finally:
            engine.shutdown()
    assert out[1] == out[2] and all(len(t) == 24 for t in out[2])


def test_each_rank_loads_only_its_slices(model_paths):
    """Shards read with get_slice equal whole tensors cut in load_weights, and the ranks' fused
    q/k/v and gate/up rows are each rank's heads' q, k, v and its slice of gate and up."""
    path = model_paths["llama"]
    cfg = ModelConfig.from_folder(path)
    full = load_model(path, torch.float32, torch.device("cpu"))
    q, kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    fq, fk, fv = full.model.layers[1].self_attn.qkv_proj.weight.split([q, kv, kv])
    for rank in (0, 1):
        tp = TPGroup(rank, 2)  # no backend: building and loading need no collective
        sliced = load_model(path, torch.float32, torch.device("cpu"), tp)
        with torch.device("cpu"):
            cut = build_model(cfg, tp)
        cut.load_weights(_iter_safetensors(sorted(path.glob("*.safetensors"))))  # whole tensors
        for (name, a), (_, b) in zip(sliced.named_parameters(), cut.named_parameters()):
            assert torch.equal(a, b), name
        w = sliced.model.layers[1].self_attn.qkv_proj.weight
        hq, hkv = q // 2, kv // 2
        assert torch.equal(w[:hq], fq[rank * hq:(rank + 1) * hq])
        assert torch.equal(w[hq:hq + hkv], fk[rank * hkv:(rank + 1) * hkv])
        assert torch.equal(w[hq + hkv:], fv[rank * hkv:(rank + 1) * hkv])
        assert hkv == d  # one KV head per rank
        i = cfg.intermediate_size // 2
        gu = sliced.model.layers[0].mlp.gate_up_proj.weight
        fgu = full.model.layers[0].mlp.gate_up_proj.weight
        assert torch.equal(gu[:i], fgu[rank * i:(rank + 1) * i])
        assert torch.equal(gu[i:], fgu[cfg.intermediate_size + rank * i:cfg.intermediate_size + (rank + 1) * i])
        o = sliced.model.layers[0].self_attn.o_proj.weight
        assert torch.equal(o, full.model.layers[0].self_attn.o_proj.weight[:, rank * hq:(rank + 1) * hq])


def test_qwen2_ranks_hold_their_heads_q_k_v_bias_and_no_o_proj_bias(model_paths):
    """The fused q/k/v bias is cut as its weight's rows are: rank r holds [q_r; k_r; v_r] of q_proj.bias,
    k_proj.bias and v_proj.bias, read cut or whole; o_proj has no bias to add after the all-reduce."""
    from safetensors.torch import load_file

    path = model_paths["qwen2"]
    cfg = ModelConfig.from_folder(path)
    whole = load_file(str(path / "model.safetensors"))
    hq, hkv = cfg.num_heads * cfg.head_dim // 2, cfg.num_kv_heads * cfg.head_dim // 2
    for rank in (0, 1):
        tp = TPGroup(rank, 2)  # no backend: building and loading need no collective
        sliced = load_model(path, torch.float32, torch.device("cpu"), tp)
        with torch.device("cpu"):
            cut = build_model(cfg, tp)
        cut.load_weights(whole.items())
        for layer in range(cfg.num_layers):
            prefix = f"model.layers.{layer}.self_attn"
            expected = torch.cat([whole[f"{prefix}.q_proj.bias"][rank * hq:(rank + 1) * hq],
                                  whole[f"{prefix}.k_proj.bias"][rank * hkv:(rank + 1) * hkv],
                                  whole[f"{prefix}.v_proj.bias"][rank * hkv:(rank + 1) * hkv]])
            for model in (sliced, cut):
                attn = model.model.layers[layer].self_attn
                assert torch.equal(attn.qkv_proj.bias, expected)
                assert attn.o_proj.bias is None
                assert torch.equal(model.checkpoint_tensor(f"{prefix}.k_proj.bias"),
                                   whole[f"{prefix}.k_proj.bias"][rank * hkv:(rank + 1) * hkv])


def test_bad_tp_size_is_a_clear_error(model_paths):
    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide num_attention_heads 4, num_key_value_heads 2"):
        make_engine(model_paths["llama"], tp_size=3)
    assert {c.pid for c in psutil.Process().children()} <= before  # nothing was spawned
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        EngineConfig(model_path=str(model_paths["llama"]), tp_size=0)


def test_no_orphans_after_shutdown_and_a_dead_worker_is_an_error(model_paths):
    engine = make_engine(model_paths["llama"], tp_size=2)
    assert engine.tp is not None
    pids = engine.tp.pids
    assert len(pids) == 1 and not _gone(pids[0])
    add(engine, prompts_of([6], seed=1), max_tokens=3)
    run_to_end(engine)
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert all(_gone(p) for p in pids)

    engine = make_engine(model_paths["llama"], tp_size=2)
    pid = engine.tp.pids[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    add(engine, prompts_of([6], seed=1), max_tokens=3)
    with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1 .* exited"):
        engine.step()  # a collective with a dead rank fails at once, it does not hang
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_pair(pair_paths):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for n, path in pair_paths.items()}


def test_routed_pair_with_the_large_model_at_tp2_is_token_exact(pair_paths, hf_pair):
    group = {
        "models": [
            {"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 4096, "page_size": 4},
            {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 4096, "page_size": 4,
             "tp_size": 2},
        ],
        "algorithm": {"name": "bernoulli", "p": 0.5},
    }
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with RoutedLLM(group) as llm:
        large = psutil.Process(llm.entry.procs["large"].pid)
        workers = [c.pid for c in large.children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 1
        for batch in (1, 4, 16):
            prompts = prompts_of([3 + (7 * i) % 29 for i in range(batch)], seed=300 + batch)
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
            checked = 0
            written = {"small": 0, "large": 0}
            for prompt, out in zip(prompts, outs):
                c = out.outputs[0]
                assert len(c.token_ids) == 10 and c.token_models is not None
                checked += check_exact(hf_pair, prompt, c.token_ids, c.token_models)
                for m in c.token_models:
                    written[m] += 1
            assert checked >= 9 * batch
            if batch == 16:
                assert written["large"] > 0 and written["small"] > 0
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in workers), "a tensor-parallel worker outlived its subserver"


def test_routed_bad_tp_size_fails_clearly(pair_paths):
    from tokenrouter.runtime.entry.entry import SubserverDied

    group = {"models": [{"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 256,
                         "page_size": 4, "tp_size": 3}]}
    with pytest.raises(SubserverDied, match="tp_size 3 does not divide"):
        with RoutedLLM(group):
            pass
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        RoutedLLM({"models": [{"name": "large", "path": str(pair_paths["large"]), "tp_size": 0}]})

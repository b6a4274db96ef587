"""Engine behaviour through the offline API: prefix reuse, small pools, stopping, sampling, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from engine_utils import prompts_of

from tokenrouter import LLM, SamplingParams
from tokenrouter.models.config import ModelLoadError


@pytest.fixture(scope="module")
def llm(model_paths):
    eng = LLM(str(model_paths["llama"]), kv_cache_tokens=2048, page_size=4, device="cpu")
    yield eng
    eng.engine.check_integrity()


@pytest.fixture(autouse=True)
def integrity_after_each_test(request, monkeypatch):
    """After every test, each engine it used (the module's and any it built) holds no request, no locked
    prefix page, and passes check_integrity (free + cached + in use == total)."""
    built: list[LLM] = []
    real_init = LLM.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(LLM, "__init__", recording_init)
    yield
    engines = [x.engine for x in built]
    if "llm" in request.fixturenames:
        engines.append(request.getfixturevalue("llm").engine)
    for eng in engines:
        assert not eng.has_unfinished(), f"{sorted(eng.reqs)} still live after the test"
        assert eng.cache.locked_pages == 0, f"{eng.cache.locked_pages} prefix pages still locked"
        eng.check_integrity()


def gen(llm, prompts, **params):
    params.setdefault("temperature", 0.0)
    return llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**params), use_tqdm=False)


def test_shared_prefix_computes_only_new_tokens(llm):
    llm.engine.cache.reset()
    shared = prompts_of([40], seed=10)[0]
    first = gen(llm, [shared + [5, 6, 7]], max_tokens=4, ignore_eos=True)[0]
    assert first.metrics.num_cached_tokens == 0
    second = gen(llm, [shared + [9, 9]], max_tokens=4, ignore_eos=True)[0]
    # 40 shared tokens = 10 whole pages; the rest (2 prompt tokens) and 3 decode steps run.
    assert second.metrics.num_cached_tokens == 40
    assert second.metrics.num_computed_tokens == 2 + 3
    assert first.metrics.num_computed_tokens == 43 + 3
    llm.engine.check_integrity()


def test_small_pool_gives_the_same_outputs(model_paths, llm):
    prompts = prompts_of([9, 30, 17, 25, 12, 40, 21, 6], seed=11)
    ref = gen(llm, prompts, max_tokens=24, ignore_eos=True)
    small = LLM(str(model_paths["llama"]), kv_cache_tokens=80, page_size=4, max_running_requests=8,
                chunked_prefill_size=32, device="cpu")
    outs = gen(small, prompts, max_tokens=24, ignore_eos=True)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    small.engine.check_integrity()
    assert small.engine.cache.locked_pages == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompts = prompts_of([8, 15, 3], seed=12)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    together = llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
    alone = llm.generate(prompt_token_ids=prompts[1:2], sampling_params=p, use_tqdm=False)
    assert together[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    other = llm.generate(prompt_token_ids=prompts[1:2], use_tqdm=False,
                         sampling_params=SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_stop_token_ids_and_max_tokens(llm):
    prompt = prompts_of([10], seed=13)
    free = gen(llm, prompt, max_tokens=10, ignore_eos=True)[0].outputs[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    stopped = gen(llm, prompt, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_tok])[0].outputs[0]
    assert stopped.token_ids == free.token_ids[:first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_tok)
    assert free.finish_reason == "length" and len(free.token_ids) == 10


def test_stop_strings(llm):
    tok = llm.get_tokenizer()
    prompt = prompts_of([12], seed=14)
    free = gen(llm, prompt, max_tokens=20, ignore_eos=True)[0].outputs[0]
    text = tok.decode(free.token_ids[6:9])  # a stop string that the free run is sure to produce
    stop = text.strip("\ufffd")[:2] or text
    cut = free.text.find(stop)
    assert cut >= 0
    out = gen(llm, prompt, max_tokens=20, ignore_eos=True, stop=[stop])[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]
    kept = gen(llm, prompt, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept[0].outputs[0].text == free.text[:cut + len(stop)]


def test_logprobs(llm):
    out = gen(llm, prompts_of([7], seed=15), max_tokens=5, ignore_eos=True, logprobs=3)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) <= 4
        best = max(entry.values())
        assert entry[tok] == pytest.approx(best)  # greedy picks the most likely token
        assert all(v <= 0 for v in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_eos_finishes_unless_ignored(model_paths):
    path = model_paths["llama"]
    llm = LLM(str(path), kv_cache_tokens=1024, page_size=4, device="cpu")
    prompt = prompts_of([6], seed=16)
    free = gen(llm, prompt, max_tokens=8, ignore_eos=True)[0].outputs[0]
    # Make the fourth generated token the EOS and check that generation stops there.
    llm.engine.eos_token_ids = {free.token_ids[3]}
    stopped = gen(llm, prompt, max_tokens=8)[0].outputs[0]
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(free.token_ids[3]) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert gen(llm, prompt, max_tokens=8, ignore_eos=True)[0].outputs[0].token_ids == free.token_ids


def test_text_prompts_and_dicts(llm):
    outs = llm.generate(["hello", {"prompt": "héllo wörld"}, {"prompt_token_ids": [1, 2, 3]}],
                        SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert tok.decode(outs[0].prompt_token_ids) == "hello" and len(outs[0].prompt_token_ids) == 5
    assert len(outs[1].prompt_token_ids) == len("héllo wörld".encode())  # byte-level: one token a byte
    assert outs[2].prompt_token_ids == [1, 2, 3]
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)


@pytest.mark.parametrize("bad,message", [
    (dict(prompt_token_ids=[[]]), "prompt is empty"),
    (dict(prompts=[""]), "prompt is empty"),
    (dict(prompt_token_ids=[[1] * 600]), "context"),
    (dict(prompt_token_ids=[[1, 99999]]), "token ids"),
])
def test_bad_prompts_raise_and_engine_keeps_serving(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(**bad, sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    out = gen(llm, [[1, 2, 3]], max_tokens=2, ignore_eos=True)
    assert len(out[0].outputs[0].token_ids) == 2
    llm.engine.check_integrity()


@pytest.mark.parametrize("field,kw", [
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-5)),
    ("temperature", dict(temperature=-1.0)),
    ("top_p", dict(top_p=0.0)),
    ("top_k", dict(top_k=-3)),
])
def test_bad_sampling_params(field, kw):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ModelLoadError, match="not a folder"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        LLM(str(tmp_path))


def test_missing_weights(tmp_path, model_paths):
    cfg = json.loads((model_paths["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(tmp_path))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_unknown_llm_argument(model_paths):
    with pytest.raises(TypeError, match="max_num_seqz"):
        LLM(str(model_paths["llama"]), max_num_seqz=3)


def test_bfloat16_runs(model_paths):
    llm = LLM(str(model_paths["qwen3"]), dtype="bfloat16", kv_cache_tokens=512, page_size=4, device="cpu")
    assert llm.engine.pool.k.dtype == torch.bfloat16
    out = gen(llm, prompts_of([9], seed=17), max_tokens=4, ignore_eos=True)
    assert len(out[0].outputs[0].token_ids) == 4


def test_float16_runs(model_paths):
    """float16 is selectable and runs on CPU (this torch has the half-precision CPU kernels); the
    logits stay close to the float32 reference (tests/test_model_parity.py)."""
    llm = LLM(str(model_paths["llama"]), dtype="float16", kv_cache_tokens=512, page_size=4, device="cpu")
    assert llm.engine.pool.k.dtype == torch.float16
    assert all(p.dtype == torch.float16 for p in llm.engine.model.parameters())
    outs = gen(llm, prompts_of([9, 4], seed=18), max_tokens=4, ignore_eos=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)

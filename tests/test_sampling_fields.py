"""logit_bias, min_tokens and the repetition / frequency / presence penalties: the vectorised logits
processing equals a plain per-row reference, each field changes the output as specified, and a routed
pair applies them token-exactly (each greedy token is the argmax of the writer's processed logits)."""

from __future__ import annotations

import math

import pytest
import torch
from engine_utils import prompts_of
from sampling_utils import check_processed_greedy, reference

from tokenrouter import LLM, SamplingParams
from tokenrouter.engine.logits_processing import process_logits
from tokenrouter.engine.req import Req
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.messages import AddReq, decode, encode

EOS_REF = 7  # the EOS id of the reference computations on random logits


def req(tokens: list[int], prompt_len: int, **kw) -> Req:
    return Req(rid="r", tokens=list(tokens), prompt_len=prompt_len, params=SamplingParams(**kw), seed=0)


# ---- the processing on random logits ------------------------------------------------------------

def test_no_field_no_work():
    logits = torch.randn(3, 50)
    reqs = [req([1, 2, 3, 4], 2), req([5, 6], 1, temperature=0.5), req([9], 1, stop_token_ids=[3])]
    assert process_logits(logits, reqs, {EOS_REF}) is logits


def test_matches_the_reference_row_by_row():
    g = torch.Generator().manual_seed(0)
    vocab = 40
    toks = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 14, 6, 20, 11)]
    cases = [
        (toks[0], 4, {}),  # untouched in a batch where others are processed
        (toks[1], 5, {"repetition_penalty": 1.7, "frequency_penalty": 0.6, "presence_penalty": -0.4}),
        (toks[2], 6, {"logit_bias": {3: 5.0, 11: -100.0}, "min_tokens": 2, "stop_token_ids": [2]}),
        (toks[3], 2, {"repetition_penalty": 0.6, "logit_bias": {0: 1.5}}),
        (toks[4], 3, {"frequency_penalty": 2.0, "min_tokens": 30, "ignore_eos": True, "stop_token_ids": [5, 6],
                      "max_tokens": 40}),
    ]
    reqs = [req(t, n, **kw) for t, n, kw in cases]
    logits = torch.randn(len(cases), vocab, generator=g) * 3
    before = logits.clone()
    out = process_logits(logits, reqs, {EOS_REF})
    assert torch.equal(logits, before), "the model's own logits are left for logprobs and routing signals"
    for i, r in enumerate(reqs):
        ref = reference(logits[i], r.tokens, r.prompt_len, r.params, {EOS_REF})
        torch.testing.assert_close(out[i], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0], logits[0])
    assert out[2, EOS_REF] == -math.inf and out[2, 2] == -math.inf  # below min_tokens: EOS and stop ids masked
    assert out[4, EOS_REF] != -math.inf and out[4, 5] == -math.inf  # ignore_eos: EOS is no stop, so not masked


def test_min_tokens_mask_lifts_once_reached():
    logits = torch.zeros(1, 20)
    held = req([1, 2, 3], 1, min_tokens=3, max_tokens=5)  # 2 out: still held
    free = req([1, 2, 3, 4], 1, min_tokens=3, max_tokens=5)  # 3 out: free
    assert process_logits(logits, [held], {EOS_REF})[0, EOS_REF] == -math.inf
    assert process_logits(logits, [free], {EOS_REF}) is logits


@pytest.mark.parametrize("kw,field", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={500: 1.0}).check_vocab(320)


def test_fields_cross_process_boundaries():
    p = SamplingParams(logit_bias={5: 2.5, 7: -100.0}, min_tokens=3, repetition_penalty=1.2, frequency_penalty=0.5,
                       presence_penalty=-0.5)
    got = decode(encode(AddReq("a", [1, 2], p, 3)))
    assert isinstance(got, AddReq) and got.params == p and all(isinstance(t, int) for t in got.params.logit_bias)


# ---- through a routed pair ----------------------------------------------------------------------

def group(pair_paths, p: float) -> dict:
    return {
        "models": [
            {"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 4096, "page_size": 4},
            {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 4096, "page_size": 4},
        ],
        "algorithm": {"name": "bernoulli", "p": p},
    }


@pytest.fixture(scope="module")
def routed(pair_paths):
    with RoutedLLM(group(pair_paths, 0.5)) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_pair(pair_paths):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for n, path in pair_paths.items()}


@pytest.fixture(scope="module")
def eos(routed) -> int:
    return int(routed.get_tokenizer().eos_token_id)


def generate(llm, prompts, params):
    extra = {"timeout": 120} if isinstance(llm, RoutedLLM) else {}
    return [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False,
                                               **extra)]


def test_penalties_are_token_exact_through_a_routed_pair(routed, hf_pair, eos):
    prompts = prompts_of([5, 9, 14], seed=21)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.7, presence_penalty=0.3, logit_bias={17: 0.8, 40: -2.0})
    plain = generate(routed, prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    outs = generate(routed, prompts, params)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain], "the penalties change the output"
    writers: list[str] = []
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 14 and out.token_models is not None
        writers += check_processed_greedy(hf_pair, prompt, out.token_ids, out.token_models, params, {eos})
    assert len(writers) >= 36 and set(writers) == {"small", "large"}


def test_a_group_of_one_equals_the_single_engine(pair_paths):
    prompts = prompts_of([6, 11], seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, logit_bias={3: 1.0})
    alone = generate(LLM(str(pair_paths["small"]), kv_cache_tokens=2048, page_size=4, device="cpu"), prompts, params)
    with RoutedLLM(group(pair_paths, 0.0)) as llm:
        routed = generate(llm, prompts, params)
    assert [o.token_ids for o in routed] == [o.token_ids for o in alone]


def test_logit_bias_plus_100_makes_greedy_and_sampling_pick_the_token(routed):
    prompts = prompts_of([4, 10], seed=3)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=9, ignore_eos=True, logit_bias={42: 100})
        for out in generate(routed, prompts, params):
            assert out.token_ids == [42] * 8


def test_min_tokens_holds_eos_back(routed, eos):
    prompts = prompts_of([5], seed=4)
    eager = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100})
    assert generate(routed, prompts, eager)[0].token_ids == [eos]
    out = generate(routed, prompts, SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100},
                                                   min_tokens=5))[0]
    assert len(out.token_ids) == 6 and eos not in out.token_ids[:5] and out.token_ids[5] == eos
    assert out.finish_reason == "stop"


def test_min_tokens_holds_stop_token_ids_back(routed):
    prompts = prompts_of([7], seed=6)
    out = generate(routed, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[33], logit_bias={33: 100}, min_tokens=3))[0]
    assert len(out.token_ids) == 4 and 33 not in out.token_ids[:3] and out.stop_reason == 33


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_holds_stop_strings_back(routed, include):
    tok = routed.get_tokenizer()
    a = tok.convert_tokens_to_ids("a")
    prompts = prompts_of([5], seed=2)
    out = generate(routed, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=["a"],
                                                   logit_bias={a: 100}, min_tokens=3,
                                                   include_stop_str_in_output=include))[0]
    # Tokens 1..3 are under min_tokens, so the stop string is found in the 4th.
    assert out.token_ids == [a] * 4 and out.finish_reason == "stop" and out.stop_reason == "a"
    assert out.text == ("aaaa" if include else "aaa")


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_and_stop_strings_in_the_single_engine(pair_paths, include):
    llm = LLM(str(pair_paths["small"]), kv_cache_tokens=2048, page_size=4, device="cpu")
    a = llm.get_tokenizer().convert_tokens_to_ids("a")
    out = generate(llm, prompts_of([5], seed=2), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                                stop=["a"], logit_bias={a: 100}, min_tokens=3,
                                                                include_stop_str_in_output=include))[0]
    assert out.token_ids == [a] * 4 and out.finish_reason == "stop" and out.text == ("aaaa" if include else "aaa")

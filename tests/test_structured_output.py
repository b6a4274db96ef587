"""Structured output (response_format json_object / json_schema) through a routed pair of random-weight
models: the server with the openai client (streaming and not) on a Bernoulli pair, every built-in
algorithm through RoutedLLM (the same runtime without the HTTP layer: one server start each would cost
minutes of CI), the offline LLM, invalid schemas, the max_tokens cut-off, hand-offs, rewrites and
preemption in the middle of a grammar."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from routing_utils import untrained_routers
from server_utils import ServerProcess, pair_group_yaml

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.llm import LLM
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.routing.registry import BUILTIN_ALGORITHMS
from tokenrouter.sampling_params import SamplingParams, StructuredOutput

MODEL = "pair"
# Short, fully bounded outputs, so random weights finish them within a few dozen byte-level tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "n", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 48  # the longest instance, '{"answer": "maybe", "n": 9, "ok": false}', is 41 bytes, then EOS


def check_instance(text: str) -> None:
    """The schema, checked by hand (jsonschema is not a dependency)."""
    obj = json.loads(text)
    assert set(obj) == {"answer", "n", "ok"}, text
    assert obj["answer"] in ("yes", "no", "maybe"), text
    assert type(obj["n"]) is int and 0 <= obj["n"] <= 9, text
    assert type(obj["ok"]) is bool, text


def algorithm_config(name: str, routers: dict) -> dict:
    if name in ("citer", "r2r", "co_llm"):
        return {"name": name, "router": str(routers[name])}
    if name == "bernoulli":
        return {"name": name, "p": 0.5}
    if name == "r_stitch":
        return {"name": name, "tau": 0.5}
    return {"name": name}


@pytest.fixture(scope="module")
def routers(pair_paths, tmp_path_factory):
    return untrained_routers(pair_paths, tmp_path_factory.mktemp("routers"))


@pytest.fixture(scope="module")
def tokenizer(pair_paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair_paths["small"])


def braces_bias(tokenizer) -> dict[int, float]:
    """Makes '{}' then EOS the likeliest path: a json_object that random weights finish."""
    return {tokenizer.convert_tokens_to_ids("{"): 60.0, tokenizer.convert_tokens_to_ids("}"): 60.0,
            tokenizer.eos_token_id: 60.0}


# ---- through the server (a Bernoulli pair) ----------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    cfg = pair_group_yaml(tmp_path_factory.mktemp("srv"), pair_paths, p=0.5, name=MODEL)
    srv = ServerProcess(["--config", str(cfg), "--grace-period", "5"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_json_schema_through_the_server(client, tokenizer):
    messages = [{"role": "user", "content": "verdict?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0,
                                       seed=5, n=2, response_format=RESPONSE_FORMAT)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        check_instance(choice.message.content)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                                            stream=True, response_format=RESPONSE_FORMAT)
    chunks = list(stream)
    check_instance("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # vLLM takes response_format on /v1/completions too; json_object, steered to finish quickly.
    c = client.completions.create(model=MODEL, prompt="obj:", max_tokens=8, temperature=0.0,
                                  logit_bias={str(k): v for k, v in braces_bias(tokenizer).items()},
                                  extra_body={"response_format": {"type": "json_object"}})
    assert c.choices[0].finish_reason == "stop" and json.loads(c.choices[0].text) == {}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


BAD_FORMATS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}},
     "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}, "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
    ({"type": "yaml"}, "type must be"),
]


def test_a_bad_response_format_is_a_400_naming_it(server):
    for response_format, needle in BAD_FORMATS:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = post(server, path, {**body, "max_tokens": 4, "response_format": response_format})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "response_format" and needle in err["message"], err
    # the server keeps serving
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_max_tokens_cut_off_is_length(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                       temperature=0.0, response_format=RESPONSE_FORMAT)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == '{"answ'  # the only path the grammar allows, cut at 6 tokens
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       temperature=1.0, seed=2, stream=True, response_format={"type": "json_object"})
    chunks = list(r)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_handoffs_inside_the_grammar(server):
    """Both models write tokens of each object: every model masks with the grammar state of the whole
    output, whoever wrote it."""
    r = post(server, "/v1/completions", {
        "prompt": [11, 200, 37], "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 9, "n": 4,
        "return_token_ids": True, "response_format": RESPONSE_FORMAT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["routing"]["handoffs"] > 0 and set(body["routing"]["tokens_per_model"]) == {"small", "large"}
    for choice in body["choices"]:
        check_instance(choice["text"])


# ---- offline ----------------------------------------------------------------------------------------

def test_offline_llm(pair_paths, tokenizer):
    llm = LLM(str(pair_paths["small"]), kv_cache_tokens=2048, page_size=4)
    so = StructuredOutput(json=SCHEMA)
    outs = llm.generate(["a", "bc", "def"], [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=i,
                                                            structured_output=so)
                                              for i, t in enumerate((0.0, 1.0, 1.5))])
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        check_instance(o.outputs[0].text)
    # ignore_eos: the grammar still ends the request when it is complete
    o = llm.generate(["x"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias=braces_bias(
        tokenizer), structured_output=StructuredOutput(json_object=True)))[0].outputs[0]
    assert (o.text, o.finish_reason, o.token_ids[-1]) == ("{}", "stop", tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="invalid JSON schema"):
        llm.generate(["x"], SamplingParams(structured_output=StructuredOutput(json={"type": 3})))


@pytest.mark.parametrize("algorithm", sorted(BUILTIN_ALGORITHMS))
def test_every_algorithm_writes_valid_json(algorithm, pair_paths, routers):
    cfg = {"models": [{"name": n, "path": str(pair_paths[n]), "kv_cache_tokens": 4096, "page_size": 4}
                      for n in ("small", "large")], "algorithm": algorithm_config(algorithm, routers)}
    so = StructuredOutput(json=SCHEMA)
    with RoutedLLM(cfg) as llm:
        outs = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9], [11, 200, 37]],
                            sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                                           structured_output=so),
                            use_tqdm=False, timeout=120)
        if algorithm == "bernoulli":
            with pytest.raises(ValueError, match="invalid JSON schema"):
                llm.generate(prompt_token_ids=[[5]], sampling_params=SamplingParams(
                    structured_output=StructuredOutput(json={"type": "object", "required": 7})), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        check_instance(o.outputs[0].text)
    if algorithm in ("bernoulli", "ensemble"):  # hand-offs by seeded draws: both models write each object
        assert sum(o.extra["handoffs"] for o in outs) > 0
        assert {m for o in outs for m, n in o.extra["tokens_per_model"].items() if n} == {"small", "large"}


# ---- the matcher's state: rewrites and preemption ---------------------------------------------------

def test_rewrite_rolls_the_matcher_back_and_preemption_keeps_it(pair_paths, tokenizer):
    eng = Engine(EngineConfig(model_path=str(pair_paths["small"]), kv_cache_tokens=64, page_size=4,
                              max_running_requests=4, chunked_prefill_size=64))
    so = StructuredOutput(json=SCHEMA)
    prompt = list(range(3, 23))
    reqs = [eng.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                                   structured_output=so)) for i in range(3)]
    while eng.has_unfinished():  # 3 x (20 + ~40) tokens on a 64-token pool: requests are preempted
        eng.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.finish_reason == "stop"
        check_instance(eng.decode(r.output_ids))
    # A peer rewrites from inside the output: the matcher rolls back and then follows the new tokens.
    req = eng.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=so))
    for _ in range(8):
        eng.step()
    written = req.output_ids
    assert req.grammar is not None and req.grammar.accepted == len(written) == 8
    # What another model wrote from output position 4 on: it chose "no" where greedy chose otherwise.
    peer_suffix = tokenizer.encode('swer": "n', add_special_tokens=False)
    eng.receive(req.rid, req.prompt_len + 4, peer_suffix)
    assert req.grammar.accepted == 4
    while eng.has_unfinished():
        eng.step()
    text = eng.decode(req.output_ids)
    assert text.startswith('{"answer": "no"') and req.finish_reason == "stop"
    check_instance(text)

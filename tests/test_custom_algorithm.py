"""Algorithms from anywhere, the request lifecycle hooks and per-request routing parameters: the
tutorial's budgeted deferral (examples/budgeted_deferral.py, docs/ALGORITHMS.md) imported by real
subservers, and per-request parameters over HTTP."""

from __future__ import annotations

import asyncio
import math
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
import yaml
from engine_utils import check_exact, prompts_of
from routing_utils import Rig

from tokenrouter import SamplingParams
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.routing import algorithm_class, make_algorithm, registered_names
from tokenrouter.routing import registry as registry_module
from tokenrouter.routing.bernoulli import Bernoulli
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import AddReq, Finished

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPEC = f"{EXAMPLES / 'budgeted_deferral.py'}:BudgetedDeferral"
N = 16
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_pair(pair_paths):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for n, p in pair_paths.items()}


def example_group(pair_paths) -> GroupConfig:
    """examples/budgeted_pair.yaml as written, on the test's tiny pair."""
    raw = yaml.safe_load((EXAMPLES / "budgeted_pair.yaml").read_text())
    for m in raw["models"]:
        m.update(path=str(pair_paths[m["name"]]), page_size=4)
    return GroupConfig.from_dict(raw, base=EXAMPLES)


def handoffs_of(models: list[str]) -> int:
    """Hand-offs a deferral performs for these writers: to the large model and back for each large
    token, less the way back after a last token the large model wrote."""
    large = models.count("large")
    return 2 * large - (models[-1] == "large")


def assert_within_budget(models: list[str], budget: float) -> None:
    """At every prefix the large model wrote at most `budget` of the tokens."""
    large = 0
    for n, m in enumerate(models, start=1):
        large += m == "large"
        assert large <= budget * n, f"large share {large}/{n} over the budget {budget}"


def test_specs_fail_clearly_before_anything_starts(tmp_path, monkeypatch, pair_paths):
    cases = {
        "magic": "unknown routing algorithm 'magic'",
        "no_such_pkg.algos:Cascade": "cannot import module 'no_such_pkg.algos'",
        "tokenrouter.routing.bernoulli:Cascade": "module 'tokenrouter.routing.bernoulli' has no class 'Cascade'",
        "tokenrouter.routing.algorithm:Route": "is not a subclass of tokenrouter.routing.RoutingAlgorithm",
        "tokenrouter.routing.deferral:DeferToLarge": "does not implement defer",
        f"{tmp_path / 'missing.py'}:Cascade": "no such file",
    }
    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n")
    cases[f"{broken}:Cascade"] = "cannot import file"
    for spec, why in cases.items():
        with pytest.raises(ValueError, match=why):
            algorithm_class(spec)
        with pytest.raises(ValueError, match=why):  # the group config refuses it: no subserver starts
            GroupConfig.from_dict({"models": [{"name": "small", "path": str(pair_paths["small"])},
                                              {"name": "large", "path": str(pair_paths["large"])}],
                                   "algorithm": {"name": spec}})
    with pytest.raises(ValueError, match="bad parameters"):
        make_algorithm(SPEC, ["small", "large"], {"budgett": 0.1})
    with pytest.raises(ValueError, match="budget: must be a number in"):
        make_algorithm(SPEC, ["small", "large"], {"budget": 1.5})
    with pytest.raises(ValueError, match="reads no router folder"):
        GroupConfig.from_dict({"models": [{"name": "small", "path": str(pair_paths["small"])}],
                               "routers": {"bernoulli": str(tmp_path)}})
    # A relative file spec is found from the config's folder and made absolute for every process.
    assert example_group(pair_paths).algorithm == SPEC

    # An installed package registers names through the entry-point group; built-in names win.
    (tmp_path / "my_lab_algos.py").write_text((EXAMPLES / "budgeted_deferral.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint("budgeted", "my_lab_algos:BudgetedDeferral", registry_module.ENTRY_POINT_GROUP),
           EntryPoint("bernoulli", "my_lab_algos:BudgetedDeferral", registry_module.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry_module, "entry_points",
                        lambda group: [e for e in eps if e.group == group])
    assert algorithm_class("budgeted").__name__ == "BudgetedDeferral"
    assert algorithm_class("bernoulli") is Bernoulli
    assert "budgeted" in registered_names()


def test_hooks_own_per_request_state(pair_paths):
    """In-process subservers: on_start/on_finish bracket each request on each model (finished or
    aborted), per-request parameters reach both models, and Finished counts the PeerReqs sent."""
    rig = Rig(pair_paths, 0.0, algorithm={"name": SPEC, "budget": 0.25, "tau": 0.0})
    try:
        small_alg, large_alg = rig.small.algorithm, rig.large.algorithm
        prompts = prompts_of([5, 9], seed=3)
        budgets = {"a": 0.25, "b": 0.5}
        for (rid, budget), prompt in zip(budgets.items(), prompts):
            routing = {"budget": 0.5, "tau": 0.0} if budget == 0.5 else {}  # "a": the group's defaults
            rig.send("small", AddReq(rid, prompt, GREEDY, seed=1, routing=routing))
        rig.pump(lambda: all(rig.finished(r) for r in budgets), "both finished")
        rig.settle()
        for rid, budget in budgets.items():
            models = [m for m, _, _ in sorted(rig.tokens(rid), key=lambda t: t[1])]
            assert len(models) == N
            # tau 0: every position is unsure, so the large model writes all the budget allows.
            assert models.count("large") == math.floor(budget * N)
            assert_within_budget(models, budget)
            fin: Finished = rig.finished(rid)[0]
            assert fin.handoffs == handoffs_of(models)
        for alg in (small_alg, large_alg):
            assert alg.large_tokens == {} and alg.params_of == {}

        rig.send("small", AddReq("c", prompts[0], GREEDY, seed=1, routing={"budget": 1.0, "tau": 0.0}))
        rig.pump(lambda: "c" in large_alg.params_of, "c reached the large model")
        assert large_alg.params_of["c"] == {"budget": 1.0, "tau": 0.0}  # carried by the first hand-off
        rig.abort("c")
        rig.settle()
        for alg in (small_alg, large_alg):
            assert alg.large_tokens == {} and alg.params_of == {}
        rig.assert_clean("small")
        rig.assert_clean("large")
    finally:
        rig.close()


def test_example_served_by_subserver_processes(pair_paths, hf_pair):
    """The example config as written, subservers in their own processes importing the file; requests
    with different budgets in one batch get different large shares, each token-exact."""
    prompts = prompts_of([4, 7, 11, 6], seed=21)
    routing = [{"budget": 0.1, "tau": 0.0}, {"budget": 0.5, "tau": 0.0}, {"tau": 0.0}, None]
    with RoutedLLM(example_group(pair_paths)) as llm:
        with pytest.raises(ValueError, match="prompt 1: budget: must be a number in"):
            llm.generate(prompt_token_ids=prompts[:2], sampling_params=GREEDY, use_tqdm=False,
                         routing=[{}, {"budget": 2}])
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False, timeout=120,
                            routing=routing)
    used = [o.extra["routing"] for o in outs]
    assert used == [{"budget": 0.1, "tau": 0.0}, {"budget": 0.5, "tau": 0.0}, {"budget": 0.25, "tau": 0.0},
                    {"budget": 0.25, "tau": 0.5}]
    shares = []
    for prompt, out, params in zip(prompts, outs, used):
        c = out.outputs[0]
        assert c.token_models is not None and len(c.token_ids) == N
        assert check_exact(hf_pair, prompt, c.token_ids, c.token_models) >= N - 1
        assert_within_budget(c.token_models, params["budget"])
        if params["tau"] == 0.0:
            assert c.token_models.count("large") == math.floor(params["budget"] * N)
        assert out.extra["handoffs"] == handoffs_of(c.token_models)
        shares.append(c.token_models.count("large") / N)
    assert shares[0] < shares[2] < shares[1]


def test_routing_field_over_http(pair_paths, hf_pair):
    """Two concurrent requests with their own Bernoulli p: the response reports the p used and the
    hand-offs performed (a request the large model writes entirely makes 2N-1), each token-exact; a
    bad routing field is a 400 naming it."""
    import httpx

    from tokenrouter.engine.tokenizer import load_tokenizer
    from tokenrouter.server.app import ServerConfig, build_app
    from tokenrouter.server.async_entry import AsyncEntry

    group = GroupConfig.from_dict({
        "models": [{"name": n, "path": str(pair_paths[n]), "kv_cache_tokens": 2048, "page_size": 4}
                   for n in ("small", "large")],
        "algorithm": {"name": "bernoulli", "p": 0.3}, "name": "pair"})
    runtime = AsyncEntry(group)
    runtime.start(timeout=120)
    prompts = prompts_of([6, 9], seed=5)

    async def run() -> list[httpx.Response]:
        app = build_app(runtime, load_tokenizer(str(pair_paths["small"])), ServerConfig("pair"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as client:
            def body(prompt: list[int], routing: object) -> dict:
                return {"model": "pair", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                        "return_token_ids": True, "routing": routing}

            good = await asyncio.gather(*(client.post("/v1/completions", json=body(p, {"p": v}))
                                          for p, v in zip(prompts, (0.0, 1.0))))
            bad = [await client.post("/v1/completions", json=body(prompts[0], r))
                   for r in ({"p": 2}, {"threshold": 0.5}, [0.5])]
            return [*good, *bad]

    try:
        low, high, *bad = asyncio.run(run())
    finally:
        runtime.close()
    for resp, p, writer in ((low, 0.0, "small"), (high, 1.0, "large")):
        assert resp.status_code == 200, resp.text
        out = resp.json()
        routing, tokens = out["routing"], out["choices"][0]["token_ids"]
        assert routing["params"] == {"p": p}
        assert routing["token_models"] == [writer] * 8
        assert routing["handoffs"] == (0 if writer == "small" else 2 * 8 - 1)
        assert check_exact(hf_pair, prompts[0 if p == 0.0 else 1], tokens, routing["token_models"]) >= 7
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in bad[:2]] == ["routing.p", "routing.threshold"]
    assert "bernoulli has no per-request parameter 'threshold'" in bad[1].json()["error"]["message"]

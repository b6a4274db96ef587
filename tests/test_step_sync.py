"""The step-synchronous baseline writes the same tokens as the routed runtime, one global step at a time."""

from __future__ import annotations

from engine_utils import prompts_of

from tokenrouter import SamplingParams
from tokenrouter.bench.baselines.step_sync import run_step_sync
from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.routing import make_algorithm


def test_step_sync_matches_the_routed_runtime(pair_paths):
    prompts = prompts_of([4, 11, 7, 19, 9], seed=40)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = {n: Engine(EngineConfig(model_path=str(p), kv_cache_tokens=2048, page_size=4, device="cpu"))
               for n, p in pair_paths.items()}
    router = make_algorithm("bernoulli", ["small", "large"], {"p": 0.4})
    res = run_step_sync(engines["small"], engines["large"], router, prompts, params, concurrency=2, seed=100)
    assert res.output_tokens == 60 and res.throughput > 0
    assert res.tokens_per_model["large"] > 0 and len(res.latencies) == 5
    for e in engines.values():
        assert not e.reqs
        e.check_integrity()
    cfg = {"models": [{"name": n, "path": str(p), "kv_cache_tokens": 2048, "page_size": 4}
                      for n, p in pair_paths.items()], "algorithm": {"name": "bernoulli", "p": 0.4}}
    with RoutedLLM(cfg) as llm:
        for i, ids in enumerate(prompts):
            out = llm.generate(prompt_token_ids=[ids], use_tqdm=False, timeout=60,
                               sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                              seed=100 + i))[0].outputs[0]
            assert out.token_ids == res.outputs[f"sync-{i}"]
            assert out.token_models == res.writers[f"sync-{i}"]

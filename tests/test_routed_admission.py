"""Admission under KV pressure: with pools that hold at most two requests' footprints, the entry queues
the rest and admits each once every model it may visit has room, so hand-offs never find a peer full and
no model ever preempts. The outputs are what unlimited memory gives: each token is the greedy choice of
the model the seeded router picked for its position (computed here with transformers, no pool at all)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts_of
from routing_utils import handoff_draws

from tokenrouter import SamplingParams
from tokenrouter.routed_llm import RoutedLLM

PAGE = 4
P = 0.5


@pytest.fixture(scope="module")
def hf_pair(pair_paths):
    from transformers import AutoModelForCausalLM

    return {n: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for n, path in pair_paths.items()}


def reference(hf_pair, prompt: list[int], seed: int, max_tokens: int) -> tuple[list[int], list[str]]:
    """Greedy routed decoding without any KV pool: the router's draw picks the writer of each position."""
    models = ["large" if d else "small" for d in handoff_draws(seed, len(prompt), max_tokens, P)]
    tokens: list[int] = []
    for writer in models:
        with torch.no_grad():
            row = hf_pair[writer](input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
        top2 = row.topk(2).values
        assert (top2[0] - top2[1]).item() > 1e-5, "near tie in the reference: pick other prompts"
        tokens.append(int(row.argmax()))
    return tokens, models


def test_admission_reserves_pages_under_pressure(pair_paths, hf_pair):
    prompts = prompts_of([18 + (5 * i) % 7 for i in range(8)], seed=21)  # 18..24 tokens
    max_tokens = 10  # footprints of 28-36 tokens: at most two fit in a 64-token pool, never three
    seeds = [500 + i for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=s) for s in seeds]
    expected = [reference(hf_pair, p, s, max_tokens) for p, s in zip(prompts, seeds)]
    assert any("large" in models for _, models in expected), "no hand-off: the reservation goes untested"

    group = {
        "models": [{"name": n, "path": str(pair_paths[n]), "kv_cache_tokens": 64, "page_size": PAGE}
                   for n in ("small", "large")],
        "algorithm": {"name": "bernoulli", "p": P},
    }
    with RoutedLLM(group) as llm:
        entry = llm.entry
        capacity = {n: entry.info[n].capacity_tokens for n in entry.group.names}
        assert capacity == {"small": 64, "large": 64}
        peak = {"queued": 0}
        real_poll = entry.poll

        def watched_poll(timeout: float = 0.1):
            # The entry's own queue and reservation book (it keeps no peak counter), seen between polls.
            peak["queued"] = max(peak["queued"], len(entry.queue))
            assert all(entry.reserved[n] <= capacity[n] for n in capacity), "reserved past a pool's capacity"
            entry.check_integrity()
            return real_poll(timeout)

        entry.poll = watched_poll
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
        stats = entry.stats()
        assert not entry.queue and all(v == 0 for v in entry.reserved.values())

    # At most two footprints fit, so at least six requests waited at the entry.
    assert peak["queued"] >= len(prompts) - 2
    assert {n: s.preemptions for n, s in stats.items()} == {"small": 0, "large": 0}
    for name, s in stats.items():
        assert s.live_requests == 0 and s.free_pages + s.cached_pages == s.total_pages, f"{name} leaked pages"
    for out, (tokens, models) in zip(outs, expected):
        c = out.outputs[0]
        assert c.finish_reason == "length"
        assert (c.token_ids, c.token_models) == (tokens, models)

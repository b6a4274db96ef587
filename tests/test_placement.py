"""Placement: the split of a shared device's memory between co-located models' KV pools, and the lines
the entry prints about it at start-up."""

from __future__ import annotations

import logging

import pytest

from tokenrouter.models.kv_pool import KVPool
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.entry.placement import (
    CUDA_CONTEXT_BYTES,
    ModelNeeds,
    parameter_count,
    plan_placement,
    split_memory,
)
from tokenrouter.runtime.group_config import GroupConfig

GIB = 1 << 30


def group(pair_paths, small: dict | None = None, large: dict | None = None, **extra) -> GroupConfig:
    return GroupConfig.from_dict({
        "models": [{"name": "small", "path": str(pair_paths["small"]), "page_size": 4, **(small or {})},
                   {"name": "large", "path": str(pair_paths["large"]), "page_size": 4, **(large or {})}],
        "algorithm": {"name": "bernoulli", "p": 0.5}, **extra})


def test_parameter_count_reads_headers(pair_paths):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair_paths["large"], dtype=torch.float32)
    assert parameter_count(pair_paths["large"]) == sum(p.numel() for p in model.parameters())


def test_colocated_models_hold_equal_tokens(pair_paths):
    g = group(pair_paths, {"device": "cuda:0"}, {"device": "cuda:0"})
    needs = [ModelNeeds.of(m) for m in g.models]
    small, large = needs
    assert small.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # layers x kv heads x head dim, K and V, bfloat16
    assert large.reserve_bytes > CUDA_CONTEXT_BYTES
    plan = split_memory(needs, 0.5, lambda d: 8 * GIB)
    dev = plan.devices["cuda:0"]
    assert dev.budget == 4 * GIB
    assert dev.kv_bytes == 4 * GIB - sum(n.weight_bytes + n.reserve_bytes for n in needs)
    t = plan.tokens
    assert t["small"] == t["large"] and t["small"] % 4 == 0
    used = sum(t[n.spec.name] * n.kv_bytes_per_token for n in needs)
    assert dev.kv_bytes - 4 * sum(n.kv_bytes_per_token for n in needs) < used <= dev.kv_bytes
    assert plan.shares["small"] + plan.shares["large"] == pytest.approx(1.0, abs=1e-3)


def test_kv_share_fixed_tokens_and_tensor_parallel(pair_paths):
    g = group(pair_paths, {"device": "cuda:0", "kv_share": 0.25}, {"device": "cuda:0", "tp_size": 2})
    needs = [ModelNeeds.of(m) for m in g.models]
    small, large = needs
    assert large.devices == ["cuda:0", "cuda:1"]
    assert large.kv_bytes_per_token == KVPool.bytes_per_token(3, 1, 32, __import__("torch").bfloat16)
    plan = split_memory(needs, 0.9, lambda d: 2 * GIB)
    assert plan.shares["small"] == pytest.approx(0.25, abs=1e-4)
    # large spans two GPUs: it gets what fits on the tighter one (cuda:0, where small takes a quarter)
    kv0 = plan.devices["cuda:0"].kv_bytes
    assert plan.tokens["large"] == int(0.75 * kv0 // large.kv_bytes_per_token) // 4 * 4
    fixed = group(pair_paths, {"device": "cuda:0", "kv_cache_tokens": 1000}, {"device": "cuda:0"})
    plan = split_memory([ModelNeeds.of(m) for m in fixed.models], 0.9, lambda d: 2 * GIB)
    assert plan.tokens["small"] == 1000 and plan.tokens["large"] > 1000


def test_clear_errors(pair_paths):
    g = group(pair_paths, {"device": "cuda:0"}, {"device": "cuda:0"})
    with pytest.raises(ValueError, match="leave no room for KV; raise memory_fraction"):
        split_memory([ModelNeeds.of(m) for m in g.models], 0.5, lambda d: GIB)
    g = group(pair_paths, {"device": "cuda:0", "kv_share": 0.7}, {"device": "cuda:0", "kv_share": 0.7})
    with pytest.raises(ValueError, match="ask for more than that"):
        split_memory([ModelNeeds.of(m) for m in g.models], 0.9, lambda d: 4 * GIB)
    with pytest.raises(ValueError, match="kv_share must be in"):
        group(pair_paths, {"kv_share": 1.5})
    with pytest.raises(ValueError, match="use kv_share"):
        group(pair_paths, {"mem_fraction": 0.1}, memory_fraction=0.5)


def test_plan_only_where_asked(pair_paths):
    g = group(pair_paths)  # CPU, no memory_fraction: each engine sizes its own pool, as before
    placed, lines = plan_placement(g, lambda d: GIB)
    assert lines == []
    assert placed.models[0].engine.kv_cache_tokens is None
    g = group(pair_paths, {"device": "cuda:0"}, {"device": "cuda:0"})  # shared GPU: planned at 0.9
    placed, lines = plan_placement(g, lambda d: 8 * GIB)
    assert lines[0].startswith("placement cuda:0: 0.9 x 8.00 GiB = 7.20 GiB for small, large;")
    assert placed.models[0].engine.kv_cache_tokens == placed.models[1].engine.kv_cache_tokens > 0
    assert g.models[0].engine.kv_cache_tokens is None  # the plan is a new config; the given one stays as written


def test_start_up_prints_the_split(pair_paths, caplog, monkeypatch):
    # not this machine's free memory
    monkeypatch.setattr("tokenrouter.runtime.entry.placement.device_memory", lambda d: GIB)
    g = group(pair_paths, {"cores": [0], "threads": 1}, {"cores": [0], "threads": 2}, memory_fraction=0.02)
    with caplog.at_level(logging.INFO, logger="tokenrouter.runtime.entry.entry"), RoutedLLM(g) as llm:
        info = llm.entry.info
        planned = llm.entry.group
    # Each subserver process applied its own spec : pinned to core 0, its torch threads.
    assert {n: (r.cpu_affinity, r.torch_threads) for n, r in info.items()} == {"small": ([0], 1), "large": ([0], 2)}
    text = caplog.text
    assert "placement cpu: 0.02 x 1.00 GiB = 0.02 GiB for small, large;" in text
    tokens = {m.name: m.engine.kv_cache_tokens for m in planned.models}
    for name in ("small", "large"):
        assert f"  {name}: weights " in text and f"KV {tokens[name]} tokens ({tokens[name] // 4} pages of 4" in text
        assert info[name].capacity_tokens == tokens[name]  # the subservers built what was planned
    assert tokens["small"] == tokens["large"]
    assert "small and large share core(s) 0" in text

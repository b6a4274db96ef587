"""Helpers to drive an Engine step by step and compare it with the transformers reference."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.engine.req import Req
from tokenrouter.models import skinny_gemm
from tokenrouter.sampling_params import SamplingParams

Logits = dict[str, list[tuple[int, torch.Tensor]]]  # rid -> [(position of the input row, logits)]


def need_compiler() -> None:
    """The CPU kernels (paged attention, the skinny GEMM) are built with the system C compiler:
    without one their cases skip, except under CI (the CI variable set), where the environment must
    have it: they fail."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        message = f"no C compiler {cc!r} to build the CPU kernels"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def skinny_kernel() -> skinny_gemm.SkinnyGemm:
    """The skinny GEMM, built (needs the compiler: need_compiler)."""
    need_compiler()
    k = skinny_gemm.load_kernel()
    assert k is not None
    return k


def make_engine(path: Path, **kw: Any) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("page_size", 4)
    kw.setdefault("max_running_requests", 16)
    kw.setdefault("chunked_prefill_size", 256)
    kw.setdefault("device", "cpu")
    return Engine(EngineConfig(model_path=str(path), **kw), outputs=StepOutputSpec(logits=True))


def run_to_end(engine: Engine, logits: Logits | None = None, max_steps: int = 10_000) -> None:
    """Step until every request finishes, recording each sampled row's logits; check integrity."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        result = engine.step()
        if result.step is not None and logits is not None and result.step.logits is not None:
            for req, row in zip(result.step.reqs, result.step.logits):
                # The token just appended sits at len-1; the row that produced it at len-2.
                logits.setdefault(req.rid, []).append((len(req.tokens) - 2, row.clone()))
        engine.check_integrity()
    assert not engine.has_unfinished(), "engine did not finish within the step bound"
    engine.check_integrity()


def add(engine: Engine, prompts: list[list[int]], max_tokens: int, **params: Any) -> list[Req]:
    params.setdefault("temperature", 0.0)
    return [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **params)) for p in prompts]


def max_logit_diff(hf: torch.nn.Module, reqs: list[Req], logits: Logits) -> float:
    """Largest |ours - reference| over every recorded row of every request."""
    worst = 0.0
    for req in reqs:
        rows = logits[req.rid]
        assert rows, f"{req.rid} sampled nothing"
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([req.tokens])).logits[0]
        for pos, row in rows:
            worst = max(worst, (ref[pos] - row).abs().max().item())
    return worst


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def check_exact(hf: dict[str, torch.nn.Module], prompt: list[int], tokens: list[int], models: list[str],
                tie: float = 1e-5) -> int:
    """Assert each output token is the greedy choice of the model that wrote it, given the prompt and
    the preceding output (skipping near ties); return how many positions were checked."""
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = {n: m(input_ids=seq).logits[0] for n, m in hf.items() if n in models}
    checked = 0
    for j, (tok, writer) in enumerate(zip(tokens, models)):
        row = logits[writer][len(prompt) + j - 1]
        top2 = row.topk(2).values
        if (top2[0] - top2[1]).item() < tie:
            continue
        assert tok == int(row.argmax()), f"token {j} ({tok}) is not {writer}'s greedy choice"
        checked += 1
    return checked

"""The oneDNN packed linear layers (models/onednn_linear.py, the CPU float32 default): the same
products as F.linear to float32 rounding, and an engine on them writes the same greedy tokens with
logits within 1e-4 of one on F.linear, for Llama and Qwen3."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_utils import prompts_of

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.models import onednn_linear
from tokenrouter.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (8, 576, 960), (32, 1536, 576), (5, 64, 4096), (100, 64, 96)])
def test_packed_linear_equals_f_linear(rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    ref = F.linear(x, w, b)
    out = onednn_linear.linear(x, w, onednn_linear.pack(w), b)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4 * k ** 0.5)


def _engine(path, backend: str) -> Engine:
    cfg = EngineConfig(model_path=str(path), device="cpu", dtype="float32", kv_cache_tokens=512, page_size=4,
                       disable_cuda_graph=True, linear_backend=backend)
    return Engine(cfg, outputs=StepOutputSpec(logits=True))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_on_packed_linears_matches_f_linear(arch: str, model_paths) -> None:
    engines = {b: _engine(model_paths[arch], b) for b in ("aten", "onednn")}
    assert engines["onednn"].model.lm_head_packed is not None and engines["aten"].model.lm_head_packed is None
    prompts = prompts_of([3, 9, 17, 30], seed=5)
    logits: dict[str, list[torch.Tensor]] = {b: [] for b in engines}
    tokens: dict[str, dict[str, list[int]]] = {b: {} for b in engines}
    for b, eng in engines.items():
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), rid=f"r{i}")
        while eng.has_unfinished():
            res = eng.step()
            if res.step is not None and res.step.logits is not None:
                logits[b].append(res.step.logits)
            for req in res.updated:
                tokens[b][req.rid] = list(req.tokens)
    assert tokens["aten"] == tokens["onednn"]
    assert len(logits["aten"]) == len(logits["onednn"]) > 0
    for a, o in zip(logits["aten"], logits["onednn"]):
        assert (a - o).abs().max().item() <= 1e-4


def test_onednn_where_it_does_not_apply_is_refused(model_paths) -> None:
    cfg = EngineConfig(model_path=str(model_paths["llama"]), dtype="float32", linear_backend="onednn",
                       disable_cuda_graph=False)
    with pytest.raises(ValueError, match="linear_backend onednn needs"):
        cfg.packs_linears(torch.device("cpu"), torch.float32, True)
    with pytest.raises(ValueError, match="linear_backend must be"):
        EngineConfig(model_path="x", linear_backend="fast")
    auto = EngineConfig(model_path="x", disable_cuda_graph=True)
    assert auto.packs_linears(torch.device("cpu"), torch.float32, True)
    assert not auto.packs_linears(torch.device("cpu"), torch.bfloat16, True)
    assert not EngineConfig(model_path="x", disable_cuda_graph=True, linear_backend="aten").packs_linears(
        torch.device("cpu"), torch.float32, True)

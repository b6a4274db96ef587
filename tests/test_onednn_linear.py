"""The packed linear layers on oneDNN (models/onednn_linear.py; with the skinny GEMM for few rows, the
CPU float32 default, tests/test_skinny_gemm.py): the same
products as F.linear to float32 rounding at every row count (large inputs cut into a fixed set of
row blocks), and an engine on them writes the same greedy tokens with logits within 1e-4 of one on
F.linear, for Llama and Qwen3, with prefill chunks and batched extends on oneDNN too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_utils import need_compiler, prompts_of

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.models import onednn_linear
from tokenrouter.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (8, 576, 960), (32, 1536, 576), (5, 64, 4096), (100, 64, 96),
                                      (64, 64, 96), (65, 96, 64), (300, 64, 96), (2048 + 1024 + 77, 32, 48)])
def test_packed_linear_equals_f_linear(rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    ref = F.linear(x, w, b)
    out = onednn_linear.linear(x, onednn_linear.pack(w), b)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_row_blocks_are_a_fixed_set_covering_every_row() -> None:
    allowed = set(range(1, onednn_linear.MAX_EXACT_ROWS + 1)) | set(onednn_linear.BLOCK_ROWS)
    assert len(allowed) == onednn_linear.MAX_EXACT_ROWS + len(onednn_linear.BLOCK_ROWS)
    for rows in range(1, 6000):
        blocks = onednn_linear.row_blocks(rows)
        assert sum(blocks) == rows and set(blocks) <= allowed, (rows, blocks)
        assert len(blocks) <= rows // max(onednn_linear.BLOCK_ROWS) + len(onednn_linear.BLOCK_ROWS) + 2
    assert onednn_linear.row_blocks(2048) == [2048] and onednn_linear.row_blocks(520) == [512, 8]
    assert onednn_linear.row_blocks(100) == [64, 36]


def _engine(path, backend: str) -> Engine:
    cfg = EngineConfig(model_path=str(path), device="cpu", dtype="float32", kv_cache_tokens=1024, page_size=4,
                       disable_cuda_graph=True, linear_backend=backend, chunked_prefill_size=256)
    return Engine(cfg, outputs=StepOutputSpec(logits=True))


@pytest.mark.parametrize("backend", ["onednn", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_on_packed_linears_matches_f_linear(arch: str, backend: str, model_paths) -> None:
    """onednn: oneDNN at every row count; auto: the skinny GEMM up to 64 rows (the prompt step's 229
    rows as oneDNN's 128 and the kernel's 64 and 37) and the fused element-wise ops."""
    if backend == "auto":
        need_compiler()
    engines = {b: _engine(model_paths[arch], b) for b in ("aten", backend)}
    packed = engines[backend].model.lm_head_packed
    assert packed is not None and engines["aten"].model.lm_head_packed is None
    assert (packed.skinny is None) == (backend == "onednn")
    # 229 prompt rows in the first step (blocks 128 + 64 + 37), decodes, then a catch-up extend of
    # every request (tokens written elsewhere, as a routed pair hands back: 6 x 12 rows over a prefix)
    prompts = prompts_of([3, 9, 17, 30, 70, 100], seed=5)
    suffixes = prompts_of([11] * len(prompts), seed=6)
    logits: dict[str, list[torch.Tensor]] = {b: [] for b in engines}
    tokens: dict[str, dict[str, list[int]]] = {b: {} for b in engines}
    for b, eng in engines.items():
        for i, p in enumerate(prompts):
            # different lengths: the last steps decode at batch 1 (the head's one-row path)
            eng.add_request(p, SamplingParams(max_tokens=18 + 2 * i, temperature=0.0, ignore_eos=True), rid=f"r{i}")
        step = 0
        while eng.has_unfinished():
            if step == 3:
                for i, suffix in enumerate(suffixes):
                    req = eng.reqs[f"r{i}"]
                    eng.receive(req.rid, len(req.tokens), suffix)
            res = eng.step()
            step += 1
            if res.step is not None and res.step.logits is not None:
                logits[b].append(res.step.logits)
            for req in res.updated:
                tokens[b][req.rid] = list(req.tokens)
    assert tokens["aten"] == tokens[backend]
    assert len(logits["aten"]) == len(logits[backend]) > 0
    assert {1, len(prompts)} <= {rows.shape[0] for rows in logits[backend]}
    for a, o in zip(logits["aten"], logits[backend]):
        assert (a - o).abs().max().item() <= 1e-4


def test_prefill_and_extend_steps_run_on_onednn_at_fixed_row_counts(model_paths) -> None:
    """No product falls back to F.linear at any row count, and oneDNN only ever sees the fixed set of
    row counts (its memory grows per row count)."""
    eng = _engine(model_paths["llama"], "onednn")
    allowed = set(range(1, onednn_linear.MAX_EXACT_ROWS + 1)) | set(onednn_linear.BLOCK_ROWS)
    for i, p in enumerate(prompts_of([3, 9, 17, 30, 70, 100, 150], seed=7)):
        eng.add_request(p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), rid=f"r{i}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        eng.step()  # 256 rows: one block of 256
        eng.step()  # the other 123 prompt rows and the first decodes
    events = prof.events()
    assert not [e.name for e in events if e.name in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")]
    rows = [e.input_shapes[0][0] for e in events if e.name == "mkldnn::_linear_pointwise"]
    assert max(rows) == 256 and set(rows) <= allowed


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

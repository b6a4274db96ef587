"""The skinny GEMM (models/skinny_gemm.c) and the packed linears on it (models/packed_linear.py, the
CPU float32 default): the same products as F.linear to float32 rounding at every tile shape, each row
bit-identical alone or in any batch, larger inputs cut between oneDNN's blocks and the skinny kernel
(an engine on it against F.linear: tests/test_onednn_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_utils import skinny_kernel

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.models import fused_ops, onednn_linear, packed_linear, skinny_gemm
from tokenrouter.models.attention import paged_decode_kernel

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="PyTorch built without oneDNN")


# rows 1-4 (four panels a tile), 5-8 (two), 9-20 (chunks of eight rows); widths that leave a last
# panel of 1, 8 or 15 columns; a width of one panel and an odd number of panels
@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (3, 37, 50), (4, 576, 960), (5, 576, 3072), (8, 96, 33),
                                      (9, 64, 47), (13, 1536, 576), (20, 24, 17), (1, 5, 1), (7, 16, 16),
                                      (64, 40, 80)])
def test_skinny_equals_f_linear(rows: int, k: int, n: int) -> None:
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(rows * 31 + n)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = skinny_gemm.pack(w)
    assert panels.shape == (-(-n // 16), k, 16)
    for bias in (None, b):
        out = gemm(x, panels, n, bias)
        assert out.shape == (rows, n)
        assert torch.allclose(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_rows_do_not_depend_on_their_batch() -> None:
    """Each output element is one ordered sum, whatever tile a row lands in: a row gives the same bits
    alone, in a batch of 2-4 (four-panel tiles), 5-8 (two-panel) or beyond 8 (row chunks)."""
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 200, generator=gen), torch.randn(100, 200, generator=gen)
    panels = skinny_gemm.pack(w)
    alone = torch.cat([gemm(x[i:i + 1], panels, 100, None) for i in range(40)])
    for rows in (2, 4, 5, 8, 9, 17, 40):
        assert torch.equal(gemm(x[:rows], panels, 100, None), alone[:rows]), rows


def test_strided_rows_and_bad_shapes() -> None:
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(4)
    wide, w = torch.randn(6, 100, generator=gen), torch.randn(30, 64, generator=gen)
    x = wide[:, 10:74]  # rows 100 floats apart
    assert torch.allclose(gemm(x, skinny_gemm.pack(w), 30, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="x has 63 features, the weight 64"):
        gemm(x[:, :63], skinny_gemm.pack(w), 30, None)


def test_large_inputs_split_between_onednn_and_skinny() -> None:
    """200 rows run as oneDNN's block of 128 and the skinny kernel's 64 and 8 (the same arithmetic as
    each part alone); oneDNN never sees a count up to 64."""
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(200, 96, generator=gen), torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
    packed = packed_linear.pack(w, gemm)
    assert onednn_linear.row_blocks(200) == [128, 64, 8]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = packed_linear.linear(x, packed, b)
    rows = [e.input_shapes[0][0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]
    assert rows == [128]
    assert torch.equal(out[128:192], gemm(x[128:192], packed.panels, 80, b))
    assert torch.equal(out[192:], gemm(x[192:], packed.panels, 80, b))
    assert torch.allclose(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def _engine(path, backend: str) -> Engine:
    cfg = EngineConfig(model_path=str(path), device="cpu", dtype="float32", kv_cache_tokens=1024, page_size=4,
                       disable_cuda_graph=True, linear_backend=backend, chunked_prefill_size=256)
    return Engine(cfg, outputs=StepOutputSpec(logits=True))


def test_without_a_compiler_auto_keeps_onednn(model_paths, monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    kernels = (skinny_gemm.load_kernel, paged_decode_kernel.load_kernel, fused_ops.load_kernel)
    for k in kernels:  # each is cached per process: none may keep a None from here
        k.cache_clear()
    try:
        eng = _engine(model_paths["llama"], "auto")
        assert eng.model.lm_head_packed is not None and eng.model.lm_head_packed.skinny is None
        assert "no C compiler" in caplog.text and "linear layers stay on oneDNN" in caplog.text
        with pytest.raises(RuntimeError, match="linear_backend skinny: the skinny GEMM could not be built"):
            _engine(model_paths["llama"], "skinny")
    finally:
        for k in kernels:
            k.cache_clear()
    cfg = EngineConfig(model_path="x", linear_backend="skinny", disable_cuda_graph=True)
    with pytest.raises(ValueError, match="linear_backend skinny needs float32 on CPU"):
        cfg.packs_linears(torch.device("cpu"), torch.bfloat16, True)

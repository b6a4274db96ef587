"""The fused element-wise ops (models/fused_ops.c): each the same as the PyTorch ops it replaces (the
rotation bit for bit, the norm and SiLU to float rounding, the argmax exactly), and an engine on the
CPU default running its decoder layers and greedy sampling on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_utils import need_compiler, prompts_of

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.models import fused_ops
from tokenrouter.models.layers import RMSNorm, RotaryEmbedding, rotate
from tokenrouter.sampling_params import SamplingParams


def ops() -> fused_ops.FusedOps:
    need_compiler()
    k = fused_ops.load_kernel()
    assert k is not None
    return k


@pytest.mark.parametrize("rows,dim", [(1, 576), (8, 64), (33, 17)])
def test_rms_norm_with_and_without_residual(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    x, res = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    w = torch.randn(dim, generator=gen)
    h, out = ops().rms_norm(x, w, 1e-5)
    assert h is x and torch.allclose(out, F.rms_norm(x, (dim,), w, eps=1e-5), rtol=1e-5, atol=1e-6)
    h, out = ops().rms_norm(x, w, 1e-5, res)
    assert torch.equal(h, res + x)
    assert torch.allclose(out, F.rms_norm(res + x, (dim,), w, eps=1e-5), rtol=1e-5, atol=1e-6)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data.copy_(w)
    norm.fused = ops()
    assert torch.equal(norm.add_forward(x, res)[1], out)
    # per head, read in place from wider rows (Qwen3's q and k norms on the fused q/k/v product)
    wide = torch.randn(rows, 3 * dim + 5, generator=gen)
    heads = wide[:, :3 * dim].view(rows, 3, dim)
    assert torch.allclose(norm(heads), F.rms_norm(heads, (dim,), w, eps=1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 24])
def test_rotation_is_bit_identical(head_dim: int) -> None:
    """q and k heads read in place from a wider fused q/k/v row, as the attention layer passes them."""
    gen = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    rope = rotary.angles(torch.tensor([0, 5, 17, 300, 511, 2]))
    qkv = torch.randn(6, 7 * head_dim, generator=gen) * 3
    qk = qkv[:, :5 * head_dim].view(-1, 5, head_dim)
    assert torch.equal(rotate(qk, rope, ops()), rotate(qk, rope))


def test_silu_mul_and_argmax() -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(9, 2 * 100, generator=gen) * 4
    ref = F.silu(gate_up[:, :100]) * gate_up[:, 100:]
    assert torch.allclose(ops().silu_mul(gate_up), ref, rtol=1e-5, atol=1e-6)
    logits = torch.randn(5, 3000, generator=gen)
    logits[2, 7] = logits[2, 900] = 50.0  # a tie: the first index, as torch.argmax
    assert torch.equal(ops().argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 33), (1, 45), (3, 13), (2, 300)])  # vector tails of 0-15
def test_bfloat16_sides_are_the_float32_ops_converted_by_torch(rows: int, dim: int) -> None:
    """The norm reading a product's bfloat16 rows (a padded view) and writing the next product's, and
    SiLU on bfloat16: bit for bit the float32 ops between torch's conversions (ties to even; NaN stays NaN)."""
    gen = torch.Generator().manual_seed(dim)
    k = ops()
    padded = (torch.randn(rows, dim + 16, generator=gen) * 3).to(torch.bfloat16)
    x, res, w = padded[:, :dim], torch.randn(rows, dim, generator=gen), torch.rand(dim, generator=gen) + 0.5
    h, out = k.rms_norm(x, w, 1e-5, res, out_dtype=torch.bfloat16)
    h32, out32 = k.rms_norm(x.float().contiguous(), w, 1e-5, res)
    assert out.dtype == torch.bfloat16 and torch.equal(h, h32) and torch.equal(out, out32.to(torch.bfloat16))
    plain = torch.randn(rows, dim, generator=gen)
    assert torch.equal(k.rms_norm(plain, w, 1e-5, out_dtype=torch.bfloat16)[1],
                       k.rms_norm(plain, w, 1e-5)[1].to(torch.bfloat16))
    # rows of ones (out = w times a scale near 1) with w within a few float32 steps of the points
    # halfway between bfloat16 values: some outputs fall exactly halfway, and go to the even one
    halves = 1 + torch.arange(1, 128, 2, dtype=torch.float64) * 2.0 ** -8
    near = (halves[:, None] + torch.arange(-2, 3) * 2.0 ** -23).flatten().float()
    out32 = k.rms_norm(torch.ones(1, len(near)), near, 0.0)[1]
    assert (out32.view(torch.int32) & 0xFFFF == 0x8000).sum() > 10
    assert torch.equal(k.rms_norm(torch.ones(1, len(near)), near, 0.0, out_dtype=torch.bfloat16)[1],
                       out32.to(torch.bfloat16))
    with pytest.raises(ValueError, match="needs 2-D rows and a residual"):
        k.rms_norm(x, w, 1e-5)
    gate_up = (torch.randn(rows, 2 * dim, generator=gen) * 4).to(torch.bfloat16)
    gate_up[0, 0] = float("nan")
    got, ref = k.silu_mul(gate_up), k.silu_mul(gate_up.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_engine_runs_layers_and_sampling_on_the_fused_ops(model_paths) -> None:
    need_compiler()
    cfg = EngineConfig(model_path=str(model_paths["qwen3"]), device="cpu", dtype="float32", kv_cache_tokens=512,
                       page_size=4, disable_cuda_graph=True)
    eng = Engine(cfg, outputs=StepOutputSpec())
    assert eng.model.fused_ops is not None and eng.runner.sampler.fused is eng.model.fused_ops
    # Sampling from full logits is what this checks (greedy steps take the screened head otherwise,
    # whose argmax is over a few columns: tests/test_screened_head.py).
    eng.model.lm_head_screened = None
    for i, p in enumerate(prompts_of([5, 9], seed=2)):
        eng.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), rid=f"r{i}")
    eng.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.step()  # a decode step of both requests
    names = {e.name for e in prof.events()}
    assert not names & {"aten::rms_norm", "aten::silu", "aten::argmax"}, names
    assert all(layer.self_attn.fused is eng.model.fused_ops for layer in eng.model.model.layers)

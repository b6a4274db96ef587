"""The C loop over a decoder's layers (tokenrouter/models/layer_loop.py) against the Python loop it
replaces (`DecoderLayer.fused_forward` layer by layer): the same logits and tokens bit for bit, and the
same K/V in the pool, for each block type, at one row, several decode rows and extends of 7 and 12 rows."""

from __future__ import annotations

import pytest
import torch
from engine_utils import need_compiler, prompts_of
from test_quantized_linear import engine, gguf_folder, logits_of

from tokenrouter.engine.engine import Engine
from tokenrouter.models import block_gemm, quantized_linear
from tokenrouter.models.layer_loop import LayerLoop


def distinct_norms(eng: Engine) -> None:
    """Norm weights that differ per layer and position (a random model's are ones), so a mix-up shows."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in eng.model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=gen))


def run(eng: Engine) -> list:
    """A one-row decode, a 7-token and a 12-token extend, then three requests decoding side by side (a
    28-row prompt step first, more rows than the loop takes)."""
    out = logits_of(eng, prompts_of([7], seed=3), 5) + logits_of(eng, prompts_of([12], seed=2), 3)
    return out + logits_of(eng, prompts_of([20, 5, 3], seed=1), 6)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_0"])
def test_the_c_loop_writes_what_the_python_loop_writes(model_paths, tmp_path, kind, monkeypatch):
    need_compiler()
    kernel = block_gemm.load_kernel()
    assert kernel is not None
    # The layers take block_gemm on any CPU here: without VNNI it is a plain C loop of the same arithmetic.
    monkeypatch.setattr(kernel, "serves", True)
    folder = gguf_folder(model_paths["llama"], tmp_path / "m", kind)
    looped = engine(folder)
    # The loop takes steps of up to the quantized kernel's rows on the blocks, also where the Python
    # loop takes them in bfloat16 (oneDNN running it natively, quantized_linear.WIDE_ROWS), which the
    # plain engine here is told not to.
    monkeypatch.setattr(quantized_linear, "WIDE_ROWS", quantized_linear.MAX_ROWS + 1)
    plain = engine(folder)
    assert looped.model.layer_loop is not None and looped.model.layer_loop.max_rows >= 3
    plain.model.layer_loop = None
    for eng in (looped, plain):
        distinct_norms(eng)
    rows: list[int] = []
    call = LayerLoop.__call__

    def counted(self, x, rope, plan, pool):
        rows.append(x.shape[0])
        return call(self, x, rope, plan, pool)

    monkeypatch.setattr(LayerLoop, "__call__", counted)
    got, want = run(looped), run(plain)
    assert {1, 3, 7, 12} <= set(rows) and max(rows) <= looped.model.layer_loop.max_rows
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want):
        assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert torch.equal(looped.pool.k, plain.pool.k) and torch.equal(looped.pool.v, plain.pool.v)


def test_layers_the_loop_cannot_take_keep_the_python_loop(model_paths, tmp_path):
    need_compiler()
    assert engine(gguf_folder(model_paths["qwen2"], tmp_path / "q", "Q4_1")).model.layer_loop is None  # q/k/v bias
    assert engine(model_paths["llama"]).model.layer_loop is None  # float weights

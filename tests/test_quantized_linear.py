"""Weights served as a GGUF file stores them (models/gguf_weights.py, models/quantized_linear.py,
engine/model_loader.py `quantize`): blocks decoded exactly as the gguf package dequantizes them, the
int4 and int8 products within their stated error bound at every row count, the head's quantized
screen exact, an engine serving a folder's blocks under `--quantization auto` (and only for few rows),
int8 for a float folder, and what is refused at load: a damaged block, a truncated file, a folder
whose two copies disagree; a block type no kernel takes is dequantized, with a log line."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_utils import need_compiler, prompts_of, skinny_kernel
from gguf.quants import dequantize, quantize

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.models import block_gemm, onednn_linear, quantized_linear, skinny_gemm
from tokenrouter.models.block_gemm import PackedBlocks
from tokenrouter.models.config import ModelConfig, ModelLoadError
from tokenrouter.models.gguf_weights import BLOCK, GGUF_FILE, BlockWeight, decode_blocks, read_gguf, write_gguf
from tokenrouter.models.llama import DecoderLayer
from tokenrouter.models.screened_head import ScreenedHead
from tokenrouter.sampling_params import SamplingParams

KINDS = ("Q4_0", "Q4_1", "Q8_0")


def tiny_config(hidden: int = 64, inter: int = 96) -> ModelConfig:
    return ModelConfig("llama", 320, hidden, inter, 1, 4, 2, hidden // 4, 1e-6, 10000.0, None, 256, False, False,
                       (2,), 1)


def one_weight_file(path: Path, kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """A GGUF file holding one [n, k] projection (layer 0's ffn_down) as `kind` blocks; returns the float
    weight quantized and the raw blocks."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 2.0, n)[:, None]
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    writer.add_tensor("blk.0.ffn_down.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w, blocks


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_decode_to_the_gguf_packages_values(tmp_path, kind):
    _, blocks = one_weight_file(tmp_path / "w.gguf", kind, 48, 96, seed=1)
    weights = read_gguf(tmp_path / "w.gguf", tiny_config())
    block = weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(block, BlockWeight) and block.kind == kind and block.shape == (48, 96)
    expected = torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType[kind]).copy())
    assert torch.equal(block.dequantize(), expected)


def test_qk_rows_are_unpermuted_and_written_back(tmp_path):
    """write_gguf applies llama.cpp's q/k permutation; read_gguf undoes it: the rows come back in place."""
    cfg = tiny_config()
    gen = torch.Generator().manual_seed(3)
    weights = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=gen),
               "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64, generator=gen),
               "model.layers.0.input_layernorm.weight": torch.rand(64, generator=gen)}
    write_gguf(tmp_path / "m.gguf", weights, cfg, "Q8_0")
    back = read_gguf(tmp_path / "m.gguf", cfg)
    for name, w in weights.items():
        got = back[name]
        if isinstance(got, BlockWeight):
            ref = torch.from_numpy(dequantize(quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                              gguf.GGMLQuantizationType.Q8_0).copy())
            assert torch.equal(got.dequantize(), ref), name
        else:
            assert torch.equal(got, w), name
    raw = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    stored = torch.from_numpy(dequantize(raw["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.Q8_0).copy())
    assert not torch.equal(stored, back["model.layers.0.self_attn.q_proj.weight"].dequantize())  # permuted there


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 2048])
def test_product_within_its_stated_bound(tmp_path, kind, rows):
    """The int4 kernel's product (x rounded to bfloat16, scales and zeros to bfloat16, the sum to
    bfloat16) against the exact product with the dequantized weights: within ErrorBound everywhere,
    and not trivially (the bound is within 64x of the worst error seen)."""
    w, _ = one_weight_file(tmp_path / "w.gguf", kind, 40, 96, seed=rows)
    block = read_gguf(tmp_path / "w.gguf", tiny_config())["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(block, BlockWeight)
    q = quantized_linear.from_blocks(block)
    ref = block.dequantize()
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)) * 3
    y = quantized_linear.linear(x, q)
    assert y.shape == (rows, 40) and y.dtype == torch.float32
    exact = x.double() @ ref.double().T
    bound = quantized_linear.error_bound(q, block, ref)
    limit = x.double().norm(dim=1)[:, None] * bound.columns[None] + bound.flushed * (1 + float(x.abs().max()))
    err = (y.double() - exact).abs()
    assert (err <= limit).all()
    assert float((limit / err.clamp_min(1e-30)).min()) < 64


def test_the_bound_holds_where_every_rounding_leans_the_same_way(tmp_path):
    """x just above 1 (each element rounds down to 1.0 in bfloat16, by almost 2^-9) against weights
    all positive with a scale bfloat16 holds exactly: the error is about half of u_b |x . w|, the
    stated bound about twice that; a bound with a smaller factor on its magnitude term fails here."""
    k, n = 4096, 32
    codes = torch.full((n, k), 15, dtype=torch.uint8)  # w = d (15 - 8) = 7 d
    block = BlockWeight("Q4_0", codes, torch.full((n, k // 32), 2.0 ** -7))
    q = quantized_linear.from_blocks(block)
    ref = block.dequantize()
    x = torch.full((1, k), 1 + 2.0 ** -9 - 2.0 ** -20)
    err = (quantized_linear.linear(x, q).double() - x.double() @ ref.double().T).abs()
    bound = quantized_linear.error_bound(q, block, ref)
    limit = x.double().norm(dim=1)[:, None] * bound.columns[None] + bound.flushed * (1 + float(x.abs().max()))
    assert (err <= limit).all()
    assert (err > 0.4 * 2.0 ** -8 * (x.double() @ ref.double().T)).all()  # the roundings did lean


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_per_channel_within_its_stated_bound(rows):
    w = torch.randn(72, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 72)[:, None]
    q = quantized_linear.int8_per_channel(w)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(72)
    err = (quantized_linear.linear(x, q, bias).double() - (x.double() @ w.double().T + bias.double())).abs()
    bound = quantized_linear.error_bound(q, None, w)
    limit = x.double().norm(dim=1)[:, None] * bound.columns[None] + bound.flushed * (1 + float(x.abs().max()))
    assert (err <= limit + 1e-6 * bias.abs().double()).all()  # the bias is added in float32


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("form", ["int4", "block_gemm"])
def test_quantized_screen_gives_the_full_heads_top(tmp_path, kind, form):
    """The head's screen on its blocks (torch's int4 kernel, or block_gemm's dot products: on this
    CPU's, or on the plain C loop's same arithmetic): every row's argmax and exact top-k are the
    float32 head's, on columns the quantized products cannot order (near-ties)."""
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(96, generator=gen)
    w = torch.randn(4000, 96, generator=gen) * 0.3
    w[:48] = base + torch.randn(48, 96, generator=gen) * 1e-3
    blocks = quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    block = decode_blocks("head", kind, blocks.reshape(4000, -1), 4000, 96)
    weight = block.dequantize().contiguous()
    head = ScreenedHead(weight, gemm)
    head.add_quantized(quantized_linear.from_blocks(block) if form == "int4" else block_gemm.pack(block), block)
    x = base + torch.randn(5, 96, generator=gen) * 0.05
    # on one thread the pair screen serves, but for block_gemm's (faster than the pairs there too)
    assert head.uses_quantized(x) == (form == "block_gemm")
    torch.set_num_threads(2)
    try:
        assert head.uses_quantized(x)
        got = head.top(x, 7)
        scale, columns, offset = head.bounds(x)
        approx = head.approx(x)
    finally:
        torch.set_num_threads(1)
    full = gemm(x, skinny_gemm.pack(weight), 4000, None)
    assert got is not None
    assert torch.equal(got.argmax, full.argmax(dim=1))
    assert torch.equal(got.values, full.topk(7, dim=1).values)
    assert ((approx.double() - full.double()).abs() <= scale[:, None] * columns[None] + offset).all()


def test_a_wide_ranked_top_on_the_quantized_screen_recomputes_few_columns():
    """A wide top-k (R2R reads 100) the screen's bound cannot narrow: the exact top-k would recompute
    more than `max_columns` (the full head instead); ranked by the screen (exact=False) it recomputes
    the argmax's candidates and the k ranked columns, and gives the argmax exactly and each ranked
    column's exact logit, descending."""
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(4000, 96, generator=gen) * 0.3
    blocks = quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
    block = decode_blocks("head", "Q4_1", blocks.reshape(4000, -1), 4000, 96)
    weight = block.dequantize().contiguous()
    head = ScreenedHead(weight, gemm)
    head.add_quantized(quantized_linear.from_blocks(block), block)
    x = torch.randn(3, 96, generator=gen)
    k = 120
    torch.set_num_threads(2)
    try:
        assert head.uses_quantized(x)
        wide = head.columns(x, k)
        ranked = head.top(x, k, exact=False)
        approx = head.approx(x)
    finally:
        torch.set_num_threads(1)
    assert wide is not None and len(wide) > head.max_columns  # so the exact top would take the full head
    full = gemm(x, skinny_gemm.pack(weight), 4000, None)
    assert ranked is not None and ranked.values is not None and ranked.ids is not None
    assert torch.equal(ranked.argmax, full.argmax(dim=1))
    # the screen's k highest (which of equal screen values at the k-th is free)
    assert torch.equal(approx.gather(1, ranked.ids).sort(dim=1).values, approx.topk(k, dim=1).values.sort(dim=1).values)
    assert torch.equal(ranked.values, full.gather(1, ranked.ids))
    assert (ranked.values[:, :-1] >= ranked.values[:, 1:]).all()


# ---- engines ------------------------------------------------------------------------------------

def gguf_folder(src: Path, dst: Path, linear_kind: str, embedding_kind: str = "Q8_0") -> Path:
    """A copy of model folder `src` stored as prepare stores the student: GGUF_FILE with the given
    blocks, model.safetensors their dequantized values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    cfg = ModelConfig.from_folder(src)
    dst.mkdir(parents=True)
    state = model.state_dict()
    write_gguf(dst / GGUF_FILE, state, cfg, linear_kind, embedding_kind)
    with torch.no_grad():
        for name, w in read_gguf(dst / GGUF_FILE, cfg).items():
            state[name].copy_(w.dequantize() if isinstance(w, BlockWeight) else w)
    model.save_pretrained(str(dst))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "generation", "special", "chat")):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def engine(path: Path, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(path), kv_cache_tokens=2048, page_size=4, device="cpu",
                               max_running_requests=16, **kw), outputs=StepOutputSpec(logits=True))


def logits_of(eng: Engine, prompts: list[list[int]], tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Each request's output tokens and logits rows, greedy, EOS ignored."""
    reqs = [eng.add_request(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)) for p in prompts]
    rows: dict[str, list[torch.Tensor]] = {r.rid: [] for r in reqs}
    while eng.has_unfinished():
        out = eng.step().step
        if out is not None and out.logits is not None:
            for r, row in zip(out.reqs, out.logits):
                rows[r.rid].append(row.clone())
    eng.check_integrity()
    return [(r.output_ids, torch.stack(rows[r.rid])) for r in reqs]


def close_until_they_part(a: list[tuple[list[int], torch.Tensor]], b: list[tuple[list[int], torch.Tensor]]) -> int:
    """Assert each request's logits rows are within 5% of the largest logit while both paths wrote the
    same tokens (a near-tie may part them after); returns the rows compared."""
    compared = 0
    for (ta, la), (tb, lb) in zip(a, b):
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        for i in range(min(same + 1, len(ta))):  # row i wrote token i, reading the same tokens before it
            assert (la[i] - lb[i]).abs().max() < 0.05 * lb[i].abs().max()
            compared += 1
    return compared


@pytest.mark.parametrize("kind", KINDS)
def test_engine_serves_the_blocks_for_few_rows(model_paths, tmp_path, kind, monkeypatch):
    """Under auto the folder's blocks serve decode steps (every linear layer on block_gemm where it
    serves the CPU, else on torch's int4 kernel) and a prompt past the layers' quantized rows takes
    the weights' values in bfloat16 on oneDNN where it runs them natively (else the float32 weights,
    from MAX_ROWS on); the logits stay within the products' rounding of the float path's (none), and
    the engine says what it serves."""
    need_compiler()
    folder = gguf_folder(model_paths["llama"], tmp_path / "m", kind)
    quant, plain = engine(folder), engine(folder, quantization="none")
    quant.model.layer_loop = None  # counted in Python (the C loop: tests/test_layer_loop.py)
    assert quant.quantization == f"gguf ({', '.join(sorted({kind, 'Q8_0'}))})"  # the embedding is Q8_0
    assert plain.quantization == "none"
    wide = onednn_linear.bfloat16_available()
    layers = [m for m in quant.model.modules() if hasattr(m, "wide")]
    assert layers and all((m.wide is not None) == wide and (m.packed is None) == wide for m in layers)
    dots = block_gemm.load_kernel()
    assert all(isinstance(m.quantized, PackedBlocks) == (dots is not None and dots.serves) for m in layers)
    calls: list[int] = []
    real = quantized_linear.product
    monkeypatch.setattr(quantized_linear, "product", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    wide_rows: list[int] = []
    real_linear = onednn_linear.linear
    monkeypatch.setattr(onednn_linear, "linear", lambda x, w, b: (x.dtype == torch.bfloat16 and wide_rows.append(
        x.shape[0])) or real_linear(x, w, b))
    prompts = prompts_of([20, 5, 3], seed=1)
    a, b = logits_of(quant, prompts, 6), logits_of(plain, prompts, 6)
    most = layers[0].quantized_rows
    assert calls and max(calls) <= most
    assert (min(wide_rows) > most) if wide else not wide_rows
    layers = quant.model.config.num_layers
    assert len(calls) % (4 * layers) == 0  # whole steps: qkv, o, gate_up, down of every layer
    assert close_until_they_part(a, b) >= 6


@pytest.mark.parametrize("embedding_kind,group", [("Q8_0", 0), ("Q4_1", BLOCK)])
def test_the_head_screens_on_its_cheaper_quantized_form(model_paths, tmp_path, embedding_kind, group):
    """Where block_gemm serves the CPU the head screens on its own blocks there; elsewhere a Q8_0 head
    as int8 per channel (group 0: one pass where its exact int4 form is two nibble planes), a Q4 head
    as its own blocks on the int4 kernel; either way the screen's argmax and top-k on two threads are
    the full float32 head's."""
    need_compiler()
    eng = engine(gguf_folder(model_paths["llama"], tmp_path / "m", "Q4_1", embedding_kind))
    head = eng.model.lm_head_screened
    assert head is not None and head.quantized is not None
    dots = block_gemm.load_kernel()
    if dots is not None and dots.serves:  # the head's own blocks, exactly
        assert isinstance(head.quantized, PackedBlocks) and head.quantized.bits == (8 if group == 0 else 4)
    else:
        assert isinstance(head.quantized, quantized_linear.QuantizedLinear)
        assert (head.quantized.group, head.quantized.repeat) == (group, 1)
    x = torch.randn(3, head.weight.shape[1], generator=torch.Generator().manual_seed(2)) * 4
    torch.set_num_threads(2)
    try:
        assert head.uses_quantized(x)
        got = head.top(x, 5)
    finally:
        torch.set_num_threads(1)
    full = x @ head.weight.t()
    assert got is not None and torch.equal(got.argmax, full.argmax(dim=1))
    assert torch.allclose(got.values, full.topk(5, dim=1).values, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model,kind", [("llama", "Q8_0"), ("qwen2", "Q4_1"), ("llama", None)])
def test_the_fused_layer_loop_returns_what_the_blocks_return(model_paths, tmp_path, monkeypatch, model, kind):
    """On the fused ops every decoder layer of a step runs `fused_forward`, and it returns exactly what
    the layer's blocks return on the same rows (quantized decode rows, float prompt rows; Qwen2's
    q/k/v bias; a folder without blocks on the packed float weights)."""
    need_compiler()
    folder = model_paths[model] if kind is None else gguf_folder(model_paths[model], tmp_path / "m", kind)
    eng = engine(folder)
    eng.model.layer_loop = None  # the layers in Python, one call each (the C loop: tests/test_layer_loop.py)
    assert eng.model.fused_ops is not None
    assert (eng.quantization == "none") == (kind is None)
    # with blocks, the few-row steps run the layer in the kernels' bfloat16 from norm to norm
    assert all((layer.flat.quantized is None) == (kind is None) for layer in eng.model.model.layers)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # distinct norm weights (a random model's are ones), so a mix-up shows
        for layer in eng.model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=gen))
    rows: list[int] = []
    differ: list[str] = []
    fused = DecoderLayer.fused_forward

    def checked(layer: DecoderLayer, x, rope, attn, ops):
        got = fused(layer, x, rope, attn, ops)
        if not torch.equal(got, layer(x, rope, attn)):  # (the blocks write the same K/V again)
            differ.append(f"layer {layer.self_attn.layer} at {x.shape[0]} rows")
        rows.append(x.shape[0])
        return got

    monkeypatch.setattr(DecoderLayer, "fused_forward", checked)
    logits_of(eng, prompts_of([20, 5, 3], seed=1), 4)
    assert not differ
    assert max(rows) > quantized_linear.MAX_ROWS and min(rows) <= quantized_linear.MAX_ROWS
    assert len(rows) % eng.model.config.num_layers == 0  # every layer of every step


def test_int8_serves_a_float_folder(model_paths):
    need_compiler()
    eng = engine(model_paths["llama"], quantization="int8")
    assert eng.quantization.startswith("int8")
    assert all(m.quantized is not None and m.quantized.group == 0
               for name, m in eng.model.named_modules() if name.endswith(("qkv_proj", "down_proj")))
    assert engine(model_paths["llama"]).quantization == "none"  # auto: a folder without blocks stays float
    prompts = prompts_of([7, 4], seed=2)
    assert close_until_they_part(logits_of(eng, prompts, 5), logits_of(engine(model_paths["llama"]), prompts, 5)) >= 4


def test_quantization_field_is_validated():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8"):
        EngineConfig(model_path="x", quantization="q4")
    with pytest.raises(ValueError, match="quantization int8 runs on packed linears"):
        EngineConfig(model_path="x", quantization="int8", linear_backend="aten")


def test_a_folder_whose_copies_disagree_is_refused(model_paths, tmp_path):
    folder = gguf_folder(model_paths["llama"], tmp_path / "m", "Q4_1")
    raw = (folder / GGUF_FILE).read_bytes()
    (folder / GGUF_FILE).unlink()
    write_gguf(folder / GGUF_FILE, {"model.layers.0.mlp.down_proj.weight": torch.ones(64, 128)},
               ModelConfig.from_folder(folder), "Q4_0")
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.down_proj.weight.*differs from the folder's float"):
        engine(folder)
    (folder / GGUF_FILE).write_bytes(raw)
    assert engine(folder).quantization.startswith("gguf")
    assert engine(folder, quantization="none").quantization == "none"


def test_a_damaged_scale_or_a_short_tensor_is_refused(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "w.gguf"
    one_weight_file(path, "Q4_1", 16, 64, seed=4)
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    start = int(reader.tensors[0].data_offset)
    data[start + 20 * 5: start + 20 * 5 + 2] = np.array([np.nan], dtype=np.float16).tobytes()  # block 5's d
    (tmp_path / "nan.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'blk.0.ffn_down.weight': the scale of block 1 in row 2 is nan"):
        read_gguf(tmp_path / "nan.gguf", cfg)
    (tmp_path / "short.gguf").write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ModelLoadError, match="short.gguf: not a readable GGUF file|blk.0.ffn_down.weight.*truncated"):
        read_gguf(tmp_path / "short.gguf", cfg)


def test_a_block_type_no_kernel_takes_is_dequantized(tmp_path, caplog):
    path = tmp_path / "w.gguf"
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(9))
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = quantize(w.numpy(), gguf.GGMLQuantizationType.Q5_0)
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level(logging.INFO, logger="tokenrouter.models.gguf_weights"):
        got = read_gguf(path, tiny_config())["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType.Q5_0).copy()))
    assert "tensor blk.0.ffn_up.weight is Q5_0, which no kernel here takes as stored" in caplog.text

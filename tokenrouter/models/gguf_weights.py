"""A GGUF file's tensors under Hugging Face names: quantized blocks decoded for the kernels, the rest as
float32 tensors; and the writer that stores a model's weights the same way (the student, after
training, quantized as SmolLM2's file is).

A model folder may hold its weights twice: model.safetensors in float32 (what transformers and
`--quantization none` read) and `GGUF_FILE`, the blocks as llama.cpp stores them, which the engine
serves under `--quantization auto` (models/quantized_linear.py). For a folder converted from a GGUF
file (training/gguf_convert.py), `GGUF_FILE` is that file itself.

Block layouts (ggml's, 32 weights a block along a row): Q4_0 is a float16 scale d and 16 bytes of
nibbles, w = d (q - 8); Q4_1 adds a float16 minimum m, w = d q + m; Q8_0 is d and 32 int8, w = d q.
In each 16-byte nibble run, byte j holds weight j in its low nibble and weight j + 16 in its high one.

llama.cpp's converter permutes the rows of a Llama model's q and k projections for its rotary
layout; reading undoes that permutation (and writing applies it), so tensors come out in the
Hugging Face layout the rest of the engine uses.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenrouter.models.config import ModelConfig, ModelLoadError

logger = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"
BLOCK = 32
BLOCK_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # served as stored; other quantized types are dequantized
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_FLOAT_KINDS = ("F32", "F16", "BF16")
PERMUTED_ARCHITECTURES = frozenset({"llama"})  # general.architecture values whose q/k rows are permuted

# llama.cpp's per-layer tensor names -> Hugging Face module names under model.layers.N.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None for one this engine has no place for)."""
    base, _, suffix = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def gguf_name(name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name (the inverse of `hf_name`)."""
    base, _, suffix = name.rpartition(".")
    for ours, theirs in _TOP_NAMES.items():
        if base == theirs:
            return f"{ours}.{suffix}"
    parts = base.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for ours, theirs in _LAYER_NAMES.items():
            if parts[3] == theirs:
                return f"blk.{parts[2]}.{ours}.{suffix}"
    raise ValueError(f"no llama.cpp name for tensor {name!r}")


@dataclass(frozen=True)
class BlockWeight:
    """A [rows, cols] weight in blocks of 32 along each row, decoded: `codes` [rows, cols] (uint8
    nibbles 0..15 for Q4_0/Q4_1, int8 for Q8_0), `scales` the blocks' d and `mins` Q4_1's m, each
    [rows, cols / 32] float32 (the file's float16 values, exactly)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], with ggml's arithmetic (d * q, then + m, each rounded once)."""
        d = self.scales.repeat_interleave(BLOCK, dim=1)
        if self.kind == "Q8_0":
            return self.codes.float() * d
        if self.kind == "Q4_0":
            return (self.codes.to(torch.int8) - 8).float() * d
        assert self.mins is not None
        return self.codes.float() * d + self.mins.repeat_interleave(BLOCK, dim=1)

    def rows(self, index: torch.Tensor | slice) -> BlockWeight:
        """These rows (an index tensor reorders them)."""
        return BlockWeight(self.kind, self.codes[index], self.scales[index],
                           None if self.mins is None else self.mins[index])


Weight = BlockWeight | torch.Tensor


def decode_blocks(name: str, kind: str, data: np.ndarray, rows: int, cols: int) -> BlockWeight:
    """One tensor's raw blocks [rows, bytes a row] decoded; refuses a short tensor or a bad scale."""
    per_block = _BLOCK_BYTES[kind]
    if cols % BLOCK:
        raise ModelLoadError(f"GGUF tensor {name!r}: {cols} columns is not a whole number of {BLOCK}-weight blocks")
    blocks = cols // BLOCK
    raw = np.ascontiguousarray(data).reshape(-1)
    if raw.size != rows * blocks * per_block:
        raise ModelLoadError(f"GGUF tensor {name!r} ({kind}, {rows} x {cols}) holds {raw.size} bytes, "
                             f"expected {rows * blocks * per_block}: the file is truncated or damaged")
    raw = raw.reshape(rows, blocks, per_block)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = None
    if kind == "Q8_0":
        codes = torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(rows, cols))
    else:
        start = 4 if kind == "Q4_1" else 2
        if kind == "Q4_1":
            mins = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = raw[..., start:]
        codes = torch.from_numpy(np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols))
    for what, values in (("scale", d), ("minimum", mins)):
        if values is not None and not np.isfinite(values).all():
            bad = np.argwhere(~np.isfinite(values))[0]
            raise ModelLoadError(f"GGUF tensor {name!r}: the {what} of block {int(bad[1])} in row {int(bad[0])} "
                                 f"is {values[tuple(bad)]}: the file is damaged")
    return BlockWeight(kind, codes, torch.from_numpy(d), None if mins is None else torch.from_numpy(mins))


def _qk_order(rows: int, heads: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's q/k permutation: HF row r = GGUF row order[r]."""
    half = rows // heads // 2
    # llama.cpp wrote HF rows (h, two, i) at (h, i, two).
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def read_gguf(path: str | Path, cfg: ModelConfig) -> dict[str, Weight]:
    """Every tensor of the GGUF file at `path`, by Hugging Face name: `BlockWeight` for Q4_0, Q4_1 and
    Q8_0 matrices, float32 tensors for the rest (other quantized types dequantized, logged)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    except Exception as e:  # the reader raises ValueError, struct and numpy errors on a damaged file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    out: dict[str, Weight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has no place in a {cfg.architecture} model")
        kind = GGMLQuantizationType(t.tensor_type).name
        shape = [int(n) for n in reversed(t.shape.tolist())]  # ggml lists the row length first
        weight: Weight
        if kind in BLOCK_KINDS and len(shape) == 2:
            weight = decode_blocks(t.name, kind, t.data, *shape)
        elif kind in _FLOAT_KINDS:
            values = np.asarray(t.data, dtype=np.float32)
            if values.size != math.prod(shape):
                raise ModelLoadError(f"GGUF tensor {t.name!r} holds {values.size} values, expected {math.prod(shape)}: "
                                     "the file is truncated or damaged")
            weight = torch.from_numpy(values.reshape(shape).copy())
        else:
            logger.info("%s: tensor %s is %s, which no kernel here takes as stored: dequantized to float32",
                        path, t.name, kind)
            try:
                weight = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
            except (ValueError, NotImplementedError) as e:
                raise ModelLoadError(f"GGUF tensor {t.name!r} ({kind}) cannot be read: {e}") from e
        if arch in PERMUTED_ARCHITECTURES and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            order = _qk_order(shape[0], heads)
            weight = weight.rows(order) if isinstance(weight, BlockWeight) else weight[order]
        out[name] = weight
    return out


def write_gguf(path: str | Path, weights: dict[str, torch.Tensor], cfg: ModelConfig, linear_kind: str = "Q4_1",
               embedding_kind: str = "Q8_0") -> Path:
    """Store a model's float weights (Hugging Face names) as a GGUF file of architecture llama: the
    projections as `linear_kind` blocks, the embedding (and an untied head) as `embedding_kind`,
    norms in float32; quantized with gguf's reference quantizers (ggml's rounding)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    for kind in (linear_kind, embedding_kind):
        if kind not in BLOCK_KINDS:
            raise ValueError(f"block kind must be one of {', '.join(BLOCK_KINDS)}, got {kind!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_block_count(cfg.num_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in weights.items():
        theirs = gguf_name(name)
        values = tensor.detach().float().contiguous()
        if theirs.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg.num_heads if ".attn_q." in theirs else cfg.num_kv_heads
            values = values[torch.argsort(_qk_order(values.shape[0], heads))]
        array = values.numpy()
        if values.dim() != 2:
            writer.add_tensor(theirs, array)
            continue
        kind = embedding_kind if theirs.startswith(("token_embd.", "output.")) else linear_kind
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(theirs, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path

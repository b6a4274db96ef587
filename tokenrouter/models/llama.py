"""The Llama family (Llama 2/3, SmolLM2, Mistral without sliding window) over a flat batch of extends.

Qwen2 (and Qwen2.5, DeepSeek-R1-Distill-Qwen) is the same network with a bias on q, k and v (none on
o_proj); Qwen3 adds RMSNorm on each head's q and k (see qwen3.py). Parameter names follow
the Hugging Face checkpoints so weights load by name; q/k/v and gate/up are fused at load time.

Tensor parallelism (a `TPGroup` of size > 1): rank r holds num_heads / tp query heads and
num_kv_heads / tp KV heads (fused per shard as [q_r; k_r; v_r]), intermediate / tp MLP columns, and a
vocabulary slice of the embedding and LM head; o_proj and down_proj all-reduce their partial sums
(see tokenrouter/models/parallel_layers.py). `checkpoint_slice` tells the loader which part of each
checkpoint tensor a rank reads (a q/k/v bias is cut and fused as its weight's rows are). With the
default group of size 1 nothing is split or communicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from tokenrouter.models import block_gemm, layer_loop, onednn_linear, packed_linear, quantized_linear, skinny_gemm
from tokenrouter.models.attention import paged_decode_kernel
from tokenrouter.models.attention.backend import AttentionBackend
from tokenrouter.models.block_gemm import PackedBlocks
from tokenrouter.models.config import ModelConfig, ModelLoadError
from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.fused_ops import FusedOps
from tokenrouter.models.gguf_weights import BlockWeight, Weight
from tokenrouter.models.layer_loop import LayerLoop, LoopLayer
from tokenrouter.models.layers import GatedMLP, RMSNorm, Rope, RotaryEmbedding, rotate
from tokenrouter.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_logits,
)
from tokenrouter.models.screened_head import ScreenedHead
from tokenrouter.models.tp_group import TPGroup, check_tp_divisible


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp)
        self.qk_norm = cfg.qk_norm
        self.fused: FusedOps | None = None  # set by use_fused_ops (float32 CPU only)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk_width = self.q_size + self.kv_size
        v = qkv[:, qk_width:].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # each of q and k has its own norm weights: rotated apart
            q = rotate(self.q_norm(qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim)), rope, self.fused)
            k = rotate(self.k_norm(qkv[:, self.q_size:qk_width].view(-1, self.num_kv_heads, self.head_dim)), rope,
                       self.fused)
        else:  # q and k sit side by side in the fused product: one rotation for both
            qk = rotate(qkv[:, :qk_width].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), rope,
                        self.fused)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = attn.forward(self.layer, q, k, v)
        return self.o_proj(out.view(-1, self.q_size))


class FlatLayer(NamedTuple):
    """A decoder layer's tensors and products as `DecoderLayer.fused_forward` reads them, gathered once
    (by `LlamaForCausalLM.use_fused_ops`): read through the modules, each costs a Python attribute
    lookup of about a microsecond (nn.Module.__getattr__), half of what the flat loop saves. The
    products are the linear layers' own bound methods, so they still take whatever weights the
    layer serves at call time (quantized, packed or plain)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    qkv_bias: torch.Tensor | None
    o: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    o_bias: torch.Tensor | None
    gate_up: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    down: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    layer: int
    heads: int
    kv_heads: int
    head_dim: int
    quantized: QuantizedLayer | None  # where all four products have a quantized weight
    quantized_rows: int  # the most rows of a step `quantized` takes


class QuantizedLayer(NamedTuple):
    """A decoder layer's four quantized weights, which `fused_forward` runs in bfloat16 end to end."""

    qkv: quantized_linear.QuantizedLinear | PackedBlocks
    o: quantized_linear.QuantizedLinear | PackedBlocks
    gate_up: quantized_linear.QuantizedLinear | PackedBlocks
    down: quantized_linear.QuantizedLinear | PackedBlocks


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.flat: FlatLayer | None = None  # set by use_fused_ops, for a layer fused_forward serves

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_forward(self.self_attn(self.input_layernorm(x), rope, attn), x)
        return x + self.mlp(h)

    def flat_layer(self) -> FlatLayer:
        a, mlp = self.self_attn, self.mlp
        weights = (a.qkv_proj.quantized, a.o_proj.quantized, mlp.gate_up_proj.quantized, mlp.down_proj.quantized)
        return FlatLayer(self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
                         a.qkv_proj.product, a.qkv_proj.bias, a.o_proj.product, a.o_proj.bias,
                         mlp.gate_up_proj.product, mlp.down_proj.product, a.layer, a.num_heads, a.num_kv_heads,
                         a.head_dim, None if None in weights else QuantizedLayer(*weights),
                         min(m.quantized_rows for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)))

    def fused_forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend, ops: FusedOps) -> torch.Tensor:
        """`forward` on the fused C ops (models/fused_ops.py) for a layer without q/k norms on one rank
        (`self.flat` set): the same calls in the same order (bit-identical, tests/test_quantized_linear.py),
        without a module call and layout check per block. x: the float32 CPU hidden rows, contiguous.

        Why: a small quantized step's products are fast enough that the rest is mostly Python. At
        one row SmolLM2's 30 layers took 9.25 ms through the blocks and 7.6 ms here on two threads,
        12.6 and 11.1 ms on one (2-core Intel Xeon with AMX, 2026-12-05). Where all four products
        are quantized, the rows stay in the kernels' bfloat16 between them and the fused ops (six
        conversion ops a layer fewer, about 2 us each)."""
        f = self.flat
        assert f is not None, "fused_forward needs the layer's FlatLayer (use_fused_ops)"
        q = f.quantized if x.shape[0] <= f.quantized_rows else None
        h, hk, d = f.heads, f.kv_heads, f.head_dim
        if q is None:
            qkv = f.qkv(ops.rms_norm(x, f.input_norm, f.eps)[1], f.qkv_bias)
        else:  # the quantized products' bfloat16 goes into and out of the fused ops without a conversion op
            qkv = quantized_linear.product(ops.rms_norm(x, f.input_norm, f.eps, out_dtype=torch.bfloat16)[1],
                                           q.qkv).float()
            if f.qkv_bias is not None:
                qkv = qkv + f.qkv_bias
        qk = ops.rotate(qkv[:, :(h + hk) * d].view(-1, h + hk, d), *rope)
        out = attn.forward(f.layer, qk[:, :h], qk[:, h:], qkv[:, (h + hk) * d:].view(-1, hk, d)).view(-1, h * d)
        if q is None:
            x, y = ops.rms_norm(f.o(out, f.o_bias).contiguous(), f.post_norm, f.eps, x)
            return x + f.down(ops.silu_mul(f.gate_up(y, None)), None)
        o = quantized_linear.product(out.to(torch.bfloat16), q.o)
        if f.o_bias is not None:
            o = o.float() + f.o_bias
        x, y = ops.rms_norm(o, f.post_norm, f.eps, x, out_dtype=torch.bfloat16)
        return x + quantized_linear.product(ops.silu_mul(quantized_linear.product(y, q.gate_up)), q.down)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


LayerCall = Callable[[DecoderLayer, torch.Tensor, Rope, AttentionBackend], torch.Tensor]


# HF checkpoint name fragment -> (our fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


# A fused linear layer's checkpoint parts, in the order its rows hold them.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _merge_blocks(parts: list[Weight | None]) -> BlockWeight | None:
    """The parts stacked by rows, where all are blocks of one kind (else None)."""
    if not all(isinstance(p, BlockWeight) for p in parts):
        return None
    blocks = [p for p in parts if isinstance(p, BlockWeight)]
    if len({b.kind for b in blocks}) != 1:
        return None
    if len(blocks) == 1:
        return blocks[0]
    mins = None if blocks[0].mins is None else torch.cat([b.mins for b in blocks if b.mins is not None])
    return BlockWeight(blocks[0].kind, torch.cat([b.codes for b in blocks]), torch.cat([b.scales for b in blocks]),
                       mins)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TPGroup.single()
        check_tp_divisible(cfg, tp.size, f"this {cfg.architecture} model")
        self.config = cfg
        self.model = Backbone(cfg, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.lm_head_packed: packed_linear.PackedLinear | None = None  # pack_linear_weights
        self.max_step_rows = 0  # pack_linear_weights: the most rows a step runs
        self.lm_head_screened: ScreenedHead | None = None  # pack_linear_weights, with the skinny kernel
        self.fused_ops: FusedOps | None = None  # use_fused_ops
        self.layer_loop: LayerLoop | None = None  # use_fused_ops, where every layer's products are blocks

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's vocabulary rows of the output projection (all of them without TP)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Final normalised hidden states [T, hidden] for every row of the batch."""
        return self.forward_tokens(batch.input_ids, batch.positions, attn)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                       run_layer: LayerCall | None = None) -> torch.Tensor:
        """`forward` on bare tensors (attn planned or bound already). `run_layer(layer, x, rope, attn)`
        runs each decoder layer in place of a plain call: the compiled decode step passes one compiled
        function that serves every layer. The positions' rotary angles are looked up once per step."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.angles(positions)
        ops = self.fused_ops if run_layer is None and self.model.layers[0].flat is not None else None
        loop = self.layer_loop if ops is not None else None
        if loop is not None and x.shape[0] <= loop.max_rows:
            plan = attn.kernel_plan()
            if plan is not None:  # every layer in one C call, attention included
                return self.model.norm(loop(x.contiguous(), rope, plan, attn.pool))
        for layer in self.model.layers:
            if ops is not None:
                x = layer.fused_forward(x, rope, attn, ops)
            else:
                x = layer(x, rope, attn) if run_layer is None else run_layer(layer, x, rope, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full float32 logits [N, vocab] (under TP every rank computes its slice; all-gathered)."""
        return parallel_logits(hidden, self.lm_head_weight, self.config.vocab_size, self.tp,
                               self.lm_head_packed).float()

    def pack_linear_weights(self, max_step_rows: int, max_sampled_rows: int,
                            skinny: skinny_gemm.SkinnyGemm | None) -> None:
        """Prepack every linear weight and the output head (float32 on CPU, no tensor parallelism;
        models/packed_linear.py: the `skinny` kernel for few rows where given, oneDNN for the rest;
        with the kernel, the head's screen too: models/screened_head.py)
        and warm up the row counts a step of up to `max_step_rows` rows, sampling up to
        `max_sampled_rows`, runs at. The original weights stay for loading and tests."""
        assert self.tp.size == 1, "packed linears are for a single rank"
        self.max_step_rows = max_step_rows
        pairs = []
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.packed = packed_linear.pack(module.weight, skinny)
                pairs.append((module.weight, module.packed))
        self.lm_head_packed = packed_linear.pack(self.lm_head_weight, skinny)
        if skinny is not None:
            self.lm_head_screened = ScreenedHead(self.lm_head_weight, skinny)
        packed_linear.warm_up(pairs, max_step_rows)
        packed_linear.warm_up([(self.lm_head_weight, self.lm_head_packed)], max_sampled_rows)
        if self.lm_head_screened is not None and max_sampled_rows > quantized_linear.MAX_ROWS:
            self.lm_head_screened.fit_rows(self.compute_logits)

    def quantize_linear_weights(self, blocks: dict[str, Weight] | None) -> list[str]:
        """Give the linear layers, and the head's screen where it has one, a quantized form for the
        quantized kernel's row counts (models/quantized_linear.py): from `blocks` (a GGUF file's
        tensors by Hugging Face name, gguf_weights.read_gguf) or, with None, int8 per output channel
        of the float weights. Where oneDNN runs bfloat16 natively, a quantized weight's larger inputs
        take its values in bfloat16 (`wide`, quantized_linear.WIDE_ROWS) instead of the packed float32
        weight, which is dropped. Returns the weights left on the float path: those whose tensors are
        not all blocks of one kind (a fused q/k/v or gate/up must be). Call after pack_linear_weights."""
        assert self.tp.size == 1, "quantized linears are for a single rank"
        left = []
        wide = onednn_linear.bfloat16_available()
        widened = []
        for name, module in self.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if blocks is None:
                module.quantized = quantized_linear.int8_per_channel(module.weight)
            else:
                stored = f"{name}.weight"
                parts = [blocks.get(stored.replace(".qkv_proj.", f".{p}.").replace(".gate_up_proj.", f".{p}."))
                         for p in _FUSED_PARTS.get(name.rsplit(".", 1)[-1], ("",))]
                merged = _merge_blocks(parts)
                if merged is None:
                    left.append(name)
                    continue
                module.quantized = quantized_linear.for_layer(merged)
            if wide:
                values = module.weight.detach().to(torch.bfloat16)
                module.wide, module.packed = onednn_linear.pack(values), None
                widened.append((values, module.wide))
        onednn_linear.warm_up(widened, self.max_step_rows, min_rows=quantized_linear.WIDE_ROWS)
        head_name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        if self.lm_head_screened is not None:
            source = None if blocks is None else blocks.get(head_name)
            # The head's own blocks on block_gemm where it serves: 2.2x the better of int8 per channel
            # and the pair screen at one row on two threads, a bound 63x tighter (docs/DESIGN.md
            # section 8). Elsewhere a Q8_0 head screens as int8 per channel: its exact form on the int4
            # kernel is two nibble planes, twice the work (SmolLM2's head at one row on two threads:
            # 1.59 ms as two planes, 0.97 ms as int8; benchmarks/handoff_ab.py, 2026-12-06).
            if isinstance(source, BlockWeight) and quantized_linear.on_block_gemm(source):
                self.lm_head_screened.add_quantized(block_gemm.pack(source), source)
            elif blocks is None or (isinstance(source, BlockWeight) and source.kind == "Q8_0"):
                self.lm_head_screened.add_quantized(quantized_linear.int8_per_channel(self.lm_head_weight), None)
            elif isinstance(source, BlockWeight):
                self.lm_head_screened.add_quantized(quantized_linear.from_blocks(source), source)
            else:
                left.append(head_name)
        if self.fused_ops is not None:
            self.use_fused_ops(self.fused_ops)  # the flat layers gather the quantized weights
        return left

    def use_fused_ops(self, ops: FusedOps) -> None:
        """Norms, rotary and SiLU on the fused C ops (float32 on CPU; models/fused_ops.py) from here on
        (the runner's sampler takes their argmax too)."""
        self.fused_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, GatedMLP)):
                module.fused = ops
        if not self.config.qk_norm and self.tp.size == 1:
            for layer in self.model.layers:
                layer.flat = layer.flat_layer()
        self.layer_loop = self._layer_loop(ops)

    def _layer_loop(self, ops: FusedOps) -> LayerLoop | None:
        """The C loop over every layer (models/layer_loop.py), where each layer's four products are
        blocks on block_gemm without a bias and the loop's library builds; else None. It takes steps of
        up to the quantized kernel's rows on the blocks, also where the eager layers take the bfloat16
        values from WIDE_ROWS on: the loop saves their per-layer calls (SmolLM2, two threads, 2-core
        Xeon, 2026-12-07: decode batches of 9 / 12 / 16 rows 1.65x / 1.42x / 1.30x the eager step over
        64 keys, 1.23x / 1.15x / 1.10x over 1,000)."""
        flats = [layer.flat for layer in self.model.layers]
        loop_layers = []
        for f in flats:
            if f is None or f.quantized is None or f.qkv_bias is not None or f.o_bias is not None \
                    or not all(isinstance(w, PackedBlocks) for w in f.quantized):
                return None
            loop_layers.append(LoopLayer(f.input_norm, f.post_norm, tuple(f.quantized)))
        lib = layer_loop.load_library_once()
        if lib is None or block_gemm.load_kernel() is None or paged_decode_kernel.load_kernel() is None:
            return None
        f = flats[0]
        return LayerLoop(lib, ops, loop_layers, f.heads, f.kv_heads, f.head_dim, f.eps, quantized_linear.MAX_ROWS)

    # ---- loading ---------------------------------------------------------------------------
    def checkpoint_slice(self, name: str) -> tuple[int, int, int, int] | None:
        """The part of checkpoint tensor `name` this rank holds: (dim, start, end, full size along
        dim), or None for all of it (replicated tensors, or no tensor parallelism)."""
        tp, cfg = self.tp, self.config
        if tp.size == 1:
            return None
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            emb = self.model.embed_tokens
            return 0, emb.start, emb.end, cfg.vocab_size
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        full = None
        if ".q_proj." in name:
            dim, full = 0, q
        elif ".k_proj." in name or ".v_proj." in name:
            dim, full = 0, kv
        elif ".gate_proj." in name or ".up_proj." in name:
            dim, full = 0, inter
        elif name.endswith(".o_proj.weight"):
            dim, full = 1, q
        elif name.endswith(".down_proj.weight"):
            dim, full = 1, inter
        if full is None:
            return None  # norms, o_proj bias: every rank holds all of it
        start, end = tp.shard(full)
        return dim, start, end, full

    def checkpoint_tensor(self, name: str) -> torch.Tensor | None:
        """The loaded values of checkpoint tensor `name` (one rank; a fused parameter's rows for a
        part, the head's weight for a tied lm_head), or None where the model has no such tensor."""
        if name == "lm_head.weight":
            return self.lm_head_weight
        params = dict(self.named_parameters())
        for frag, (fused, shard) in _STACKED.items():
            if frag in name and name.replace(frag, fused) in params:
                lo, hi = self._shard_bounds(fused, shard)
                return params[name.replace(frag, fused)].data[lo:hi]
        param = params.get(name)
        return None if param is None else param.data

    def _shard_bounds(self, fused: str, shard: int) -> tuple[int, int]:
        """Rows of this rank's fused parameter that hold checkpoint shard `shard` (q/k/v, gate/up)."""
        cfg, n = self.config, self.tp.size
        if fused == ".qkv_proj.":
            q, kv = cfg.num_heads * cfg.head_dim // n, cfg.num_kv_heads * cfg.head_dim // n
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        i = cfg.intermediate_size // n
        return [(0, i), (i, 2 * i)][shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by Hugging Face name; raise naming any missing parameter.
        Under tensor parallelism a tensor may come whole or already cut to this rank's slice
        (`checkpoint_slice`, as model_loader reads it); a whole one is cut here."""
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            spec = self.checkpoint_slice(name)
            if spec is not None:
                dim, start, end, full = spec
                if tensor.dim() > dim and tensor.shape[dim] == full != end - start:
                    tensor = tensor.narrow(dim, start, end - start)
            target, bounds = name, None
            for frag, (fused, shard) in _STACKED.items():
                if frag in name:
                    target, bounds = name.replace(frag, fused), self._shard_bounds(fused, shard)
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no place in this {self.config.architecture} model")
            if bounds is None and spec is not None and spec[0] == 0 and name.endswith("weight") and (
                    "embed_tokens" in name or name == "lm_head.weight"):
                bounds = (0, spec[2] - spec[1])  # a vocabulary shard: the padding rows stay zero
            dest = param.data if bounds is None else param.data[bounds[0]:bounds[1]]
            if dest.shape != tensor.shape:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    + (f" (rank {self.tp.rank} of {self.tp.size}'s slice)" if self.tp.size > 1 else "")
                )
            dest.copy_(tensor)
            loaded[target] = loaded.get(target, 0) + 1
        expected = {n: (3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1) for n in params}
        missing = sorted(n for n, count in expected.items() if loaded.get(n, 0) < count)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, first: {missing[0]!r}")

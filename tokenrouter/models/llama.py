"""The Llama family (Llama 2/3, SmolLM2, Mistral without sliding window) over a flat batch of extends.

Qwen3 is the same network plus RMSNorm on each head's q and k (see qwen3.py). Parameter names follow
the Hugging Face checkpoints so weights load by name; q/k/v and gate/up are fused at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenrouter.attention.backend import AttentionBackend
from tokenrouter.forward_batch import ForwardBatch
from tokenrouter.models.config import ModelConfig, ModelLoadError
from tokenrouter.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = attn.forward(self.layer, q, k, v)
        return self.o_proj(out.view(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# HF checkpoint name fragment -> (our fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Final normalised hidden states [T, hidden] for every row of the batch."""
        x = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            x = layer(x, batch.positions, self.rotary, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head_weight.t()).float()

    def _shard_bounds(self, fused: str, shard: int) -> tuple[int, int]:
        cfg = self.config
        if fused == ".qkv_proj.":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        i = cfg.intermediate_size
        return [(0, i), (i, 2 * i)][shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by Hugging Face name; raise naming any missing parameter."""
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, bounds = name, None
            for frag, (fused, shard) in _STACKED.items():
                if frag in name:
                    target, bounds = name.replace(frag, fused), self._shard_bounds(fused, shard)
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no place in this {self.config.architecture} model")
            dest = param.data if bounds is None else param.data[bounds[0]:bounds[1]]
            if dest.shape != tensor.shape:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded[target] = loaded.get(target, 0) + 1
        expected = {n: (3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1) for n in params}
        missing = sorted(n for n, count in expected.items() if loaded.get(n, 0) < count)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, first: {missing[0]!r}")

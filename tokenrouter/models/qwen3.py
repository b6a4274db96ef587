"""Qwen3: the Llama network with RMSNorm on every head's q and k before rotary embedding.

`ModelConfig.qk_norm` is true for this family; `Attention` adds the two norms, and their weights
(`self_attn.q_norm.weight`, `self_attn.k_norm.weight`) load by name.
"""

from __future__ import annotations

from tokenrouter.models.config import ModelConfig
from tokenrouter.models.llama import LlamaForCausalLM
from tokenrouter.models.tp_group import TPGroup


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        if not cfg.qk_norm:
            raise ValueError("Qwen3ForCausalLM needs a qwen3 config (q/k norm)")
        super().__init__(cfg, tp)

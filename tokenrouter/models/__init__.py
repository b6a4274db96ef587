"""Model families, chosen by the architecture named in config.json."""

from __future__ import annotations

from tokenrouter.models.config import ModelConfig
from tokenrouter.models.llama import LlamaForCausalLM
from tokenrouter.models.qwen3 import Qwen3ForCausalLM
from tokenrouter.models.tp_group import TPGroup

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,  # the Llama network; ModelConfig.qkv_bias gives it its q/k/v bias
    "qwen3": Qwen3ForCausalLM,
}


def build_model(cfg: ModelConfig, tp: TPGroup | None = None) -> LlamaForCausalLM:
    """The model (this rank's shard of it under tensor parallelism), with uninitialised weights."""
    return MODEL_CLASSES[cfg.architecture](cfg, tp)

"""The model facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Hugging Face architecture name -> our model family.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# config.json's model_type -> our model family, for a config that names no architecture.
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class ModelLoadError(ValueError):
    """The folder is not a model this engine can load; the message says why."""


def _sliding_window_refusal(d: dict[str, Any], family: str) -> str | None:
    """Why config `d` needs sliding-window attention, which the engine does not implement (every layer
    attends over the whole context), or None where no window ever cuts anything: the layers with one
    are those transformers gives one, and a window as long as the context (max_position_embeddings,
    which caps the engine's) sees all of it."""
    window = d.get("sliding_window")
    context = int(d.get("max_position_embeddings", 2048))
    if not window or window >= context:
        return None
    if family == "llama":  # Mistral has no switch: a window set is a window used, on every layer
        return f"sliding_window is {window}, shorter than max_position_embeddings {context}"
    # Qwen2 and Qwen3 configs carry a window with use_sliding_window false: it is off.
    if not d.get("use_sliding_window", False):
        return None
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types:
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
        source = "layer_types"
    else:
        first = int(d.get("max_window_layers", 28))  # transformers' default in both families
        sliding = list(range(first, layers))
        source = f"max_window_layers {first}"
    if not sliding:
        return None
    return (f"use_sliding_window is true and sliding_window {window} (shorter than max_position_embeddings "
            f"{context}) applies to {len(sliding)} of the {layers} layers ({source})")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Llama's and Qwen3's field: a bias on all four attention projections
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has a bias on q, k and v (transformers ignores attention_bias there)."""
        return self.architecture == "qwen2" or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        """Qwen2 never has one on o_proj."""
        return self.architecture != "qwen2" and self.attention_bias

    @classmethod
    def from_dict(cls, d: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = d.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            model_type = d.get("model_type")
            family = MODEL_TYPES.get(model_type or "")
        if family is None:
            name = archs[0] if archs else d.get("model_type", "<none>")
            raise ModelLoadError(
                f"unsupported model architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is implemented")
        if family == "llama" and d.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=True is not supported")
        sliding = _sliding_window_refusal(d, family)
        if sliding is not None:
            raise ModelLoadError(f"sliding-window attention is not supported: {sliding}")
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or None
        scaling_field = "rope_scaling"
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling, scaling_field = rope, "rope_parameters"
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "default":
                scaling = None
            elif kind not in ("linear", "llama3"):
                raise ModelLoadError(f"unsupported rope scaling {kind!r} in {scaling_field}; supported: linear, llama3")
        num_heads = int(d["num_attention_heads"])
        eos = (generation or {}).get("eos_token_id", d.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"model path {str(folder)!r} is not a folder")
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{str(folder)!r} is not a model folder: it has no config.json")
        try:
            d = json.loads(cfg_file.read_text())
            gen_file = folder / "generation_config.json"
            gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file}: invalid JSON ({e})") from e
        try:
            return cls.from_dict(d, gen)
        except KeyError as e:
            raise ModelLoadError(f"{cfg_file}: missing field {e.args[0]!r}") from e

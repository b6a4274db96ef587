"""Load a model from a Hugging Face folder: config.json, *.safetensors, generation_config.json."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenrouter.models import build_model
from tokenrouter.models.config import ModelConfig, ModelLoadError
from tokenrouter.models.llama import LlamaForCausalLM


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from e


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    folder = Path(path)
    cfg = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(folder)!r} has no *.safetensors weight files")
    with torch.device(device):
        model = build_model(cfg)
    model.to(dtype)
    model.rotary.float()  # angles stay float32 whatever the model dtype
    model.load_weights(_iter_safetensors(files))
    model.eval().requires_grad_(False)
    return model

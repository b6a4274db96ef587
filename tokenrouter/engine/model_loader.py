"""Load a model from a Hugging Face folder: config.json, *.safetensors, generation_config.json.

Under tensor parallelism each rank reads only its slice of each sharded tensor (safetensors
`get_slice`, so the rest is never copied out of the file)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenrouter.models import build_model
from tokenrouter.models.config import ModelConfig, ModelLoadError
from tokenrouter.models.gguf_weights import GGUF_FILE, BlockWeight, read_gguf
from tokenrouter.models.llama import LlamaForCausalLM
from tokenrouter.models.tp_group import TPGroup

logger = logging.getLogger(__name__)


def _iter_safetensors(files: list[Path], model: LlamaForCausalLM | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    spec = model.checkpoint_slice(name) if model is not None else None
                    if spec is None:
                        yield name, st.get_tensor(name)
                        continue
                    dim, start, end, full = spec
                    sl = st.get_slice(name)
                    shape = sl.get_shape()
                    if len(shape) <= dim or shape[dim] != full:
                        yield name, st.get_tensor(name)  # misshapen: load_weights names it
                    elif dim == 0:
                        yield name, sl[start:end]
                    else:
                        yield name, sl[:, start:end]
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from e


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device,
               tp: TPGroup | None = None) -> LlamaForCausalLM:
    """The model, or with a tensor-parallel group of size > 1 this rank's shard of it."""
    folder = Path(path)
    cfg = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(folder)!r} has no *.safetensors weight files")
    with torch.device(device):
        model = build_model(cfg, tp)
    model.to(dtype)
    model.rotary.float()  # angles stay float32 whatever the model dtype
    model.load_weights(_iter_safetensors(files, model))
    model.eval().requires_grad_(False)
    return model


def load_tensor(path: str | Path, name: str) -> torch.Tensor:
    """One whole tensor of a checkpoint folder, by name."""
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise ModelLoadError(f"{str(path)!r} has no tensor {name!r}")


def quantize(model: LlamaForCausalLM, path: str | Path, quantization: str) -> str:
    """Give a loaded (and packed) model its quantized products as `quantization` asks (EngineConfig):
    auto serves the folder's GGUF_FILE blocks where it has one, int8 quantizes the float weights.
    The blocks must be the folder's float weights exactly (a folder converted from the file, or a
    student stored as prepare stores it): a folder whose two copies disagree is refused, naming the
    tensor. Returns what is served, for the log and the server's model card."""
    gguf = Path(path) / GGUF_FILE
    if quantization == "none" or (quantization == "auto" and not gguf.is_file()):
        return "none"
    if quantization == "int8":
        model.quantize_linear_weights(None)
        return "int8 (weight-only, per output channel)"
    blocks = read_gguf(gguf, model.config)
    for name, weight in blocks.items():
        values = weight.dequantize() if isinstance(weight, BlockWeight) else weight
        target = model.checkpoint_tensor(name)
        if target is None or not torch.equal(values, target):
            if target is None:
                what = "has no place in the model"
            elif values.shape == target.shape:
                gap = float((values - target).abs().max())
                what = f"differs from the folder's float weights (largest difference {gap:.3g})"
            else:
                what = f"has shape {tuple(values.shape)}, the model {tuple(target.shape)}"
            raise ModelLoadError(f"{gguf}: tensor {name!r} {what}; the folder's two copies of the model disagree: "
                                 f"convert it again, or remove {GGUF_FILE} to serve the float weights")
    left = model.quantize_linear_weights(blocks)
    kinds = sorted({w.kind for w in blocks.values() if isinstance(w, BlockWeight)})
    if left:
        logger.info("%s: %d weights stay on float32 products (not blocks of one kind), first %s", gguf, len(left),
                    left[0])
    return f"gguf ({', '.join(kinds) or 'no blocks'})"


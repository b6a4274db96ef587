"""Engine settings for one model, with SGLang/vLLM-style names."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

# The default of engines that do not choose: 1 runs decode steps eagerly (the test suite sets it), 0
# compiles them on every device; unset, the device decides (see EngineConfig.compiles_decode).
DISABLE_CUDA_GRAPH_ENV = "TOKENROUTER_DISABLE_CUDA_GRAPH"


def _cuda_graph_disabled_by_env() -> bool | None:
    return {"1": True, "0": False}.get(os.environ.get(DISABLE_CUDA_GRAPH_ENV, ""))


LINEAR_BACKENDS = ("auto", "aten", "onednn", "skinny")
# auto: a folder's GGUF blocks as stored where it holds them (models/gguf_weights.py), else float;
# none: the float weights; int8: weight-only int8 per output channel of the float weights.
QUANTIZATIONS = ("auto", "none", "int8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model_path: str
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    page_size: int = 16
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    kv_cache_tokens: int | None = None  # KV pool size in tokens; overrides mem_fraction
    mem_fraction: float | None = None  # share of free device memory (host memory on CPU) for the KV pool
    max_model_len: int | None = None  # context length; default: the model's, capped by the KV pool
    enable_prefix_cache: bool = True
    attention_backend: str = "torch"
    seed: int = 0  # seeds the per-request seeds of requests that bring none
    num_threads: int | None = None  # torch threads on CPU; None leaves torch's setting
    load_tokenizer: bool = True
    # Tensor parallelism: ranks 1..tp_size-1 run in worker processes the engine spawns (gloo on CPU,
    # NCCL on CUDA, where rank r uses the GPU r places after `device`).
    tp_size: int = 1
    # Decode steps, and steps of short extends whose requests all sample (catch-ups after a peer's
    # turn, short prompts; a row per new token), run compiled per row bucket (CUDA graphs on CUDA,
    # torch.compile on CPU; SGLang's names); true runs every step eagerly, false compiles on every
    # device. None (the default): compiled on CUDA, eager on CPU, where the compiled step measured
    # slower (docs/BENCHMARKS.md, "Compiled decode step"). Prompt chunks always run eagerly.
    disable_cuda_graph: bool | None = field(default_factory=_cuda_graph_disabled_by_env)
    cuda_graph_max_bs: int | None = None  # most rows (new tokens) a compiled step takes; default max_running_requests
    # Linear layers (float32 on CPU, one rank, eager decode; models/packed_linear.py): "skinny" runs
    # inputs of up to 64 rows on the skinny GEMM (built with the C compiler) while a step runs on one
    # torch thread, and larger ones (and all on more threads) on oneDNN, with norms, rotary and SiLU on
    # fused C ops (models/fused_ops.py); "onednn" runs every row count on oneDNN, "aten" is PyTorch's
    # F.linear everywhere (both with PyTorch's element-wise ops); "auto" takes skinny where it builds,
    # else onednn wherever it applies, else aten.
    linear_backend: str = "auto"
    # Weight-only quantized products for inputs of up to quantized_linear.MAX_ROWS rows (float32 on
    # CPU, one rank, eager decode; models/quantized_linear.py), vLLM's --quantization: see QUANTIZATIONS.
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.mem_fraction is not None and not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {self.tp_size!r}")
        max_bs = self.cuda_graph_max_bs
        if max_bs is not None and (isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1):
            raise ValueError(f"cuda_graph_max_bs must be an integer >= 1, got {self.cuda_graph_max_bs!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {self.linear_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization == "int8" and self.linear_backend == "aten":
            raise ValueError("quantization int8 runs on packed linears; linear_backend aten turns them off")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def compiles_decode(self, device: torch.device) -> bool:
        """Whether decode steps run compiled on `device` (see disable_cuda_graph)."""
        return device.type == "cuda" if self.disable_cuda_graph is None else not self.disable_cuda_graph

    def packs_linears(self, device: torch.device, dtype: torch.dtype, onednn_available: bool) -> bool:
        """Whether the model's linear weights are prepacked (skinny or onednn; see linear_backend)."""
        applies = (device.type == "cpu" and dtype == torch.float32 and self.tp_size == 1
                   and not self.compiles_decode(device) and onednn_available)
        if self.linear_backend in ("onednn", "skinny") and not applies:
            raise ValueError(f"linear_backend {self.linear_backend} needs float32 on CPU, tp_size 1, eager "
                             "decode steps and a PyTorch built with oneDNN")
        return applies and self.linear_backend != "aten"

    def uses_skinny(self) -> bool:
        """Whether the skinny GEMM (few rows of packed linears, while a step runs on one thread:
        models/packed_linear.py) and the fused element-wise ops are built: linear_backend auto or skinny."""
        return self.linear_backend in ("auto", "skinny")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]

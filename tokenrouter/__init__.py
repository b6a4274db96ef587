"""tokenrouter: a serving system for token-level LLM routing."""

import os

# A decode step streams every weight from memory; in 2 MiB pages it misses the TLB far less. torch's
# CPU allocator gives its large blocks transparent huge pages under THP_MEM_ALLOC_ENABLE, read once, at
# its first allocation: hence set here, before torch is imported (the subservers inherit it). SmolLM2 at
# one row on two threads: 11.46 -> 10.62 ms a step (docs/BENCHMARKS.md, "Against llama.cpp"). A value
# the user set stands.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tokenrouter.llm import LLM, register_default_model
from tokenrouter.outputs import CompletionOutput, RequestOutput
from tokenrouter.sampling_params import SamplingParams, StructuredOutput
from tokenrouter.version import __version__


def embedded_default_model() -> str:
    """The training layer's embedded default model, prepared on first use: what `LLM()` loads."""
    from tokenrouter.training.default_model import ensure_default_model

    return str(ensure_default_model())


register_default_model(embedded_default_model)

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "RequestOutput", "CompletionOutput", "__version__"]

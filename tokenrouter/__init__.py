"""tokenrouter: a serving system for token-level LLM routing."""

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

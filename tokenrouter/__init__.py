"""tokenrouter: a serving system for token-level LLM routing."""

from tokenrouter.llm import LLM
from tokenrouter.outputs import CompletionOutput, RequestOutput
from tokenrouter.sampling_params import SamplingParams, StructuredOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

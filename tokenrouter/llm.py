"""The offline API in vLLM's shape: `LLM(model).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.req import Req
from tokenrouter.outputs import CompletionOutput, RequestMetrics, RequestOutput, prompt_logprob_entries
from tokenrouter.prompts import PromptType, prepare_requests
from tokenrouter.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The path of the model `LLM()` loads when given none. The layers above register it (the package's
# face registers the training layer's embedded default), since this layer may not import them.
_default_model: Callable[[], str] | None = None


def register_default_model(resolver: Callable[[], str]) -> None:
    """Set the function `LLM()` calls, with no model given, for the path of the model to load."""
    global _default_model
    _default_model = resolver


class LLM:
    """Generate with one model, offline. Keyword arguments are `EngineConfig` fields
    (dtype, max_running_requests, chunked_prefill_size, kv_cache_tokens, page_size, ...).
    With no model, the embedded default model is used."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is None:
            if _default_model is None:
                raise ValueError("LLM needs a model path: none was given and no default model is registered")
            model = _default_model()
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(unknown)}")
        self.engine = Engine(EngineConfig(model_path=model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        Every prompt is validated before any runs, so one bad prompt rejects the call and leaves the
        engine as it was.
        """
        requests = prepare_requests(prompts, prompt_token_ids, sampling_params, self.engine.tokenize)
        encoded = [(text, ids) for text, ids, _ in requests]
        params = [sp for _, _, sp in requests]
        for i, ((_, ids), sp) in enumerate(zip(encoded, params)):
            try:
                self.engine.validate(ids, sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        eng = self.engine
        reqs: list[Req] = [eng.add_request(ids, sp) for (_, ids), sp in zip(encoded, params)]
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while eng.has_unfinished():
                result = eng.step()
                bar.update(len(result.finished))
        except BaseException:
            for r in reqs:
                eng.abort(r.rid)
            raise
        finally:
            bar.close()
        return [self._output(r, text) for r, (text, _) in zip(reqs, encoded)]

    def _output(self, req: Req, prompt: str | None) -> RequestOutput:
        eng = self.engine
        # A stop string cuts the text inside a token, so that text comes from the detokenizer.
        text = req.text if isinstance(req.stop_reason, str) else eng.decode(req.output_ids)
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [{tok: lp, **top} for tok, lp, top in
                        zip(req.output_ids, req.output_logprobs, req.output_top_logprobs)]
        completion = CompletionOutput(
            index=0, text=text, token_ids=req.output_ids, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, logprobs=logprobs,
            cumulative_logprob=sum(req.output_logprobs) if req.output_logprobs else None)
        metrics = RequestMetrics(
            arrival_time=req.arrival_time, first_token_time=req.first_token_time,
            finished_time=req.finish_time, num_cached_tokens=req.prefix_hit_tokens,
            num_computed_tokens=req.extended_tokens, num_preemptions=req.num_preemptions)
        prompt_ids = req.tokens[:req.prompt_len]
        prompt_lps = (prompt_logprob_entries(prompt_ids, req.prompt_logprobs, req.prompt_top_logprobs)
                      if req.params.prompt_logprobs is not None else None)
        return RequestOutput(req.rid, prompt, prompt_ids, [completion], req.finished, metrics,
                             prompt_logprobs=prompt_lps)

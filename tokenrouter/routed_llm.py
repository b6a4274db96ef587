"""The offline multi-model API: a routed group of models behind `generate(prompts, SamplingParams)`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tokenrouter.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenTrace, prompt_logprob_entries
from tokenrouter.prompts import PromptType, prepare_requests
from tokenrouter.runtime.entry.entry import Entry, EntryReq
from tokenrouter.runtime.entry.reassembly import Done
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Stats
from tokenrouter.sampling_params import SamplingParams


@dataclass
class RunStats:
    """Counters of one generate call: tokens written by each model, hand-offs, time spent PENDING."""

    tokens_per_model: dict[str, int]
    handoffs: int
    mean_pending_seconds: float
    wall_seconds: float


class RoutedLLM:
    """Starts one subserver process per model of the group and routes every request's tokens between
    them with the group's algorithm. Use as a context manager (or call close()): closing stops every
    subserver and leaves no process behind.

    Each output's `CompletionOutput.token_models` names the model that wrote each token.
    """

    def __init__(self, config: GroupConfig | dict[str, Any] | str | Path) -> None:
        if isinstance(config, (str, Path)):
            config = GroupConfig.from_yaml(config)
        elif isinstance(config, dict):
            config = GroupConfig.from_dict(config)
        self.config = config
        self.entry = Entry(config)
        self.last_run: RunStats | None = None

    def __enter__(self) -> RoutedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.entry.close()

    def get_tokenizer(self) -> Any:
        return self.entry.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool = True,
        timeout: float | None = None,
        routing: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. Raises SubserverDied if a
        subserver fails, TimeoutError past `timeout` seconds (requests are aborted either way).

        `routing`: overrides of the algorithm's per-request parameters (e.g. {"threshold": 0.3} for
        R2R), one dict for every prompt or one per prompt; a bad one raises ValueError naming it.
        Each output's `extra["routing"]` holds the parameters its request ran with. The runtime's own
        fields (routing/request_options.py): {"trace": True} fills `CompletionOutput.trace` (each
        token's writer, the hand-offs before it, the router's score and threshold); {"model": NAME}
        has that model write the whole request."""
        requests = prepare_requests(prompts, prompt_token_ids, sampling_params, self.entry.tokenizer.encode)
        encoded = [(text, ids) for text, ids, _ in requests]
        plist = [sp for _, _, sp in requests]
        if routing is None or isinstance(routing, dict):
            per_prompt = [routing] * len(requests)
        else:
            per_prompt = list(routing)
            if len(per_prompt) != len(requests):
                raise ValueError(f"routing: {len(per_prompt)} entries for {len(requests)} prompts")
        before = self.entry.stats()
        start = time.monotonic()
        reqs: list[EntryReq] = []
        try:
            for i, ((_, ids), sp, overrides) in enumerate(zip(encoded, plist, per_prompt)):
                try:
                    reqs.append(self.entry.add(ids, sp, routing=overrides))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
            with tqdm(total=len(reqs), desc="generate", disable=not use_tqdm, unit="req") as bar:
                while any(not r.done for r in reqs):
                    if timeout is not None and time.monotonic() - start > timeout:
                        raise TimeoutError(f"generate did not finish within {timeout} s")
                    events = self.entry.poll(0.05)
                    bar.update(sum(isinstance(ev, Done) for ev in events))
        except BaseException:
            for r in reqs:
                if not r.done:
                    self.entry.abort(r.rid)
            raise
        wall = time.monotonic() - start
        self.last_run = self._run_stats(before, self.entry.stats(), wall)
        return [self._output(r, text) for r, (text, _) in zip(reqs, encoded)]

    @staticmethod
    def _run_stats(before: dict[str, Stats], after: dict[str, Stats], wall: float) -> RunStats:
        tokens = {m: after[m].tokens_written - before[m].tokens_written for m in after}
        handoffs = sum(after[m].handoffs_sent - before[m].handoffs_sent for m in after)
        periods = sum(after[m].pending_periods - before[m].pending_periods for m in after)
        seconds = sum(after[m].pending_seconds - before[m].pending_seconds for m in after)
        return RunStats(tokens, handoffs, seconds / periods if periods else 0.0, wall)

    def _output(self, req: EntryReq, prompt: str | None) -> RequestOutput:
        out = req.out
        ids = out.output
        text = out.text if out.text is not None else self.entry.tokenizer.decode(ids, skip_special_tokens=True)
        scored = [t for t in out.tokens if t.logprob is not None]
        logprobs = None
        if req.plan.params.logprobs is not None:
            logprobs = [{t.token: t.logprob, **(t.top_logprobs or {})} for t in scored]
        completion = CompletionOutput(
            index=0, text=text, token_ids=ids, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=logprobs, cumulative_logprob=sum(t.logprob for t in scored) if scored else None,
            token_models=[t.model for t in out.tokens],
            trace=[TokenTrace(t.model, list(t.trace.path), t.trace.score, t.trace.threshold, list(t.trace.rejected))
                   for t in out.tokens if t.trace is not None] if req.plan.options.trace else None)
        metrics = RequestMetrics(arrival_time=req.arrival_time, first_token_time=out.first_token_time,
                                 finished_time=req.finish_time, num_cached_tokens=None,
                                 num_computed_tokens=None, num_preemptions=None)
        extra = {"tokens_per_model": out.tokens_per_model(), "handoffs": out.handoffs,
                 "routing": dict(req.plan.routing)}
        if req.error is not None:
            extra["error"] = req.error
        prompt_lps = None
        first = out.tokens[0].prompt_logprobs if out.tokens else None
        if first is not None:
            prompt_lps = prompt_logprob_entries(list(req.plan.prompt_ids), *first)
        return RequestOutput(req.rid, prompt, list(req.plan.prompt_ids), [completion], req.done, metrics, extra,
                             prompt_lps)

"""Per-request logits processing before sampling: the structured-output grammar mask, then
logit_bias, min_tokens, and the repetition, frequency and presence penalties, in vLLM's order and
with its definitions.

Every rule reads only the request's token history (prompt and output so far), never which model
wrote a token, so the models of a routed group apply the same rule to the same history and a
hand-off carries nothing new. The work is vectorised over the rows that use a rule; a batch in
which no request uses one gets its logits back untouched, at the cost of one pass over the params.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from tokenrouter.engine.grammar import apply_grammar_masks
from tokenrouter.engine.req import Req


def _constrained(r: Req) -> bool:
    return r.grammar is not None


def _biased(r: Req) -> bool:
    return bool(r.params.logit_bias)


def _held(r: Req) -> bool:
    return r.num_output < r.params.min_tokens


def _penalized(r: Req) -> bool:
    return r.params.penalized


def processed(r: Req) -> bool:
    """Whether any rule changes this request's logits at its next token."""
    return _constrained(r) or _biased(r) or _held(r) or _penalized(r)


def process_logits(logits: torch.Tensor, reqs: Sequence[Req], eos_token_ids: Iterable[int]) -> torch.Tensor:
    """The logits [S, V] to sample from for the S requests `reqs` (row order). The input is not
    modified (logprobs and routing signals read the model's own logits); when no request uses a rule
    it is returned as is."""
    constrained = [i for i, r in enumerate(reqs) if _constrained(r)]
    biased = [i for i, r in enumerate(reqs) if _biased(r)]
    held = [i for i, r in enumerate(reqs) if _held(r)]
    penalized = [i for i, r in enumerate(reqs) if _penalized(r)]
    if not (constrained or biased or held or penalized):
        return logits
    out = logits.clone()
    if constrained:
        apply_grammar_masks(out, constrained, [reqs[i].grammar for i in constrained],  # type: ignore[misc]
                            [reqs[i].output_ids for i in constrained])
    if biased:
        _add_logit_bias(out, [reqs[i] for i in biased], biased)
    if held:
        _mask_stops(out, [reqs[i] for i in held], held, set(eos_token_ids))
    if penalized:
        rows = torch.tensor(penalized, device=out.device)
        out[rows] = apply_penalties(out[rows], [reqs[i] for i in penalized])
    return out


def _add_logit_bias(logits: torch.Tensor, reqs: list[Req], rows: list[int]) -> None:
    dev = logits.device
    row_of = [row for row, r in zip(rows, reqs) for _ in r.params.logit_bias]
    toks = list(itertools.chain.from_iterable(r.params.logit_bias.keys() for r in reqs))
    bias = list(itertools.chain.from_iterable(r.params.logit_bias.values() for r in reqs))
    logits.index_put_((torch.tensor(row_of, device=dev), torch.tensor(toks, device=dev)),
                      torch.tensor(bias, dtype=logits.dtype, device=dev), accumulate=True)


def _mask_stops(logits: torch.Tensor, reqs: list[Req], rows: list[int], eos: set[int]) -> None:
    """min_tokens: a request below it cannot sample EOS (unless EOS is ignored, or a grammar decides
    when it may end) or a stop token id."""
    vocab = logits.shape[-1]
    row_of: list[int] = []
    toks: list[int] = []
    for row, r in zip(rows, reqs):
        own_eos = r.params.ignore_eos or r.grammar is not None
        stops = set(r.params.stop_token_ids) if own_eos else eos | set(r.params.stop_token_ids)
        stops = [t for t in stops if t < vocab]
        row_of += [row] * len(stops)
        toks += stops
    if toks:
        dev = logits.device
        logits[torch.tensor(row_of, device=dev), torch.tensor(toks, device=dev)] = float("-inf")


def apply_penalties(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """vLLM's penalties on logits [R, V] of the R requests `reqs`: repetition over prompt and output
    tokens, then frequency (per occurrence) and presence (once) over output tokens."""
    dev = logits.device
    n, vocab = logits.shape
    outputs = [r.tokens[r.prompt_len:] for r in reqs]
    counts = torch.zeros(n, vocab, dtype=logits.dtype, device=dev)
    out_rows = torch.repeat_interleave(torch.arange(n), torch.tensor([len(o) for o in outputs]))
    if len(out_rows):
        counts.index_put_((out_rows.to(dev), torch.tensor(list(itertools.chain.from_iterable(outputs)), device=dev)),
                          torch.ones(len(out_rows), dtype=logits.dtype, device=dev), accumulate=True)
    present = counts > 0
    rep = [r.params.repetition_penalty for r in reqs]
    if any(p != 1.0 for p in rep):
        # Prompt tokens count only for rows with a repetition penalty: the others need no prompt scan.
        prompts = [r.tokens[:r.prompt_len] if p != 1.0 else [] for r, p in zip(reqs, rep)]
        seen = present.clone()
        prompt_rows = torch.repeat_interleave(torch.arange(n), torch.tensor([len(p) for p in prompts]))
        seen[prompt_rows.to(dev), torch.tensor(list(itertools.chain.from_iterable(prompts)), dtype=torch.int64,
                                               device=dev)] = True
        factor = torch.where(seen, torch.tensor(rep, dtype=logits.dtype, device=dev)[:, None], 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    freq = torch.tensor([r.params.frequency_penalty for r in reqs], dtype=logits.dtype, device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in reqs], dtype=logits.dtype, device=dev)[:, None]
    return logits - freq * counts - pres * present.to(logits.dtype)

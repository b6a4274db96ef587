"""Outcome labels (R2R's method): a position is critical when the small model's token there changes
the final answer.

The positions are those of the large model's own greedy answers (large_answers.py) where the small
model, reading the same prefix, would write another token. From each such position the large model
continues greedily after the small model's token, up to the answer's output cap, and the final answer
of that text is compared with the large model's own by the task's key (arithmetic: the last number;
CHAMP: the normalised final answer). The continuation from the large model's token needs no run: it
is the large model's answer itself. R2R's paper asks a verifier model whether the two continuations
diverge; here the task's own answer decides, which is what the eval scores.

Continuations run on our engine (`LLM`, greedy, batched; the shared prefix of an answer's positions
comes from the radix cache), so labelling costs the continuations' new tokens, not a prefill each.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch

from tokenrouter.sampling_params import SamplingParams
from tokenrouter.training.large_answers import Exchange, generate


class OutcomeLabeller:
    """Labels (sequence, position, small token) rows of teacher-forced exchanges: sequence i is
    exchanges[i].ids, and the row at position t is the small model's choice for the token at t + 1."""

    def __init__(self, large: str | Path, exchanges: Sequence[Exchange], decode: Callable[[list[int]], str],
                 key: Callable[[str, str], Hashable], max_tokens: Callable[[str], int], eos: set[int],
                 progress: bool = False) -> None:
        self.large, self.exchanges, self.decode, self.key = large, exchanges, decode, key
        self.max_tokens, self.eos, self.progress = max_tokens, eos, progress
        self.stats: dict[str, float] = {}

    def __call__(self, seq_idx: torch.Tensor, pos: torch.Tensor, small_tok: torch.Tensor) -> torch.Tensor:
        """1.0 where the final answer after the small token differs from the large model's, else 0.0.
        Rows must lie in the answers (position >= prompt length - 1)."""
        rows = list(zip(seq_idx.tolist(), pos.tolist(), small_tok.tolist()))
        heads: list[list[int]] = []  # answer tokens up to and including the small model's token
        runs: list[int] = []  # rows whose answer goes on after the small token
        prompts: list[list[int]] = []
        params: list[SamplingParams] = []
        for n, (i, t, tok) in enumerate(rows):
            e = self.exchanges[i]
            j = t + 1 - len(e.prompt)  # index in the answer of the token chosen at this row
            if not 0 <= j < len(e.answer):
                raise ValueError(f"row {n}: position {t} of sequence {i} is not in its answer")
            heads.append(e.answer[:j] + [tok])
            left = self.max_tokens(e.task) - j - 1
            if left > 0 and tok not in self.eos:
                runs.append(n)
                prompts.append(e.ids[:t + 1] + [tok])
                params.append(SamplingParams(temperature=0.0, max_tokens=left))
        tails: dict[int, list[int]] = {}
        if runs:
            outs = generate(self.large, prompts, params, self.progress)
            tails = {n: list(o.outputs[0].token_ids) for n, o in zip(runs, outs)}
        labels = torch.zeros(len(rows))
        answers: dict[int, Hashable] = {}  # the large model's own final answer, per exchange
        for n, (i, _, _) in enumerate(rows):
            e = self.exchanges[i]
            if i not in answers:
                answers[i] = self.key(e.task, self.decode(e.answer))
            labels[n] = float(self.key(e.task, self.decode(heads[n] + tails.get(n, []))) != answers[i])
        self.stats = {"candidates": len(rows), "continued": len(runs),
                      "critical_share": float(labels.mean()) if len(rows) else float("nan"),
                      "continuation_tokens": sum(len(t) for t in tails.values())}
        return labels

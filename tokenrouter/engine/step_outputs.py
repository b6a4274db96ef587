"""The per-row outputs a step computes from the final hidden states, shared by the eager and compiled steps."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenrouter.models.llama import LlamaForCausalLM


class StepOutputSpec(NamedTuple):
    """Which outputs beyond the sampled token a step computes (routing algorithms declare these)."""

    hidden: bool = False  # last hidden state of each sampled row
    logits: bool = False  # full float32 logits
    top_logits: int = 0  # the k largest logits and their token ids
    # False: a screened step may give the k its screen ranks highest, with their exact logits
    # (ScreenedHead.top); for readers of the values as features, not of the k-th id
    top_exact: bool = True
    entropy: bool = False  # entropy (nats) of the temperature-1 distribution


class StepTensors(NamedTuple):
    """For each sampled row: its hidden state, float32 logits, and what the spec asks beyond them. A
    step on the screened head (greedy rows only) has no logits but each row's exact `argmax`."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    top_logits: tuple[torch.Tensor, torch.Tensor] | None
    entropy: torch.Tensor | None
    argmax: torch.Tensor | None = None

    def head(self, n: int) -> StepTensors:
        """The first n rows (a padded compiled step's real rows), as views."""
        return self.rows(slice(0, n))

    def rows(self, index: torch.Tensor | slice) -> StepTensors:
        """The rows at `index` (the sampled rows of a compiled step that ran several rows a request)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        top = None if self.top_logits is None else (self.top_logits[0][index], self.top_logits[1][index])
        return StepTensors(self.hidden[index], pick(self.logits), top, pick(self.entropy), pick(self.argmax))


def step_tensors(model: LlamaForCausalLM, hidden: torch.Tensor, spec: StepOutputSpec,
                 greedy: bool = False) -> StepTensors:
    """The spec's outputs for the sampled rows' final hidden states. `greedy`: every row samples its
    argmax from unprocessed logits, so where the model has a screened head and the spec asks for no
    full logits or entropy, the step takes the screen's exact argmax and top-k instead of the logits."""
    screened = model.lm_head_screened
    if greedy and screened is not None and not (spec.logits or spec.entropy) and screened.takes(hidden):
        top = screened.top(hidden, spec.top_logits, spec.top_exact)
        if top is not None:
            pair = None if top.values is None or top.ids is None else (top.values, top.ids)
            return StepTensors(hidden, None, pair, None, top.argmax)
    logits = model.compute_logits(hidden)
    top = tuple(logits.topk(spec.top_logits, dim=-1)) if spec.top_logits else None
    entropy = None
    if spec.entropy:
        lsm = torch.log_softmax(logits, dim=-1)
        entropy = -(lsm.exp() * lsm).sum(dim=-1)
    return StepTensors(hidden, logits, top, entropy)  # type: ignore[arg-type]

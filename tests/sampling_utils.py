"""A plain per-row reference of vLLM's logits processing, and a check that greedy routed output is the
argmax of each writer's processed logits (transformers' forward of the same weights)."""

from __future__ import annotations

import math

import torch

from tokenrouter.sampling_params import SamplingParams


def reference(row: torch.Tensor, tokens: list[int], prompt_len: int, p: SamplingParams, eos: set[int]) -> torch.Tensor:
    """vLLM's processing of one row, written plainly: bias, min_tokens mask, repetition, frequency, presence."""
    row = row.clone()
    for tok, bias in p.logit_bias.items():
        row[tok] += bias
    if len(tokens) - prompt_len < p.min_tokens:
        for tok in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            row[tok] = -math.inf
    output = tokens[prompt_len:]
    if p.repetition_penalty != 1.0:
        for tok in set(tokens):
            row[tok] = row[tok] / p.repetition_penalty if row[tok] > 0 else row[tok] * p.repetition_penalty
    for tok in set(output):
        row[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return row


def check_processed_greedy(hf: dict[str, torch.nn.Module], prompt: list[int], tokens: list[int], models: list[str],
                           params: SamplingParams, eos: set[int], tie: float = 1e-4) -> list[str]:
    """Assert each output token is the argmax of its writer's logits after the reference processing of
    the history before it (near ties skipped); return the writer of each checked token."""
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = {n: m(input_ids=seq).logits[0] for n, m in hf.items() if n in models}
    checked: list[str] = []
    for j, (tok, writer) in enumerate(zip(tokens, models)):
        row = reference(logits[writer][len(prompt) + j - 1], prompt + tokens[:j], len(prompt), params, eos)
        top2 = row.topk(2).values
        if (top2[0] - top2[1]).item() < tie:
            continue
        assert tok == int(row.argmax()), f"token {j} ({tok}) is not {writer}'s greedy choice after processing"
        checked.append(writer)
    return checked

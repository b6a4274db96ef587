"""Prompt forms the offline APIs accept: text, token ids, or a dict with either."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenrouter.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def normalise_prompts(prompts: PromptType | Sequence[PromptType] | None,
                      prompt_token_ids: list[list[int]] | None) -> list[tuple[str | None, list[int] | None]]:
    """(text or None, token ids or None) per prompt, in order; token-id prompts come first."""
    if prompts is None and prompt_token_ids is None:
        raise ValueError("generate needs prompts or prompt_token_ids")
    items: list[tuple[str | None, list[int] | None]] = []
    if prompt_token_ids is not None:
        items.extend((None, list(ids)) for ids in prompt_token_ids)
    if prompts is None:
        return items
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                            all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]  # type: ignore[list-item]
    for p in prompts:  # type: ignore[union-attr]
        if isinstance(p, str):
            items.append((p, None))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            items.append((p.get("prompt"), list(p["prompt_token_ids"])))
        elif isinstance(p, dict) and isinstance(p.get("prompt"), str):
            items.append((p["prompt"], None))
        elif isinstance(p, list):
            items.append((None, list(p)))
        else:
            raise ValueError(f"unsupported prompt {p!r}: give a string, token ids, or a dict")
    return items


def prepare_requests(prompts: PromptType | Sequence[PromptType] | None, prompt_token_ids: list[list[int]] | None,
                     sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                     encode: Callable[[str], list[int]]) -> list[tuple[str | None, list[int], SamplingParams]]:
    """(text, token ids, params) per prompt, in order: one SamplingParams for all, or one each."""
    items = normalise_prompts(prompts, prompt_token_ids)
    if sampling_params is None:
        sampling_params = SamplingParams()
    params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(items)
    if len(params) != len(items):
        raise ValueError(f"{len(items)} prompts but {len(params)} sampling params")
    return [(text, ids if ids is not None else encode(text or ""), sp) for (text, ids), sp in zip(items, params)]

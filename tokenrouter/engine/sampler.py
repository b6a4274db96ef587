"""Batched sampling: greedy, temperature, top-k, top-p, with per-request seeded randomness.

Randomness is a pure function of (seed, position): the token sampled at position i of a seeded
request does not depend on what else shares its batch, on preemption, or on which model (process)
samples it, so no generator state ever has to travel with a request.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenrouter.models.fused_ops import FusedOps

_MASK64 = (1 << 64) - 1


def _stream_seed(seed: int, position: int) -> int:
    # splitmix64 finaliser over (seed, position): nearby positions get unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


class SamplingBatch(NamedTuple):
    """Per-row sampling settings for the S rows being sampled (host lists, built by the runner)."""

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int]
    positions: list[int]  # absolute position of the token being sampled

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)


class Sampler:
    def __init__(self, device: torch.device, fused: FusedOps | None = None) -> None:
        """`fused`: greedy rows take its argmax (one pass in C; torch.argmax took 0.6 ms a step for
        8 rows of SmolLM2's 49,152 logits)."""
        self.device = device
        self.fused = fused
        self._gen = torch.Generator(device=device)

    def _exponential_noise(self, seeds: list[int], positions: list[int], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(seeds), vocab, device=self.device)
        for row, (seed, pos) in enumerate(zip(seeds, positions)):
            self._gen.manual_seed(_stream_seed(seed, pos))
            noise[row].exponential_(generator=self._gen)
        return noise

    def sample(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Token ids [S] from float32 logits [S, V]."""
        if self.fused is not None and FusedOps.rows_of(logits):
            greedy_ids = self.fused.argmax(logits)
        else:
            greedy_ids = logits.argmax(dim=-1)
        if sb.all_greedy:
            return greedy_ids
        dev = logits.device
        temps = torch.tensor(sb.temperatures, device=dev)
        is_greedy = temps == 0
        scaled = logits / torch.where(is_greedy, torch.ones_like(temps), temps)[:, None]
        if any(k > 0 for k in sb.top_ks) or any(p < 1.0 for p in sb.top_ps):
            scaled = _filter_top_k_top_p(scaled, sb.top_ks, sb.top_ps)
        probs = torch.softmax(scaled, dim=-1)
        rows = [i for i, t in enumerate(sb.temperatures) if t > 0]
        noise = torch.ones_like(probs)
        noise[rows] = self._exponential_noise([sb.seeds[i] for i in rows], [sb.positions[i] for i in rows],
                                              logits.shape[-1])
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_ids, sampled)


def _filter_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    dev = logits.device
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_ks], device=dev)
    remove = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token; the top token always stays
    top_p = torch.tensor(top_ps, device=dev)[:, None]
    remove |= (before >= top_p) & (top_p < 1.0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)

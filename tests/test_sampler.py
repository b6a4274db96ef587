"""Sampler: greedy, seeded randomness as a pure function of (seed, position), top-k / top-p filters,
and SamplingParams validation."""

import math

import pytest
import torch

from tokenrouter.engine.sampler import Sampler, SamplingBatch
from tokenrouter.sampling_params import SamplingParams

CPU = torch.device("cpu")


def batch(n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    return SamplingBatch(
        temperatures=[temperature] * n,
        top_ks=[top_k] * n,
        top_ps=[top_p] * n,
        seeds=list(seeds) if seeds is not None else [0] * n,
        positions=list(positions) if positions is not None else [0] * n,
    )


def logits_like(rows, vocab, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def draws(logits_row, n, seed=123, **kw):
    """n samples of one distribution: the same logits at positions 0..n-1 of one seeded request."""
    sampler = Sampler(CPU)
    logits = logits_row[None, :].expand(n, -1).contiguous()
    return sampler.sample(logits, batch(n, seeds=[seed] * n, positions=range(n), **kw))


def chi_square(counts, probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


# ---- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = logits_like(16, 50)
    out = Sampler(CPU).sample(logits, batch(16, temperature=0.0, seeds=range(16), positions=range(16)))
    assert out.shape == (16,)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = logits_like(8, 50, seed=1)
    sb = SamplingBatch(
        temperatures=[0.0, 1.0, 0.0, 0.7, 0.0, 1.5, 0.0, 1.0],
        top_ks=[0, 5, 3, 0, 0, 10, 1, 0],
        top_ps=[1.0, 0.9, 0.5, 1.0, 0.2, 1.0, 1.0, 0.8],
        seeds=list(range(8)),
        positions=[3] * 8,
    )
    out = Sampler(CPU).sample(logits, sb)
    greedy = logits.argmax(dim=-1)
    for i in (0, 2, 4, 6):
        assert out[i] == greedy[i]


def test_top_k_1_equals_greedy():
    logits = logits_like(64, 100, seed=2)
    out = Sampler(CPU).sample(logits, batch(64, temperature=1.0, top_k=1, seeds=range(64), positions=range(64)))
    assert torch.equal(out, logits.argmax(dim=-1))
    # Also with a hot temperature, where sampling would otherwise often miss the argmax.
    out = Sampler(CPU).sample(logits, batch(64, temperature=5.0, top_k=1, seeds=range(64), positions=range(64)))
    assert torch.equal(out, logits.argmax(dim=-1))


# ---- seeded randomness ------------------------------------------------------------------------

def test_same_seed_and_position_same_token_whatever_the_batch():
    n, vocab = 12, 64
    logits = logits_like(n, vocab, seed=3, scale=0.5)  # flat-ish: sampling is far from greedy
    seeds = [7, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    positions = [0, 1, 0, 5, 5, 9, 2, 4, 100, 3, 3, 7]
    temps = [1.0, 1.0, 0.8, 1.2, 1.0, 1.0, 0.5, 1.0, 1.0, 2.0, 1.0, 1.0]
    top_ks = [0, 10, 0, 0, 20, 0, 0, 5, 0, 0, 0, 30]
    top_ps = [1.0, 1.0, 0.9, 1.0, 1.0, 0.7, 1.0, 1.0, 1.0, 1.0, 0.95, 1.0]
    sampler = Sampler(CPU)

    def sb(idx):
        return SamplingBatch([temps[i] for i in idx], [top_ks[i] for i in idx], [top_ps[i] for i in idx],
                             [seeds[i] for i in idx], [positions[i] for i in idx])

    full = sampler.sample(logits, sb(range(n)))
    # Each row alone.
    for i in range(n):
        assert sampler.sample(logits[i:i + 1], sb([i])).item() == full[i].item()
    # Rows reversed and shuffled.
    for perm in (list(reversed(range(n))), [3, 0, 11, 5, 1, 9, 2, 8, 4, 10, 6, 7]):
        out = sampler.sample(logits[perm], sb(perm))
        assert [full[i].item() for i in perm] == out.tolist()
    # Next to greedy rows (which skip the noise) and different neighbours.
    mixed = SamplingBatch([0.0] + temps[:4], [0] + top_ks[:4], [1.0] + top_ps[:4], [99] + seeds[:4],
                          [0] + positions[:4])
    out = sampler.sample(torch.cat([logits_like(1, vocab, seed=9), logits[:4]]), mixed)
    assert out[1:].tolist() == full[:4].tolist()
    # A fresh sampler (another process, another model) draws the same.
    assert torch.equal(Sampler(CPU).sample(logits, sb(range(n))), full)


def test_different_seeds_give_different_samples():
    vocab = 32
    logits = torch.zeros(vocab)  # uniform: any coupling between seeds would show
    n = 400
    sampler = Sampler(CPU)
    by_seed = sampler.sample(logits[None].expand(n, -1).contiguous(), batch(n, seeds=range(n), positions=[0] * n))
    assert len(set(by_seed.tolist())) >= 28  # 400 uniform draws over 32 values hit nearly all
    by_pos = sampler.sample(logits[None].expand(n, -1).contiguous(), batch(n, seeds=[5] * n, positions=range(n)))
    assert len(set(by_pos.tolist())) >= 28
    # Two seeds' streams over the same positions are not the same sequence.
    other = sampler.sample(logits[None].expand(n, -1).contiguous(), batch(n, seeds=[6] * n, positions=range(n)))
    agree = (by_pos == other).float().mean().item()
    assert agree < 0.15  # independent: about 1/32 would agree
    assert by_seed.tolist() != by_pos.tolist()


def test_top_k_never_samples_outside_the_top_k():
    vocab, k, n = 100, 5, 600
    sampler = Sampler(CPU)
    for row_seed in range(3):
        # flat: tokens outside the top k are likely without the filter
        logits = logits_like(1, vocab, seed=row_seed, scale=0.3)[0]
        top = set(logits.topk(k).indices.tolist())
        out = draws(logits, n, seed=row_seed, top_k=k, temperature=1.5)
        seen = set(out.tolist())
        assert seen <= top
        assert len(seen) == k  # all of the top k do get sampled
        # Control: without the filter the same draws leave the top k.
        assert not set(draws(logits, n, seed=row_seed, temperature=1.5).tolist()) <= top
    # Batched over many seeds, different k per row.
    logits = logits_like(40, vocab, seed=11, scale=0.3)
    ks = [1 + i % 7 for i in range(40)]
    sb = SamplingBatch([1.0] * 40, ks, [1.0] * 40, list(range(40)), [17] * 40)
    for rep in range(10):
        sb = sb._replace(positions=[rep] * 40)
        out = sampler.sample(logits, sb)
        for i in range(40):
            assert out[i].item() in set(logits[i].topk(ks[i]).indices.tolist())


def test_small_top_p_keeps_only_the_top_token():
    logits = logits_like(32, 50, seed=4, scale=1.0)
    out = Sampler(CPU).sample(logits, batch(32, top_p=1e-3, seeds=range(32), positions=range(32)))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 < 0.7, so the second token stays; 0.5 + 0.3 >= 0.7, so the third goes.
    out = draws(logits, 1000, seed=1, top_p=0.7)
    assert set(out.tolist()) == {0, 1}
    # Renormalised over the kept set: 0.5/0.8 and 0.3/0.8.
    frac0 = (out == 0).float().mean().item()
    assert abs(frac0 - 0.625) < 0.06
    # top_p exactly at a boundary: mass above the third token is 0.8 >= 0.8 -> it goes.
    assert set(draws(logits, 500, seed=2, top_p=0.8).tolist()) == {0, 1}
    assert set(draws(logits, 500, seed=3, top_p=0.81).tolist()) == {0, 1, 2}


def test_top_k_and_top_p_together():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k 3 renormalises to 4/9, 3/9, 2/9; top_p 0.5: 4/9 < 0.5 keeps the second, 7/9 drops the third.
    out = draws(probs.log(), 500, seed=4, top_k=3, top_p=0.5)
    assert set(out.tolist()) == {0, 1}


# ---- the distribution -------------------------------------------------------------------------

# Chi-square critical values at p = 0.001 (df = vocab - 1); the draws are deterministic, so this
# is a fixed check, and a wrong temperature or filter lands far above it.
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5])
    n = 2000
    out = draws(logits, n, seed=2024, temperature=temperature)
    counts = torch.bincount(out, minlength=5).tolist()
    probs = torch.softmax(logits / temperature, dim=-1).tolist()
    stat = chi_square(counts, probs, n)
    assert stat < CHI2_999[4], (counts, [round(n * p) for p in probs], stat)
    # And the test can tell temperatures apart: the same counts do not fit the other temperatures.
    for other in (1.0, 0.5, 2.0):
        if other != temperature:
            wrong = torch.softmax(logits / other, dim=-1).tolist()
            assert chi_square(counts, wrong, n) > CHI2_999[4]


def test_empirical_distribution_across_seeds():
    logits = torch.tensor([0.3, -1.0, 1.2, 0.0])
    n = 2000
    sampler = Sampler(CPU)
    out = sampler.sample(logits[None].expand(n, -1).contiguous(), batch(n, seeds=range(n), positions=[42] * n))
    counts = torch.bincount(out, minlength=4).tolist()
    probs = torch.softmax(logits, dim=-1).tolist()
    assert chi_square(counts, probs, n) < CHI2_999[3]


def test_empirical_distribution_with_top_k_renormalises():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 2000
    out = draws(logits, n, seed=77, top_k=3)
    counts = torch.bincount(out, minlength=5).tolist()
    assert counts[3] == counts[4] == 0
    probs = torch.softmax(logits[:3], dim=-1).tolist()
    assert chi_square(counts[:3], probs, n) < CHI2_999[2]


# ---- SamplingParams ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_valid_values_and_normalisation():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, seed=0, stop="x")
    assert p.greedy
    assert p.top_k == 0  # -1 means disabled, same as 0
    assert p.stop == ["x"]
    assert not SamplingParams(temperature=0.5).greedy
    SamplingParams(top_p=1e-6, top_k=1, logprobs=0, stop_token_ids=[0, 5])


def test_validate_catches_later_mutation():
    p = SamplingParams()
    p.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        p.validate()

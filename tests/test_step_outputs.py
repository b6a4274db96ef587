"""The declared-outputs seam : an algorithm declares which step outputs it needs
(StepOutputSpec) and the runner computes only those; the rest stay None."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts_of

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.sampling_params import SamplingParams

FIELDS = ("hidden", "logits", "top_logits", "entropy")


def first_step(path, spec: StepOutputSpec, logprobs: int | None = None) -> tuple[Engine, StepOutput]:
    eng = Engine(EngineConfig(model_path=str(path), kv_cache_tokens=512, page_size=4, device="cpu"), outputs=spec)
    for prompt in prompts_of([5, 9, 3], seed=31):
        eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=logprobs))
    out = eng.step().step
    assert out is not None and len(out.reqs) == 3  # all three prompts prefilled and sampled in one step
    return eng, out


def set_fields(out: StepOutput) -> set[str]:
    return {f for f in FIELDS if getattr(out, f) is not None}


@pytest.mark.parametrize("spec,expected", [
    (StepOutputSpec(), set()),
    (StepOutputSpec(entropy=True), {"entropy"}),
    (StepOutputSpec(hidden=True), {"hidden"}),
    (StepOutputSpec(logits=True), {"logits"}),
    (StepOutputSpec(top_logits=5), {"top_logits"}),
    (StepOutputSpec(hidden=True, logits=True, top_logits=5, entropy=True), set(FIELDS)),
])
def test_only_declared_outputs_are_set(model_paths, spec, expected):
    eng, out = first_step(model_paths["llama"], spec)
    assert set_fields(out) == expected
    assert out.logprobs is None and out.top_logprobs is None  # no request asked for logprobs
    eng.abort_all()
    eng.check_integrity()


def test_declared_outputs_have_the_right_shapes_and_values(model_paths):
    eng, out = first_step(model_paths["llama"], StepOutputSpec(hidden=True, logits=True, top_logits=5, entropy=True))
    n, mc = len(out.reqs), eng.model_config
    assert out.hidden.shape == (n, mc.hidden_size)
    assert out.logits.shape == (n, mc.vocab_size) and out.logits.dtype == torch.float32
    vals, ids = out.top_logits
    assert vals.shape == ids.shape == (n, 5)
    ref_vals, ref_ids = out.logits.topk(5, dim=-1)
    assert torch.equal(vals, ref_vals) and torch.equal(ids, ref_ids)
    lsm = torch.log_softmax(out.logits, dim=-1)
    assert torch.allclose(out.entropy, -(lsm.exp() * lsm).sum(-1), atol=1e-5)
    assert out.token_ids == out.logits.argmax(-1).tolist()  # greedy: the sampled token is the top logit
    assert torch.allclose(eng.model.compute_logits(out.hidden), out.logits, atol=1e-5)
    eng.abort_all()


def test_nothing_extra_is_computed_by_default(model_paths, monkeypatch):
    """Default spec, no logprobs: the step takes no log-softmax and no top-k (entropy, logprobs and
    top logits are the only users)."""
    calls = {"log_softmax": 0, "topk": 0}
    real_lsm, real_topk = torch.log_softmax, torch.Tensor.topk

    def lsm(*a, **k):
        calls["log_softmax"] += 1
        return real_lsm(*a, **k)

    def topk(self, *a, **k):
        calls["topk"] += 1
        return real_topk(self, *a, **k)

    monkeypatch.setattr(torch, "log_softmax", lsm)
    monkeypatch.setattr(torch.Tensor, "topk", topk)
    eng, out = first_step(model_paths["llama"], StepOutputSpec())
    assert calls == {"log_softmax": 0, "topk": 0}
    eng.abort_all()
    # Asked for, each is computed: the counters move.
    _, out = first_step(model_paths["llama"], StepOutputSpec(entropy=True, top_logits=3))
    assert calls["log_softmax"] >= 1 and calls["topk"] >= 1
    _, out = first_step(model_paths["llama"], StepOutputSpec(), logprobs=2)
    assert out.logprobs is not None and set_fields(out) == set()

"""Below the HTTP edge: a request the wire or a model cannot carry fails
alone in a routed group; the subservers and the entry keep serving, and no page leaks."""

from __future__ import annotations

import time

import pytest
from engine_utils import prompts_of
from routing_utils import build_pair, group_dict

from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with RoutedLLM(group_dict(build_pair(tmp_path_factory.mktemp("contain")), 0.5)) as llm:
        yield llm


def pages_held(llm: RoutedLLM) -> dict[str, tuple[int, int]]:
    return {n: (s.live_requests, s.total_pages - s.free_pages - s.cached_pages) for n, s in llm.entry.stats().items()}


@pytest.mark.parametrize("field,value", [("seed", 2**64), ("top_k", 2**64), ("stop_token_ids", [2**64])])
def test_unencodable_request_is_a_value_error(llm, field, value):
    params = SamplingParams(max_tokens=4, **{field: value})
    with pytest.raises(ValueError, match="cannot be sent to the models"):
        llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=params, use_tqdm=False, timeout=60)
    (out,) = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                          use_tqdm=False, timeout=60)
    assert len(out.outputs[0].token_ids) == 4


def test_request_a_model_fails_on_fails_alone(llm):
    good = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(max_tokens=12, temperature=1.0, top_k=2**63, ignore_eos=True)  # int64 overflow in the step
    prompts = prompts_of([6, 7, 8], seed=4)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[good, bad, good], use_tqdm=False, timeout=120)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "failed on this request" in outs[1].extra["error"] and "Traceback" not in outs[1].extra["error"]
    for o in (outs[0], outs[2]):
        assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12
    assert all(p.is_alive() for p in llm.entry.procs.values())
    deadline = time.monotonic() + 10  # a peer's finish notice may still be on its way
    while pages_held(llm) != {"small": (0, 0), "large": (0, 0)}:
        assert time.monotonic() < deadline, f"(live requests, pages in use) left: {pages_held(llm)}"
        time.sleep(0.1)

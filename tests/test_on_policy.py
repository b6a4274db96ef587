"""On-policy calibration: the threshold search, the prompt file, and `tokenrouter calibrate`
on the tiny random pair with an untrained R2R router, whose scores spread enough that the share of
large-model tokens moves with the threshold."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from routing_utils import untrained_routers

from tokenrouter import cli
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.training.on_policy import OnPolicyCalibration, Probe, SearchSettings, knob, large_share, search
from tokenrouter.training.prompt_file import read_prompts


def _logit(v: float) -> float:
    return math.log(v / (1 - v))


def _measure(share_of_logit):
    """A fake group: the share as a function of the threshold's logit, each call recorded."""
    def measure(value: float) -> Probe:
        return Probe(value, share_of_logit(_logit(value)), 100, 0.0)
    return measure


def _honest(probes: list[Probe], best: Probe, target: float) -> None:
    assert best in probes and abs(best.share - target) == min(abs(p.share - target) for p in probes)


# ---- the search --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rises", [True, False])
def test_search_brackets_then_bisects_to_the_target(rises):
    # A smooth share, falling with the threshold (R2R, Co-LLM) or rising with it (CITER's tau).
    def share(x: float) -> float:
        return 1 / (1 + math.exp(-(x - 3.0) if rises else (x + 3.0)))

    s = SearchSettings(target_share=0.2, tolerance=0.01, max_iterations=20)
    logs: list[str] = []
    best, probes = search(_measure(share), 0.5, rises, s, logs.append)
    assert abs(best.share - 0.2) <= 0.01 and len(probes) < 20
    _honest(probes, best, 0.2)
    assert len(logs) == len(probes) and all("large share" in m for m in logs)
    # it stops at the first probe within tolerance
    assert abs(probes[-1].share - 0.2) <= 0.01 and all(abs(p.share - 0.2) > 0.01 for p in probes[:-1])


def test_search_reports_a_jump_it_cannot_cross():
    # Bimodal, as free generation makes it: nothing between 0% and 90%.
    logs: list[str] = []
    s = SearchSettings(target_share=0.2, tolerance=0.02, max_iterations=12)
    best, probes = search(_measure(lambda x: 0.9 if x < 1.3 else 0.0), 0.5, False, s, logs.append)
    assert len(probes) == 12 and best.share in (0.0, 0.9)
    _honest(probes, best, 0.2)
    assert "jumps from 0.000" in logs[-1] and "to 0.900" in logs[-1]
    # the bracket closed around the jump (logit 1.3) from both sides
    below = max(_logit(p.value) for p in probes if p.share == 0.9)
    above = min(_logit(p.value) for p in probes if p.share == 0.0)
    assert below < 1.3 <= above and above - below < 0.05


def test_search_stops_at_the_end_of_the_range_when_the_target_is_out_of_reach():
    s = SearchSettings(target_share=0.8, tolerance=0.02, max_iterations=30)
    best, probes = search(_measure(lambda x: 0.5 / (1 + math.exp(x))), 0.5, False, s)
    assert best.share < 0.5 and len(probes) < 30 and _logit(probes[-1].value) == pytest.approx(-16.0, abs=1e-3)


def test_search_keeps_an_honest_bracket_on_a_noisy_share():
    # Monotone only in expectation: a deterministic wiggle of +-0.06 on a rising share.
    def share(x: float) -> float:
        return min(1.0, max(0.0, 1 / (1 + math.exp(-x)) + 0.06 * math.sin(37 * x)))

    s = SearchSettings(target_share=0.3, tolerance=0.01, max_iterations=15)
    best, probes = search(_measure(share), 0.9, True, s)
    _honest(probes, best, 0.3)
    assert abs(best.share - 0.3) <= 0.05


def test_settings_and_knobs_are_checked():
    with pytest.raises(ValueError, match="target_share"):
        SearchSettings(target_share=1.5)
    with pytest.raises(ValueError, match="max_iterations"):
        SearchSettings(target_share=0.2, max_iterations=0)
    assert knob("r2r") == ("threshold", False) and knob("citer") == ("tau", True)
    assert knob("co_llm") == ("eta", False) and knob("bernoulli") == ("p", True) and knob("r_stitch") == ("tau", False)
    with pytest.raises(ValueError, match="no threshold to calibrate"):
        knob("ensemble")
    assert large_share([["small", "large"], ["large", "other", "small", "small"]], "small") == (0.5, 6)
    assert large_share([[]], "small") == (0.0, 0)


# ---- the prompt file ------------------------------------------------------------------------------
def test_prompt_file_reads_text_chat_and_plain_lines(tmp_path, pair_paths):
    tok = load_tokenizer(pair_paths["small"])
    f = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "hi there"}]
    f.write_text(json.dumps({"prompt": "The sea"}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    text_ids, chat_ids = read_prompts(f, tok)
    assert text_ids == tok.encode("The sea")
    rendered = tok.decode(chat_ids)
    assert "hi there" in rendered and rendered != "hi there"  # the template wrapped it
    assert read_prompts(f, tok, limit=1) == [text_ids]
    plain = tmp_path / "p.txt"
    plain.write_text("one\n\ntwo\n")
    assert read_prompts(plain, tok) == [tok.encode("one"), tok.encode("two")]
    for bad, msg in (("{not json", "p.jsonl:1: not JSON"), ('{"text": "x"}', "exactly one of"),
                     ('{"messages": []}', "non-empty list"), ('{"prompt": 3}', "non-empty string")):
        f.write_text(bad + "\n")
        with pytest.raises(ValueError, match=msg):
            read_prompts(f, tok)
    f.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(f, tok)


# ---- `tokenrouter calibrate` on the tiny pair ------------------------------------------------------
def test_calibrate_writes_a_threshold_that_serves_the_target_share(tmp_path, pair_paths, capsys):
    routers = untrained_routers(pair_paths, tmp_path / "routers")
    cfg = tmp_path / "group.yaml"
    cfg.write_text(
        "# my group\n"
        "models:\n"
        f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 2048, page_size: 4}}\n"
        f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 2048, page_size: 4}}\n"
        f"algorithm: {{name: r2r, router: {routers['r2r']}}}\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i} {'ab' * i}"}) + "\n" for i in range(8)))
    target, tol = 0.3, 0.06
    args = ["calibrate", "--config", str(cfg), "--prompts", str(prompts), "--target-share", str(target),
            "--tolerance", str(tol), "--max-tokens", "16", "--max-iterations", "8", "--quiet"]

    assert cli.main(args + ["--write"]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert "calibrate: probe 1/8: threshold 0.5" in out.err  # the router's own threshold first
    assert f"within {tol:g} of the target {target:g}" in out.out and f"written: {cfg}" in out.out
    text = cfg.read_text()
    assert text.startswith("# my group\n# calibrated on-policy: threshold ")
    algo = yaml.safe_load(text)["algorithm"]
    assert algo["name"] == "r2r" and algo["router"] == str(routers["r2r"]) and 0 < algo["threshold"] < 1

    # Serving the written group on the same prompts gives the share the search measured.
    tok = load_tokenizer(pair_paths["small"])
    ids = read_prompts(prompts, tok)
    with RoutedLLM(cfg) as llm:
        outs = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0.0, max_tokens=16),
                            use_tqdm=False)
    share, tokens = large_share([o.outputs[0].token_models for o in outs], "small")
    assert tokens > 0 and abs(share - target) <= tol

    # Without --config: a clear error.
    assert cli.main(["calibrate", "--prompts", str(prompts), "--target-share", "0.2"]) == 2
    assert "calibrate needs --config" in capsys.readouterr().err


def test_calibrate_that_misses_writes_nothing(tmp_path, pair_paths, monkeypatch, capsys):
    """A search that ends outside the tolerance (a jump in the share, say): exit 1, the config is left
    as it was. (The search itself is the fake's; the tests above run real ones.)"""
    cfg = tmp_path / "group.yaml"
    cfg.write_text(f"models:\n  - {{name: small, path: {pair_paths['small']}}}\n"
                   f"  - {{name: large, path: {pair_paths['large']}}}\nalgorithm: {{name: bernoulli, p: 0.5}}\n")
    before = cfg.read_text()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    seen = {}

    def fake(group, ids, s, start=None, log=None, progress=False):
        seen.update(algorithm=group.algorithm, prompts=ids, target=s.target_share)
        return OnPolicyCalibration("bernoulli", "p", s.target_share, s.tolerance, 0.9, 0.6, False,
                                   [Probe(0.9, 0.6, 10, 0.0)])

    monkeypatch.setattr("tokenrouter.training.on_policy.calibrate_group", fake)
    rc = cli.main(["calibrate", "--config", str(cfg), "--prompts", str(prompts), "--target-share", "0.2", "--write"])
    assert rc == 1 and seen["algorithm"] == "bernoulli" and seen["target"] == 0.2 and len(seen["prompts"]) == 1
    assert "missed the target share" in capsys.readouterr().err and cfg.read_text() == before

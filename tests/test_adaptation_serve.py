"""Load adaptation wired through: `tokenrouter serve`'s flags refused at start naming the flag, the
value a request started with in its response and in its per-token trace, and the gauges and model
card of a live server. The controller itself is tests/test_adaptation.py."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess, pair_group_yaml

from tokenrouter import cli
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.entry.adaptation import AdaptState
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.metrics import ServerMetrics


def fake_pair_yaml(folder: Path, p: float = 0.2) -> Path:
    """A group whose model folders do not exist: every case below must be refused before a model loads."""
    cfg = folder / "group.yaml"
    cfg.write_text(f"models:\n  - {{name: small, path: {folder / 'nope-s'}}}\n"
                   f"  - {{name: large, path: {folder / 'nope-l'}}}\nalgorithm: {{name: bernoulli, p: {p}}}\n")
    return cfg


@pytest.mark.parametrize("flags,named,why", [
    (["--target-tpot-ms", "-5"], "--target-tpot-ms", "must be a positive number"),
    (["--target-tpot-ms", "0"], "--target-tpot-ms", "must be a positive number"),
    (["--target-tpot-ms", "nan"], "--target-tpot-ms", "must be a positive number"),
    (["--target-tpot-ms", "50", "--adapt-floor", "-0.1"], "--adapt-floor", "in [0, 1]"),
    (["--target-tpot-ms", "50", "--adapt-floor", "0.5"], "--adapt-floor", "above the served point"),
    (["--target-tpot-ms", "50", "--adapt-window", "-1"], "--adapt-window", "must be a positive number"),
    (["--adapt-floor", "0.1"], "--target-tpot-ms", "is needed: --adapt-floor"),
])
def test_bad_flag_values_are_refused_at_start_naming_the_flag(tmp_path, capsys, flags, named, why):
    assert cli.main(["serve", "--config", str(fake_pair_yaml(tmp_path)), *flags]) == 2
    err = capsys.readouterr().err
    assert f"tokenrouter: error: {named} " in err and why in err


@pytest.mark.parametrize("flag", ["--target-tpot-ms", "--adapt-floor", "--adapt-window"])
def test_a_flag_that_is_not_a_number_is_refused_naming_it(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--config", str(fake_pair_yaml(tmp_path)), flag, "fast"])
    assert e.value.code == 2 and f"argument {flag}: invalid float value: 'fast'" in capsys.readouterr().err


def test_a_group_without_a_share_knob_is_refused(tmp_path, capsys):
    assert cli.main(["serve", "--model-path", str(tmp_path / "nope"), "--target-tpot-ms", "50"]) == 2
    assert "--target-tpot-ms needs an algorithm with a share knob" in capsys.readouterr().err


def test_the_value_a_request_started_with_is_in_its_routing_and_every_traced_token(pair_paths):
    group = {"models": [{"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 2048, "page_size": 4},
                        {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 2048, "page_size": 4}],
             "algorithm": {"name": "bernoulli", "p": 0.5},
             # a window of an hour: the entry's own clock never closes one while the test runs
             "adapt": {"target_tpot_ms": 1.0, "floor": 0.2, "window": 3600}}
    sp = SamplingParams(max_tokens=12, temperature=0.0, seed=5, ignore_eos=True)
    with RoutedLLM(group) as llm:
        ad = llm.entry.adaptation
        assert ad is not None
        plan = ad.start("synthetic", llm.entry.rules.plan([1, 2, 3], sp))
        assert plan.routing == {"p": 0.5}
        while ad.state.value != 0.2:  # overload on a synthetic clock: a token a second against a 1 ms target
            start = ad.closes_at - 10.0
            for k in range(10):
                ad.token("synthetic", "small", start + k)
            ad.poll(ad.closes_at)
        ad.finish("synthetic")
        adapted, pinned = llm.generate(["one two three", "one two three"], sp,
                                       routing=[{"trace": True}, {"trace": True, "adapt": False}], use_tqdm=False)
        assert adapted.extra["routing"] == {"p": 0.2} and pinned.extra["routing"] == {"p": 0.5}
        for out, p in ((adapted, 0.2), (pinned, 0.5)):
            trace = out.outputs[0].trace
            assert trace is not None and len(trace) == 12
            assert [t.threshold for t in trace] == [p] * 12  # each token's draw was against p


def test_the_gauges_say_the_knob_its_bounds_the_target_and_the_measured_p99():
    metrics = ServerMetrics("pair")
    state = AdaptState("bernoulli", "p", 0.25, 0.4, 0.2, 0.05, 10.0, 0.08, {"small": 0.7, "large": 0.3})
    families = {f.name: f for f in text_string_to_metric_families(metrics.render({}, 0, 0, state).decode())}
    knob = {"model_name": "pair", "algorithm": "bernoulli", "param": "p"}
    assert [(s.labels, s.value) for s in families["tokenrouter_adaptive_knob"].samples] == [(knob, 0.25)]
    assert families["tokenrouter_adaptive_knob_served"].samples[0].value == 0.4
    assert families["tokenrouter_adaptive_knob_floor"].samples[0].value == 0.2
    assert families["tokenrouter_adaptive_target_tpot_seconds"].samples[0].value == 0.05
    assert families["tokenrouter_adaptive_tpot_p99_seconds"].samples[0].value == 0.08
    assert {s.labels["model_name"]: s.value for s in families["tokenrouter_adaptive_token_share"].samples} == \
        {"small": 0.7, "large": 0.3}
    quiet = ServerMetrics("pair").render({}, 0, 0, None).decode()
    assert "tokenrouter_adaptive" not in quiet  # a server that does not adapt has none of them


@pytest.fixture(scope="module")
def adaptive_server(tmp_path_factory, pair_paths):
    cfg = pair_group_yaml(tmp_path_factory.mktemp("adaptive"), pair_paths, p=0.5)
    # A target no step can meet and one-second windows: any streaming walks the knob down.
    srv = ServerProcess(["--config", str(cfg), "--target-tpot-ms", "0.001", "--adapt-floor", "0.1",
                         "--adapt-window", "1", "--grace-period", "5"])
    yield srv
    srv.stop()


def adaptive_card(url: str) -> dict:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["routing"]["adaptive"]


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_live_server_moves_the_knob_shows_it_and_gives_it_back(adaptive_server):
    url = adaptive_server.url
    card = adaptive_card(url)
    assert card["param"] == "p" and card["served"] == 0.5 and card["floor"] == 0.1 and card["target_s"] == 1e-6

    def complete(routing: dict) -> dict:
        body = {"model": "pair", "prompt": "hello there", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "routing": routing}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["routing"]["params"]

    def knob_gauge() -> float:
        metrics = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}
        assert metrics["tokenrouter_adaptive_target_tpot_seconds"].samples[0].value == 1e-6
        (sample,) = metrics["tokenrouter_adaptive_knob"].samples
        assert sample.labels == {"model_name": "pair", "algorithm": "bernoulli", "param": "p"}
        return sample.value

    def streamed_until_moved() -> bool:
        assert 0.1 <= complete({})["p"] <= 0.5
        return adaptive_card(url)["value"] < 0.5 and 0.1 <= knob_gauge() < 0.5  # both read the live state

    wait_for(streamed_until_moved, "the knob to move under load")
    assert complete({"adapt": False}) == {"p": 0.5}
    assert complete({"p": 0.7}) == {"p": 0.7}
    wait_for(lambda: adaptive_card(url)["value"] == 0.5, "the served point back once idle")
    assert adaptive_card(url)["p99_s"] is None

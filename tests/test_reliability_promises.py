"""docs/RELIABILITY.md's promises about one served group, each asserted where it happens: at the
subservers (their abort counters, written tokens, live requests and KV pages, read from /metrics), on
the event loop (/health and another stream answering while huge prompts are tokenised), in a real
failure's answer, and in the model processes when the server process is killed.

One server for the module: the tiny random pair behind a user's routing algorithm (tests/routing_utils.py's
Picky: Bernoulli routing that raises where a request's own `fail_in` says), with the latency-model
executor, so that every step takes 10 ms on any machine and a long request runs for seconds."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from routing_utils import write_picky
from server_utils import ServerProcess, alive, children

MODEL = "pair"
TIME_LIMIT = 3.0
MAX_PROMPT_CHARS = 3_000_000  # a prompt this long takes seconds to tokenise (about 1 s per million characters)


@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    folder = tmp_path_factory.mktemp("promises")
    cfg = folder / "group.yaml"
    cfg.write_text(
        f"name: {MODEL}\nmodels:\n"
        f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 4096, page_size: 4}}\n"
        f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 4096, page_size: 4}}\n"
        f"algorithm: {{name: '{write_picky(folder)}', p: 0.3}}\n"
        "executor: {mode: latency, profile: {models: {small: {base: 0.01}, large: {base: 0.01}}}}\n")
    srv = ServerProcess(["--config", str(cfg), "--request-timeout", str(TIME_LIMIT),
                         "--max-prompt-chars", str(MAX_PROMPT_CHARS)])
    yield srv
    srv.stop()


def metrics(server) -> dict[str, dict[tuple, float]]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def per_model(m: dict, name: str) -> dict[str, float]:
    return {dict(labels)["model"]: v for labels, v in m.get(name, {}).items()}


def wait_idle(server, timeout: float = 20.0) -> dict:
    """Metrics once every model holds no request and no KV page (pages only the prefix cache holds are free)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        live = per_model(m, "tokenrouter_model_live_requests")
        total, free = per_model(m, "tokenrouter_kv_pages_total"), per_model(m, "tokenrouter_kv_pages_free")
        cached = per_model(m, "tokenrouter_kv_pages_cached")
        held = {k: (live[k], total[k] - free[k] - cached[k]) for k in live}
        if set(held) == {"small", "large"} and all(v == (0, 0) for v in held.values()):
            return m
        assert time.monotonic() < deadline, f"(live requests, KV pages held) per model: {held}"
        time.sleep(0.2)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


def delta(after: dict, before: dict, name: str) -> dict[str, float]:
    a, b = per_model(after, name), per_model(before, name)
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in ("small", "large")}


def test_a_client_disconnect_is_aborted_at_every_model(server):
    before = wait_idle(server)
    max_tokens = 400  # 4 s or more at 10 ms a step
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json=completion(max_tokens=max_tokens, ignore_eos=True, stream=True)) as s:
        got = 0
        for line in s.iter_lines():
            got += line.startswith("data:")
            if got >= 3:
                break
    after = wait_idle(server)
    aborted = delta(after, before, "tokenrouter_model_aborted_requests_total")
    assert aborted["small"] == 1, aborted  # the entry model holds the request until it ends
    written = sum(delta(after, before, "tokenrouter_model_written_tokens_total").values())
    assert 3 <= written < max_tokens, written


def test_health_and_another_stream_answer_while_huge_prompts_are_tokenised(server):
    heavy_body = json.dumps(completion(prompt="hello world " * (MAX_PROMPT_CHARS // 12)))
    results: list[int] = []

    def heavy() -> None:
        r = httpx.post(f"{server.url}/v1/completions", content=heavy_body, timeout=120,
                       headers={"content-type": "application/json"})
        results.append(r.status_code)

    threads = [threading.Thread(target=heavy) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the bodies are sent and parsed; tokenising them takes seconds
    health_waits, stream_waits = [], []
    answered_before_the_stream = None  # huge prompts answered by the time the short stream ended
    try:
        while any(t.is_alive() for t in threads) and len(health_waits) < 50:
            t0 = time.monotonic()
            r = httpx.get(f"{server.url}/health", timeout=30)
            in_flight = any(t.is_alive() for t in threads)
            assert r.status_code == 200
            if in_flight:
                health_waits.append(time.monotonic() - t0)
            if not stream_waits:
                t0 = time.monotonic()
                with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                                  json=completion(max_tokens=8, ignore_eos=True, stream=True)) as s:
                    lines = [line for line in s.iter_lines() if line.startswith("data:")]
                last = json.loads(lines[-2][5:])
                assert lines[-1] == "data: [DONE]" and last.get("choices", [{}])[0].get("finish_reason") == "length", \
                    last
                if any(t.is_alive() for t in threads):
                    stream_waits.append(time.monotonic() - t0)
                    answered_before_the_stream = len(results)
            time.sleep(0.1)
    finally:
        for t in threads:
            t.join(120)
    print(f"/health while tokenising: {len(health_waits)} probes, max {max(health_waits, default=0):.2f} s; "
          f"an 8-token stream: {stream_waits} s")
    assert results == [400] * 3  # longer than the context, found after tokenising
    assert health_waits, "the huge prompts were tokenised before the first probe: nothing observed"
    # Liveness bounds (a tokenisation on the event loop blocks it for seconds), not speed figures.
    assert max(health_waits) < 2.0, health_waits
    assert stream_waits, "the 8-token stream ended after the huge prompts: not observed while they were in flight"
    assert max(stream_waits) < 10.0, stream_waits
    # Not queued behind them: a short prompt is parsed and tokenised at once, so the stream ends while
    # all three huge prompts are still being tokenised (each takes seconds; the pool has two threads).
    assert answered_before_the_stream == 0, answered_before_the_stream


def test_a_time_limit_frees_pages_and_peer_copies(server):
    before = wait_idle(server)
    max_tokens = 480  # more than the time limit allows at 10 ms a step
    r = httpx.post(f"{server.url}/v1/completions", json=completion(max_tokens=max_tokens, ignore_eos=True), timeout=30)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
    after = wait_idle(server)
    aborted = delta(after, before, "tokenrouter_model_aborted_requests_total")
    assert aborted == {"small": 1, "large": 1}, aborted  # the request and the large model's copy of it
    written = delta(after, before, "tokenrouter_model_written_tokens_total")
    assert written["large"] > 0 and sum(written.values()) < max_tokens, written


def test_a_failing_algorithm_answers_json_with_no_traceback(server):
    """A real failure (the user's algorithm raises in route on this request; no mock): an OpenAI-shaped
    500 naming the algorithm, no traceback or file name, counted at the model; others are served."""
    before = metrics(server)
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json=completion(routing={"fail_in": "route"}, max_tokens=6))
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "internal_error"
    assert "routing algorithm 'picky' failed on this request (in route" in err["message"], err
    assert "Traceback" not in r.text and ".py" not in r.text and "picky cannot" not in r.text
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json=completion(routing={"fail_in": "send"}, max_tokens=40, ignore_eos=True, stream=True)) as s:
        text = "".join(s.iter_text())
    assert "routing algorithm 'picky' failed on this request (in send" in text and "data: [DONE]" in text
    assert "Traceback" not in text and ".py" not in text
    ok = httpx.post(f"{server.url}/v1/completions", json=completion(max_tokens=5, ignore_eos=True), timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    after = wait_idle(server)
    errors = {dict(k)["stage"]: v - before.get("tokenrouter_model_request_errors_total", {}).get(k, 0.0)
              for k, v in after["tokenrouter_model_request_errors_total"].items() if dict(k)["model"] == "small"}
    assert errors.get("route") == 1 and errors.get("send") == 1, errors


def test_the_model_processes_exit_when_the_entry_process_is_killed(server):
    """Last in the module: it kills the shared server."""
    models = children(server.proc.pid)
    assert len(models) >= 2
    os.kill(server.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        while any(alive(p) for p in models):
            assert time.monotonic() - killed < 10.0, f"still running 10 s after the entry died: " \
                                                      f"{[p for p in models if alive(p)]}"
            time.sleep(0.1)
        print(f"every model process gone {time.monotonic() - killed:.2f} s after the entry was killed")
    finally:
        for p in models:
            if alive(p):
                os.kill(p, signal.SIGKILL)

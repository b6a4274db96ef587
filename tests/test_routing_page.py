"""The routing page (`tokenrouter serve` at /) in a real browser, and the trace fields of the HTTP API.

One `tokenrouter serve` for the module, on loopback, with an API key: a tiny random pair (context
2048, one extra token whose text is markup) routed by the seeded Bernoulli router, so the same request
routes the same way every time. The browser is the system's chromium (Debian: apt-get install
chromium; scripts/env.sh installs it) driven by Playwright, never a downloaded one. Without chromium
or Playwright the browser tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from urllib.parse import urlparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess

from tokenrouter.models.random_model import build_random_model

KEY = "page-key"
MODEL = "pair"
# One token of the pair's vocabulary spells this: were token text ever parsed as HTML, the script or
# the image's handler would run.
MARKUP = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("page-pair")
    paths = {"small": build_random_model(root / "small", "llama", "tiny", seed=11, max_position_embeddings=2048),
             "large": build_random_model(root / "large", "llama", "tiny", seed=12, hidden_size=128,
                                         num_hidden_layers=3, intermediate_size=256, max_position_embeddings=2048)}
    for path in paths.values():
        tok = AutoTokenizer.from_pretrained(path)
        tok.add_tokens([MARKUP])
        tok.save_pretrained(path)
    return paths


def serve_pair(pair, folder, algorithm: str) -> ServerProcess:
    cfg = folder / "group.yaml"
    cfg.write_text(
        f"name: {MODEL}\nmodels:\n"
        f"  - {{name: small, path: {pair['small']}, kv_cache_tokens: 8192, page_size: 4}}\n"
        f"  - {{name: large, path: {pair['large']}, kv_cache_tokens: 8192, page_size: 4}}\n"
        f"algorithm: {algorithm}\n")
    return ServerProcess(["--config", str(cfg), "--api-key", KEY, "--grace-period", "5"])


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    srv = serve_pair(pair, tmp_path_factory.mktemp("page-srv"), "{name: bernoulli, p: 0.3}")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def speculative_server(pair, tmp_path_factory):
    """The same pair under speculative decoding: the small model drafts runs of 3, the large one
    keeps what it agrees with (random weights: it rejects often)."""
    srv = serve_pair(pair, tmp_path_factory.mktemp("page-spec"), "{name: speculative, draft_tokens: 3}")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def markup_token(pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair["small"]).convert_tokens_to_ids(MARKUP)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def total(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "|"))


# ---- the API's trace fields ----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_trace_fields_streaming_and_not(server, path):
    body = {"model": MODEL, "max_tokens": 30, "temperature": 0, "seed": 4, "ignore_eos": True,
            "routing": {"trace": True, "p": 0.5}}
    body.update({"prompt": "Hello"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hello"}]})
    full = post(server, path, body).json()
    choice = full["choices"][0]
    trace, routing = choice["trace"], full["routing"]
    assert len(trace) == 30 and set(trace[0]) == {"token", "text", "model", "handoff", "score", "threshold",
                                                   "rejected", "rejected_text"}
    assert all(t["rejected"] == [] and t["rejected_text"] == "" for t in trace)  # bernoulli drafts nothing
    counts = {m: sum(t["model"] == m for t in trace) for m in ("small", "large")}
    assert {m: c for m, c in counts.items() if c} == routing["tokens_per_model"]
    assert sum(max(0, len(t["handoff"]) - 1) for t in trace) == routing["handoffs"] > 0
    assert all(t["threshold"] == 0.5 and 0 <= t["score"] < 1 for t in trace)
    assert all((t["model"] == "large") == (t["score"] < 0.5) for t in trace)  # the draw decides
    text = choice["text"] if "chat" not in path else choice["message"]["content"]
    assert "".join(t["text"] for t in trace) == text

    chunks = stream_chunks(server, path, {**body, "stream": True})
    streamed = [t for ch in chunks for t in ch["choices"][0]["trace"]]
    assert streamed == trace
    assert chunks[-1]["routing"] == routing

    # Not asked for: no trace anywhere, streaming or not.
    plain = {**body, "routing": {"p": 0.5}}
    assert "trace" not in post(server, path, plain).json()["choices"][0]
    assert all("trace" not in ch["choices"][0] for ch in stream_chunks(server, path, {**plain, "stream": True}))


def test_bad_routing_options_are_400s_naming_the_field(server):
    for routing, param in (({"trace": "yes"}, "routing.trace"), ({"model": "huge"}, "routing.model"),
                           ({"trace": True, "q": 1}, "routing.q")):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "routing": routing})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_models_card_names_the_knob_and_score(server):
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    assert card["members"] == ["small", "large"]
    assert card["routing"] == {"algorithm": "bernoulli", "params": {"p": 0.3}, "score": "draw",
                               "share_knob": "p", "knob_raises_share": True}


def test_page_is_served_without_a_key_and_no_ui_turns_it_off(server, pair):
    r = httpx.get(f"{server.url}/", timeout=10)
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script type="module" src="/ui/app.js">' in r.text
    for name in ("app.js", "pane.js", "sse.js", "style.css"):
        assert httpx.get(f"{server.url}/ui/{name}", timeout=10).status_code == 200
    from tokenrouter.cli import build_parser
    from tokenrouter.engine.tokenizer import load_tokenizer
    from tokenrouter.server.app import ServerConfig, build_app

    assert build_parser().parse_args(["serve", "--no-ui"]).no_ui
    tokenizer = load_tokenizer(str(pair["small"]))
    for ui in (True, False):
        app = build_app(None, tokenizer, ServerConfig(MODEL, ui=ui))  # type: ignore[arg-type]
        paths = {getattr(r, "path", None) for r in app.routes}
        assert ({"/", "/ui"} <= paths) is ui and ({"/", "/ui"} & paths == set()) is not ui


# ---- the page in a browser -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        exe = None
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("the browser tests need chromium and playwright (scripts/env.sh installs both)")
        pytest.skip("no chromium or playwright here (apt-get install chromium; pip install -e .[test])")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def extra() -> dict:
    """Fields added on the way to every request the page sends: `ignore_eos`, so answers run to
    max_tokens, and what a test adds."""
    return {"ignore_eos": True}


@pytest.fixture
def page(chromium, server, extra):
    """The page, the API key typed in."""
    yield from open_page(chromium, server, extra)


@pytest.fixture
def speculative_page(chromium, speculative_server, extra):
    yield from open_page(chromium, speculative_server, extra)


def open_page(chromium, server, extra):
    ctx = chromium.new_context(viewport={"width": 1300, "height": 900}, bypass_csp=True)  # Playwright evaluates JS
    pg = ctx.new_page()

    def add_fields(route):
        if route.request.method != "POST":
            route.continue_()
            return
        route.continue_(post_data=json.dumps({**json.loads(route.request.post_data), **extra}))

    pg.route("**/v1/**", add_fields)
    pg.goto(server.url)
    pg.wait_for_selector("#auth:not([hidden])")  # /v1/models answered 401: the page asks for the key
    pg.fill("#key", KEY)
    pg.click("#key-form button")
    pg.wait_for_selector("#run:not([disabled])", timeout=20_000)
    yield pg
    ctx.close()


def run_on_page(page, button: str) -> dict:
    """Click `button`; the POST the page sent (body, authorization)."""
    with page.expect_request(lambda r: r.method == "POST" and "/v1/" in r.url) as info:
        page.click(button)
    req = info.value
    return {"path": urlparse(req.url).path, "body": json.loads(req.post_data),
            "auth": req.headers.get("authorization")}


def spans(page, pane: int) -> list[dict]:
    return page.eval_on_selector_all(f".pane:nth-child({pane}) .tok", "els => els.map(e => ({...e.dataset}))")


def stat(page, pane: int, key: str) -> str:
    return page.text_content(f".pane:nth-child({pane}) [data-stat={key}]")


def test_page_shows_what_the_api_reports(page, server):
    page.check("input[value=completion]")
    page.fill("#prompt", "Once upon a time")
    page.fill("#max-tokens", "60")
    page.fill("#seed", "3")
    page.fill("#threshold", "0.4")
    sent = run_on_page(page, "#run")
    page.wait_for_selector(".pane:nth-child(1)[data-state=done]", timeout=30_000)
    assert sent["path"] == "/v1/completions" and sent["auth"] == f"Bearer {KEY}"
    assert sent["body"]["routing"] == {"trace": True, "p": 0.4}  # the threshold set on the page

    # The same request (seeded: it routes alike), not streamed, as an API client sees it.
    api = post(server, sent["path"], {**sent["body"], "stream": False, "ignore_eos": True}).json()
    trace, routing = api["choices"][0]["trace"], api["routing"]
    shown = spans(page, 1)
    assert [s["model"] for s in shown] == [t["model"] for t in trace]
    assert [float(s["score"]) for s in shown] == [t["score"] for t in trace]
    assert "".join(s["text"] for s in shown) == api["choices"][0]["text"]
    markers = page.locator(".pane:nth-child(1) .handoff")
    assert markers.count() == routing["handoffs"] > 0
    assert markers.count() == page.locator(".pane:nth-child(1) .handoff.up").count() * 2 - (
        trace[-1]["model"] == "large")  # every visit to large goes up and (but at the end) comes back
    per_model = routing["tokens_per_model"]
    assert int(stat(page, 1, "tokens-small")) == per_model.get("small", 0)
    assert int(stat(page, 1, "tokens-large")) == per_model.get("large", 0)
    assert int(stat(page, 1, "handoffs")) == routing["handoffs"]
    assert stat(page, 1, "share") == f"{100 * per_model.get('large', 0) / 60:.1f}%"
    assert page.get_attribute(".pane:nth-child(1)", "data-reconciled") == "yes"

    # Hover: the score, the threshold, the step and the token's text, escaped.
    large = page.locator(".pane:nth-child(1) .tok[data-model=large]:not(.empty)").first
    i = next(k for k, t in enumerate(trace) if t["model"] == "large" and t["text"])
    large.hover()
    tip = page.locator("#tip")
    tip.wait_for(state="visible")
    assert f"draw: {trace[i]['score']:.4f} (threshold 0.4000)" in tip.text_content()
    assert f"step {i}, written by large" in tip.text_content()
    assert json.dumps(trace[i]["text"], ensure_ascii=False) in tip.text_content()
    # Keyboard: focus moves token by token and the tip follows.
    page.locator(".pane:nth-child(1) .tok").first.focus()
    page.keyboard.press("ArrowRight")
    assert "step 1, written by" in tip.text_content()


def test_run_again_and_one_model_alone_side_by_side(page, server):
    page.fill("#prompt", "Tell me a story")
    page.fill("#max-tokens", "40")
    # a served threshold is whatever calibration found (e.g. 0.6890994906425476): any value submits
    page.fill("#threshold", "0.2345678901")
    first = run_on_page(page, "#run")
    page.wait_for_selector(".pane:nth-child(1)[data-state=done]", timeout=30_000)
    assert first["path"] == "/v1/chat/completions" and first["body"]["routing"]["p"] == 0.2345678901
    page.fill("#threshold", "0.9")
    again = run_on_page(page, "#again")
    page.wait_for_selector(".pane:nth-child(2)[data-state=done]", timeout=30_000)
    assert again["body"]["routing"] == {"trace": True, "p": 0.9}
    assert again["body"]["messages"] == first["body"]["messages"]
    assert page.locator(".pane").count() == 2  # side by side
    share = [float(stat(page, k, "share").rstrip("%")) for k in (1, 2)]
    assert share[1] > share[0]

    alone = run_on_page(page, "#only button[data-model=large]")
    page.wait_for_selector(".pane:nth-child(2)[data-state=done]", timeout=30_000)
    assert alone["body"]["routing"] == {"trace": True, "model": "large"}
    assert {s["model"] for s in spans(page, 2)} == {"large"} and len(spans(page, 2)) == 40
    assert page.locator(".pane:nth-child(2) .handoff").count() == 0 and stat(page, 2, "handoffs") == "0"
    assert page.locator(".pane").count() == 2 and page.get_attribute(".pane:nth-child(2)", "data-reconciled") == "yes"


def test_token_markup_renders_as_text(page, extra, markup_token):
    extra["logit_bias"] = {str(markup_token): 100}
    page.fill("#max-tokens", "3")
    run_on_page(page, "#run")
    page.wait_for_selector(".pane:nth-child(1)[data-state=done]", timeout=30_000)
    shown = spans(page, 1)
    assert [s["text"] for s in shown] == [MARKUP] * 3
    assert page.locator(".pane:nth-child(1) .tok").first.text_content() == MARKUP
    assert page.locator(".answer script, .answer img").count() == 0
    assert page.evaluate("window.pwned") is None
    page.locator(".pane:nth-child(1) .tok").first.hover()
    assert json.dumps(MARKUP) in page.text_content("#tip")


def test_page_strikes_out_the_drafts_the_large_model_rejected(speculative_page, speculative_server):
    """Speculative decoding: each run of drafts the large model rejected is shown struck out where it
    was rejected, with its tokens and text as the API's trace reports them, apart from the answer's
    tokens; the pane counts the rejected drafts and runs."""
    page = speculative_page
    page.check("input[value=completion]")
    page.fill("#prompt", "Once upon a time")
    page.fill("#max-tokens", "24")
    sent = run_on_page(page, "#run")
    page.wait_for_selector(".pane:nth-child(1)[data-state=done]", timeout=30_000)
    api = post(speculative_server, sent["path"], {**sent["body"], "stream": False, "ignore_eos": True}).json()
    trace = api["choices"][0]["trace"]
    runs = [t for t in trace if t["rejected"]]
    assert runs, "the random pair's large model rejected no draft: nothing to show"
    struck = page.eval_on_selector_all(
        ".pane:nth-child(1) del.rejected", "els => els.map(e => ({...e.dataset, text: e.textContent}))")
    assert [d["tokens"] for d in struck] == [" ".join(map(str, t["rejected"])) for t in runs]
    assert [d["text"] for d in struck] == [t["rejected_text"] for t in runs]
    assert {d["model"] for d in struck} == {"large"}
    # each run stands just before the token the large model wrote in its place
    order = page.eval_on_selector_all(".pane:nth-child(1) .answer > .tok, .pane:nth-child(1) .answer > del.rejected",
                                      "els => els.map(e => e.tagName === 'DEL' ? 'x' : e.dataset.model)")
    expected = [m for t in trace for m in (["x"] if t["rejected"] else []) + [t["model"]]]
    assert order == expected
    shown = spans(page, 1)
    assert "".join(s["text"] for s in shown) == api["choices"][0]["text"]  # rejected drafts are no tokens
    assert stat(page, 1, "rejected") == f"{sum(len(t['rejected']) for t in runs)} ({len(runs)})"


def test_stop_aborts_the_request_on_the_server(page, server):
    before = metrics(server)
    page.fill("#max-tokens", "1900")
    run_on_page(page, "#run")
    page.wait_for_function("document.querySelectorAll('.pane .tok').length >= 5", timeout=30_000)
    page.click("#stop")
    page.wait_for_selector(".pane:nth-child(1)[data-state=stopped]", timeout=10_000)
    assert len(spans(page, 1)) < 1900
    # The server counts the abort and frees the request on every model (liveness bound, not a speed claim).
    deadline = time.monotonic() + 20
    while True:
        m = metrics(server)
        aborted = total(m, "tokenrouter_requests_total|finish_reason=abort") - total(
            before, "tokenrouter_requests_total|finish_reason=abort")
        live = total(m, "tokenrouter_model_live_requests")
        used = total(m, "tokenrouter_kv_usage_ratio")
        if aborted == 1 and live == 0 and used == 0 and total(m, "tokenrouter_requests_running") == 0:
            break
        assert time.monotonic() < deadline, f"aborted {aborted}, live {live}, KV usage {used}"
        time.sleep(0.2)
    assert page.is_disabled("#stop")

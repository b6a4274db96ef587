"""`tokenrouter bench` against a live server (CI-sized), and `bench plot`."""

from __future__ import annotations

import json

import pytest
from server_utils import ServerProcess, pair_group_yaml

from tokenrouter import cli
from tokenrouter.bench.loadgen import BenchConfig, RequestResult, summarise
from tokenrouter.bench.workloads import build_prompts, output_lengths


@pytest.fixture(scope="module")
def server(tmp_path_factory, pair_paths):
    cfg = tmp_path_factory.mktemp("bench") / "group.yaml"
    cfg.write_text(
        "name: pair\n"
        "models:\n"
        f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 8192, page_size: 4}}\n"
        f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 8192, page_size: 4}}\n"
        "algorithm: {name: bernoulli, p: 0.2}\n")
    srv = ServerProcess(["--config", str(cfg)])
    yield srv
    srv.stop()


def test_workloads_have_the_papers_shapes():
    low, cap = build_prompts("reasoning-low", "paper", 4)
    assert cap == 2048 and all(p.startswith("Solve") for p in low)
    assert build_prompts("reasoning-high", "paper", 1)[1] == 8192
    agent, cap = build_prompts("agent", "cpu", 2, seed=1)
    assert cap == 64 and all(3000 < len(p) < 5000 for p in agent)  # ~1024 tokens at 4 characters each
    with pytest.raises(ValueError, match="unknown workload"):
        build_prompts("chess", "cpu", 1)


def test_the_arith_workload_asks_held_out_problems_as_chat_turns():
    from tokenrouter.training import arith

    asked: list[str] = []

    class Chat:  # the one tokenizer method a chat workload calls
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, return_dict):
            assert tokenize and add_generation_prompt and [m["role"] for m in messages] == ["user"]
            asked.append(messages[0]["content"])
            return [1, 2, len(asked)]

    ids, cap = build_prompts("arith", "cpu", 3, seed=0, tokenizer=Chat())
    assert cap == 32 and ids == [[1, 2, 1], [1, 2, 2], [1, 2, 3]]
    assert len(set(asked)) == 3 and set(asked) <= {p.prompt for p in arith.split(seed=0).held_out}
    with pytest.raises(ValueError, match="tokenizer"):
        build_prompts("arith", "cpu", 1)


def test_compare_names_what_the_vllm_system_needs(tmp_path, pair_paths):
    from tokenrouter.bench.compare import compare

    cfg = pair_group_yaml(tmp_path, pair_paths)
    for venv in (None, str(tmp_path / "no-venv")):
        with pytest.raises(ValueError, match="--vllm-venv"):
            compare(str(cfg), ["large", "vllm"], "reasoning-low", "cpu", [1], 1, 4, 0, None, vllm_venv=venv)
    with pytest.raises(ValueError, match="unknown system 'chess'"):
        compare(str(cfg), ["large", "chess"], "reasoning-low", "cpu", [1], 1, 4, 0, None)


def test_output_lengths_are_seeded_and_in_range():
    caps = output_lengths(100, 400, range_ratio=0.25, seed=3)
    assert caps == output_lengths(100, 400, range_ratio=0.25, seed=3)
    assert min(caps) >= 25 and max(caps) <= 100 and len(set(caps)) > 30
    assert output_lengths(100, 5, range_ratio=1.0) == [100] * 5
    with pytest.raises(ValueError, match="range_ratio"):
        output_lengths(100, 5, range_ratio=0.0)


def test_summary_statistics():
    cfg = BenchConfig(base_url="x", model="m", prompts=["a"], max_tokens=4, num_requests=3)
    rs = [RequestResult(ok=True, output_tokens=4, ttft=0.1, e2e=0.4, itl=[0.1, 0.1, 0.1],
                        tokens_per_model={"small": 3, "large": 1}, handoffs=2),
          RequestResult(ok=True, output_tokens=4, ttft=0.3, e2e=0.6, itl=[0.1, 0.1, 0.1],
                        tokens_per_model={"small": 4}),
          RequestResult(ok=False, error="HTTP 500")]
    s = summarise(cfg, rs, duration=2.0)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 8)
    assert s["output_throughput"] == 4.0
    assert s["ttft_s"]["mean"] == pytest.approx(0.2) and s["per_user_tok_s"]["mean"] == pytest.approx(10.0)
    assert s["tokens_per_model"] == {"small": 7, "large": 1} and s["handoffs"] == 2


def test_bench_run_and_plot(server, tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    rc = cli.main(["bench", "--base-url", server.url, "--model", "pair", "--num-requests", "6", "--concurrency",
                   "1", "3", "--max-tokens", "8", "--warmup", "1", "--out", str(out), "--save-requests",
                   "--label", "routed"])
    assert rc == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_tokens"] == 48
        assert sum(r["tokens_per_model"].values()) == 48
        assert r["output_throughput"] > 0 and r["ttft_s"]["p99"] is not None
        assert len(r["requests"]) == 6
    rate = tmp_path / "rate.jsonl"
    assert cli.main(["bench", "--base-url", server.url, "--model", "pair", "--num-requests", "4", "--request-rate",
                     "20", "--max-tokens", "4", "--warmup", "0", "--out", str(rate)]) == 0
    assert json.loads(rate.read_text())["completed"] == 4
    assert cli.main(["bench", "plot", str(out), "--out-dir", str(tmp_path / "plots")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["latency_cdf.png", "throughput.png"]
    assert (tmp_path / "plots" / "throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_compare_side_by_side(tmp_path, pair_paths, capsys):
    cfg = pair_group_yaml(tmp_path, pair_paths, p=0.2)
    out = tmp_path / "compare.jsonl"
    rc = cli.main(["bench", "compare", "--config", str(cfg), "--systems", "tokenrouter,large,standard,step-sync",
                   "--concurrency", "2", "--num-requests", "4", "--max-tokens", "6", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["tokenrouter", "large", "standard", "step-sync"]
    assert all(r["completed"] == 4 and r["output_tokens"] == 24 for r in rows)
    # The routed systems write the same tokens per model (same router draws, greedy).
    shares = [r["tokens_per_model"] for r in rows if r["label"] in ("tokenrouter", "standard")]
    assert shares[0] == shares[1]
    assert "against the stronger baseline" in capsys.readouterr().out


def test_bench_compare_on_the_latency_executor(tmp_path, pair_paths, capsys):
    """Every system on the latency-model executor (each model alone and the standard stack's plain
    servers from one-model configs, step-sync in-process), with per-request output caps."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"models": {"small": {"base": 0.002}, "large": {"base": 0.006, "per_seq": 0.0005}}}))
    cfg = pair_group_yaml(tmp_path, pair_paths, p=0.3, extra=f"executor: {{mode: latency, profile: {profile}}}\n")
    out = tmp_path / "compare.jsonl"
    rc = cli.main(["bench", "compare", "--config", str(cfg), "--systems", "tokenrouter,small,standard,step-sync",
                   "--concurrency", "3", "--num-requests", "6", "--max-tokens", "12", "--range-ratio", "0.5",
                   "--out", str(out)])
    assert rc == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["tokenrouter", "small", "standard", "step-sync"]
    caps = output_lengths(12, 6, 0.5, seed=0)
    assert len(set(caps)) > 1
    assert all(r["completed"] == 6 and r["output_tokens"] == sum(caps) for r in rows)
    assert rows[1]["tokens_per_model"] == {"small": sum(caps)}
    # The latency executor draws tokens per (seed, position) and the router per position, so the
    # routed systems write the same number of tokens on each model.
    routed = [r["tokens_per_model"] for r in rows if r["label"] in ("tokenrouter", "standard", "step-sync")]
    assert routed[0] == routed[1] == routed[2] and routed[0]["large"] > 0
    # Per-request records travel with the rows, so `bench plot` draws latency CDFs of a comparison.
    assert all(len(r["requests"]) == 6 and all(x["e2e"] > 0 for x in r["requests"]) for r in rows)
    assert cli.main(["bench", "plot", str(out), "--out-dir", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"

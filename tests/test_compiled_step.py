"""The compiled decode step writes what the eager step writes: same greedy tokens, logits within 1e-4.

One compiled engine per model for the whole module (compiling is the slow part), buckets 1, 2, 4
(`cuda_graph_max_bs=4`), driven side by side with an eager engine of the same settings through one
script that reaches every bucket, a padded one (3 rows in bucket 4), batches too large for any
bucket, prefix-cache hits, preemption and a PENDING request; and a catch-up (a peer's tokens handed
back to a PENDING request), which runs compiled as one row per new token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import prompts_of

from tokenrouter.engine.compiled_step import batch_buckets
from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.engine.req import Req
from tokenrouter.sampling_params import SamplingParams

SPEC = StepOutputSpec(hidden=True, logits=True, top_logits=3, entropy=True)
MAX_BS = 4


def _engine(path: Path, eager: bool, device: str = "cpu") -> Engine:
    # 24 pages of 4 tokens: the later requests of the script preempt earlier ones.
    cfg = EngineConfig(model_path=str(path), device=device, dtype="float32", kv_cache_tokens=96, page_size=4,
                       max_running_requests=8, chunked_prefill_size=64, disable_cuda_graph=eager,
                       linear_backend="aten",  # the compiled step's kernels, so only compilation differs
                       cuda_graph_max_bs=MAX_BS)
    return Engine(cfg, outputs=SPEC)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engines(request: pytest.FixtureRequest, model_paths: dict[str, Path]) -> tuple[Engine, Engine]:
    path = model_paths[request.param]
    return _engine(path, eager=False), _engine(path, eager=True)


Record = list[tuple[str, int, dict[str, Any]]]  # per sampled row: rid, token, its outputs


def _rows(out: StepOutput) -> Record:
    assert out.hidden is not None and out.logits is not None and out.top_logits is not None and out.entropy is not None
    return [(r.rid, tok, {"hidden": out.hidden[i], "logits": out.logits[i], "top_vals": out.top_logits[0][i],
                          "top_ids": out.top_logits[1][i], "entropy": out.entropy[i]})
            for i, (r, tok) in enumerate(zip(out.reqs, out.token_ids))]


def _script(engine: Engine, seed: int) -> tuple[list[Record], list[Req]]:
    """Requests arrive over time, one goes PENDING for a while, later ones share earlier prefixes."""
    base = prompts_of([9, 14, 6, 11], seed=seed)
    later = [base[0][:8] + p for p in prompts_of([3, 5], seed=seed + 1)] + [base[1] + [7]]
    arrivals = {0: base[:1], 2: base[1:2], 4: base[2:4], 12: later}
    short, long = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 24))
    reqs: list[Req] = []
    steps: list[Record] = []
    for i in range(500):
        for p in arrivals.get(i, []):
            # The late requests outgrow the pool together (3 x 10 pages > 24): preemption.
            reqs.append(engine.add_request(p, long if i == 12 else short))
        if i == 7:
            engine.scheduler.set_pending(reqs[1])
        if i == 11:
            engine.scheduler.resume(reqs[1])
        if not engine.has_unfinished():
            break
        result = engine.step()
        steps.append([] if result.step is None else _rows(result.step))
        engine.check_integrity()
    assert not engine.has_unfinished()
    return steps, reqs


def _check_matches_eager(compiled: Engine, eager: Engine) -> None:
    decode = compiled.runner.decode
    assert decode is not None and eager.runner.decode is None
    assert decode.buckets == [1, 2, 4]
    sizes: list[int] = []
    run = decode.run
    decode.run = lambda reqs, ext: sizes.append(sum(ext)) or run(reqs, ext)  # type: ignore[method-assign]
    preempted = compiled.scheduler.num_preemptions, eager.scheduler.num_preemptions
    torch._dynamo.config.error_on_recompile = True  # warm-up compiled every bucket for every key length
    try:
        for seed in (5, 6):
            got, got_reqs = _script(compiled, seed)
            want, want_reqs = _script(eager, seed)
            assert [r.tokens for r in got_reqs] == [r.tokens for r in want_reqs]
            assert len(got) == len(want)
            for g_step, w_step in zip(got, want):
                assert [(rid, tok) for rid, tok, _ in g_step] == [(rid, tok) for rid, tok, _ in w_step]
                for (_, _, g), (_, _, w) in zip(g_step, w_step):
                    for name in ("hidden", "logits", "top_vals", "entropy"):
                        assert (g[name] - w[name]).abs().max().item() < 1e-4, name
                    assert torch.equal(g["top_ids"], w["top_ids"])
    finally:
        torch._dynamo.config.error_on_recompile = False
        del decode.run
    assert {1, 2, 3, 4} <= set(sizes)  # 3 runs padded to bucket 4
    assert max(len(s) for s in got) > MAX_BS  # larger decode batches ran eagerly
    assert compiled.scheduler.num_preemptions - preempted[0] == eager.scheduler.num_preemptions - preempted[1] > 0


def test_compiled_matches_eager_at_every_bucket(engines: tuple[Engine, Engine]) -> None:
    _check_matches_eager(*engines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graphs_match_eager_on_cuda(arch: str, model_paths: dict[str, Path]) -> None:
    compiled = _engine(model_paths[arch], eager=False, device="cuda")
    eager = _engine(model_paths[arch], eager=True, device="cuda")
    _check_matches_eager(compiled, eager)
    assert len(compiled.runner.decode.graphs) >= 3  # type: ignore[union-attr]
    _check_catch_up(compiled, eager)


def _catch_up(engine: Engine) -> tuple[list[Record], list[list[int]]]:
    """Request a goes to a peer at step 3 and comes back at step 5 with three tokens the peer wrote:
    its catch-up (its own last token and the three) is a step of its own, b having finished. Request
    c goes at step 8 and comes back at step 9 with one token, while d decodes beside it."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    a = engine.add_request(prompts_of([7], seed=21)[0], params)
    b = engine.add_request(prompts_of([6], seed=22)[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    c = d = a
    steps: list[Record] = []
    for i in range(60):
        if i == 3:
            engine.scheduler.set_pending(a)
        if i == 5:
            engine.receive(a.rid, len(a.tokens), [11, 12, 13])
        if i == 6:  # a is done by then: the next pair's catch-up step fits the largest bucket (4 rows)
            c = engine.add_request(prompts_of([5], seed=23)[0], params)
            d = engine.add_request(prompts_of([6], seed=24)[0], params)
        if i == 8:
            engine.scheduler.set_pending(c)
        if i == 9:
            engine.receive(c.rid, len(c.tokens), [14])
        if not engine.has_unfinished():
            break
        result = engine.step()
        steps.append([] if result.step is None else _rows(result.step))
        engine.check_integrity()
    return steps, [r.tokens for r in (a, b, c, d)]


def test_catch_up_runs_compiled_as_rows(engines: tuple[Engine, Engine]) -> None:
    _check_catch_up(*engines)


def _check_catch_up(compiled: Engine, eager: Engine) -> None:
    decode = compiled.runner.decode
    assert decode is not None
    extends: list[list[int]] = []
    run = decode.run
    decode.run = lambda reqs, ext: extends.append(list(ext)) or run(reqs, ext)  # type: ignore[method-assign]
    try:
        got, got_tokens = _catch_up(compiled)
    finally:
        del decode.run
    want, want_tokens = _catch_up(eager)
    assert [4] in extends  # a's catch-up: 4 rows in one compiled step
    assert [2, 1] in extends or [1, 2] in extends  # c's catch-up beside d's decode
    assert got_tokens == want_tokens
    for g_step, w_step in zip(got, want, strict=True):
        assert [tok for _, tok, _ in g_step] == [tok for _, tok, _ in w_step]
        for (_, _, g), (_, _, w) in zip(g_step, w_step):
            for name in ("hidden", "logits", "top_vals", "entropy"):
                assert (g[name] - w[name]).abs().max().item() < 1e-4, name
            assert torch.equal(g["top_ids"], w["top_ids"])


def test_drafts_are_verified_in_one_compiled_step(engines: tuple[Engine, Engine]) -> None:
    """A peer's three drafts, the last one wrong: the compiled step runs the four rows, keeps two
    and writes the model's own token at the third, as the eager step does."""
    compiled, eager = engines
    (prompt,) = prompts_of([7], seed=5)
    ref = eager.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), rid="own")
    while eager.has_unfinished():
        eager.step()
    own = ref.output_ids
    wrong = (own[3] + 1) % eager.model_config.vocab_size
    decode = compiled.runner.decode
    assert decode is not None
    extends: list[list[int]] = []
    run = decode.run
    decode.run = lambda reqs, ext: extends.append(list(ext)) or run(reqs, ext)  # type: ignore[method-assign]
    results = []
    try:
        for eng in (compiled, eager):
            req = eng.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), rid="v")
            eng.step()
            assert req.output_ids == own[:1]
            eng.hand_off(req)
            eng.receive("v", len(req.tokens), [own[1], own[2], wrong], drafts=3)
            out = eng.forward_step()
            assert out is not None
            results.append((out.accepted, out.token_ids, req.tokens[len(prompt):], req.drafts))
            eng.abort("v")
            eng.check_integrity()
    finally:
        del decode.run
    assert [4] in extends
    assert results[0] == results[1] == ([2], [own[3]], own[:3], 2)


def test_padding_rows_touch_no_request_page(engines: tuple[Engine, Engine]) -> None:
    compiled, _ = engines
    pool = compiled.pool
    before_k, before_v = pool.k[:, :pool.scratch_slot].clone(), pool.v[:, :pool.scratch_slot].clone()
    decode = compiled.runner.decode
    assert decode is not None
    decode.warm_up()  # every bucket, all rows padding
    assert torch.equal(pool.k[:, :pool.scratch_slot], before_k)
    assert torch.equal(pool.v[:, :pool.scratch_slot], before_v)


def test_buckets_and_config() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(model_path="x", cuda_graph_max_bs=0)


def test_cli_flags() -> None:
    import argparse

    from tokenrouter.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--enforce-eager", "--cuda-graph-max-bs", "8"]))
    assert kw["disable_cuda_graph"] is True and kw["cuda_graph_max_bs"] == 8
    assert engine_kwargs(p.parse_args(["--disable-cuda-graph"]))["disable_cuda_graph"] is True
    assert "disable_cuda_graph" not in engine_kwargs(p.parse_args([]))  # the EngineConfig default stands

"""Router inference cost against the model's decode step, per batch size.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_router_cost.py

Routers run once per step over the whole batch. This times each head (paper architectures: CITER's
MLP, R2R's 6 residual blocks over hidden + token embedding + top-100 logits, Co-LLM's deferral head)
against one decode step of the small model at the same batch size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.models.random_model import build_random_model
from tokenrouter.routing.routers import CiterRouter, DeferralHead, R2RRouter
from tokenrouter.sampling_params import SamplingParams


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_step(engine: Engine, batch: int, steps: int) -> float:
    p = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(i * 7 + j) % 250 for j in range(64)], p)
    while any(r.kv_len < r.prompt_len for r in engine.reqs.values()):
        engine.step()
    t = timed(engine.step, steps)
    engine.abort_all()
    engine.cache.reset()
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="30m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = build_random_model(tempfile.mkdtemp() + "/m", "llama", args.preset, seed=0)
    engine = Engine(EngineConfig(model_path=str(path), kv_cache_tokens=64 * 256, max_running_requests=64,
                                 device="cpu"))
    h = engine.model_config.hidden_size
    heads = {"citer": CiterRouter(h).eval(), "r2r": R2RRouter(h, top_k=100).eval(), "co_llm": DeferralHead(h).eval()}
    print(f"model preset {args.preset} (hidden {h}); times are medians of {args.repeats}")
    print(f"{'batch':>5} {'decode step ms':>15} " + " ".join(f"{k + ' ms (share)':>22}" for k in heads))
    for b in args.batches:
        step = decode_step(engine, b, args.repeats)
        hid, emb, top = torch.randn(b, h), torch.randn(b, h), torch.randn(b, 100)
        cells = []
        for kind, head in heads.items():
            args_in = (hid, emb, top) if kind == "r2r" else (hid,)
            with torch.inference_mode():
                t = timed(lambda head=head, args_in=args_in: head(*args_in), args.repeats)
            cells.append(f"{t * 1e3:9.3f} ({100 * t / step:5.1f}%)")
        print(f"{b:5d} {step * 1e3:15.2f} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()

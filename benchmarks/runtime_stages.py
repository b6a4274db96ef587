"""The runtime's own cost per step, by stage, on the latency-model executor.

For each batch size N, N requests run at once (prompts of ~16 tokens, `--max-tokens` each) through
the entry with text release on (as the server runs it), once for the small model alone and once for
the routed pair (bernoulli p). The subservers and the entry write stage records to a step trace
(tokenrouter/engine/step_trace.py); the table gives each stage's mean milliseconds per step of a
model (or the median, --stat median), and its share of that model's step (the profile's sleep, measured):

    drain       handling inbox messages (hand-offs, new requests) since the previous step
    sched+samp  Engine.forward_step less the model step: scheduling, batch, page commit, token draws
    route       the routing algorithm's decisions for the step's rows
    commit      appending tokens, stop checks, token events (per request)
    tokens_msg  encoding and sending the step's Tokens message to the entry
    finish      Finished messages (and finish notices to peers)
    handoff     PENDING bookkeeping and the Peer messages of the step's hand-offs
    overlap     work done while the model step runs (hidden behind it; not added to `total`)
    entry       the entry's reassembly and detokenisation of the tokens, per step of that model
                (another process: it costs the step only where cores are short)

HTTP streaming is not in this table: `tokenrouter bench compare` (benchmarks/paper_compare.py) runs
the whole server.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_stages.py --batch 8 32 64 128

With --config (a real group, e.g. the prepared default pair), the setups are `routed` (that group,
its own algorithm) and `small` / `large` (each of its models alone), on real models, asked the
held-out arithmetic chat prompts of `tokenrouter bench compare --workload arith`; the model step
is then the real forward (for the large model of a routed pair: its catch-up extends included):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_stages.py --config PAIR.yaml \
        --setups large,routed --batch 1 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tokenrouter import SamplingParams
from tokenrouter.bench.trace_reader import read_stages
from tokenrouter.engine.step_trace import ENV as TRACE_ENV
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.entry.reassembly import Done
from tokenrouter.runtime.group_config import GroupConfig

sys.path.insert(0, os.path.dirname(__file__))
from paper_compare import ROOT, config_folder  # noqa: E402

STAGES = ("drain", "sched+samp", "route", "commit", "tokens_msg", "finish", "handoff")


def group(folder: Path, profile: str, routed: bool, p: float) -> GroupConfig:
    model = {"path": str(folder), "kv_cache_tokens": 1 << 20, "max_running_requests": 256}
    models = [{"name": "small", **model}] + ([{"name": "large", **model}] if routed else [])
    algorithm = {"name": "bernoulli", "p": p} if routed else {"name": "single"}
    return GroupConfig.from_dict({"name": "stages", "models": models, "algorithm": algorithm,
                                  "launch": {"policy": "eager"}, "executor": {"mode": "latency", "profile": profile}})


def real_group(config: str, setup: str) -> GroupConfig:
    """The group of `config` (setup `routed`), or one of its models alone (`small`, `large`)."""
    cfg = GroupConfig.from_yaml(config)
    if setup == "routed":
        return cfg
    if setup not in ("small", "large"):
        raise SystemExit(f"setup {setup!r}: with --config, setups are small, large and routed")
    d = cfg.to_dict()
    d["models"] = [d["models"][0 if setup == "small" else 1]]
    d.update(name=setup, algorithm="single", algorithm_params={}, launch={"policy": "eager"}, routers={})
    return GroupConfig.from_dict(d)


def run_batch(entry: Entry, n: int, max_tokens: int, prompts: list[list[int]] | None = None) -> None:
    """N requests at once, until all are done."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = prompts or [[100 + (i * 7 + j) % 5000 for j in range(16)] for i in range(n)]
    live = {entry.add(ids[i % len(ids)], params).rid for i in range(n)}
    while live:
        for ev in entry.poll(0.05):
            if isinstance(ev, Done):
                if ev.error:
                    raise RuntimeError(f"request failed: {ev.error}")
                live.discard(ev.rid)


def table(trace: str, start: float, end: float, names: list[str], n: int, label: str, stat: str) -> list[str]:
    recs = read_stages(trace, start, end)
    entry = [r for r in recs if r.model == -1]
    rows = []
    for m, name in enumerate(names):
        mine = [r for r in recs if r.model == m and r.step is not None]
        if not mine:
            continue
        model_s = np.array([r.step.end - r.step.start for r in mine])  # type: ignore[union-attr]
        cols = {k: np.zeros(len(mine)) for k in (*STAGES, "overlap")}
        for i, r in enumerate(mine):
            for k, v in r.stages.items():
                if k == "forward":
                    cols["sched+samp"][i] = v - model_s[i]
                elif k in cols:
                    cols[k][i] = v
        batch = np.mean([len(r.step.rids) for r in mine])  # type: ignore[union-attr]
        agg = np.mean if stat == "mean" else np.median
        step = float(agg(model_s))
        ms = {k: 1000 * float(agg(cols[k])) for k in (*STAGES, "overlap")}
        total = sum(ms[k] for k in STAGES)
        # The entry's work, spread over this model's steps by its share of the tokens.
        share = sum(len(r.step.rids) for r in mine) / max(1, sum(len(r.step.rids) for r in recs  # type: ignore[union-attr]
                                                                 if r.model >= 0 and r.step is not None))
        entry_ms = 1000 * share * sum(r.stages["reassembly"] for r in entry) / len(mine)
        cells = " | ".join(f"{ms[k]:.3f}" for k in (*STAGES, "overlap"))
        rows.append(f"| {label} | {n} | {name} | {batch:.1f} | {1000 * step:.2f} | {cells} | {total:.3f} | "
                    f"{100 * total / (1000 * step):.1f}% | {entry_ms:.3f} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=str(ROOT / "profiles" / "paper_qwen3_0.6b_32b_a100_separate.json"))
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64, 128])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stat", default="mean", choices=["mean", "median"],
                    help="per stage over the steps (throughput goes with the mean; a busy machine's outliers too)")
    ap.add_argument("--setups", default="small,routed", help="comma-separated: small (alone), routed (the pair)")
    ap.add_argument("--config", help="a real group's YAML (the latency-model profile is then unused)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = config_folder()
    prompts = None
    if args.config:
        from tokenrouter.bench.workloads import build_prompts
        from tokenrouter.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(GroupConfig.from_yaml(args.config).models[-1].engine.model_path)
        prompts, _ = build_prompts("arith", "cpu", max(args.batch), 0, tok)
    header = ("| setup | N | model | mean batch | model step ms | " + " | ".join(STAGES) + " | overlap | total ms | "
              "total % of step | entry ms |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    with tempfile.TemporaryDirectory(prefix="runtime-stages-") as trace:
        os.environ[TRACE_ENV] = trace  # before the subservers spawn: they inherit it
        for setup in [s.strip() for s in args.setups.split(",") if s.strip()]:
            cfg = real_group(args.config, setup) if args.config else group(folder, args.profile, setup == "routed",
                                                                           args.p)
            entry = Entry(cfg, detokenize=True)
            try:
                run_batch(entry, 4, 8, prompts)  # warm-up
                for n in args.batch:
                    t0 = time.perf_counter()
                    run_batch(entry, n, args.max_tokens, prompts)
                    rows = table(trace, t0, time.perf_counter(), cfg.names, n, setup, args.stat)
                    print("\n".join(rows), flush=True)
                    lines += rows
            finally:
                entry.close()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

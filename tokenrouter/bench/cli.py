"""`tokenrouter bench` (run a load against an OpenAI-compatible endpoint) and `tokenrouter bench plot`."""

from __future__ import annotations

import argparse
import asyncio
import json

from tokenrouter.bench.loadgen import BenchConfig, run_bench, write_jsonl
from tokenrouter.bench.workloads import RANDOM, WORKLOADS, build_prompts, random_id_prompts


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server (`bench plot` draws results)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    r = bsub.add_parser("run", help="run a load (the default: `tokenrouter bench --base-url ...`)")
    r.add_argument("--base-url", default="http://127.0.0.1:8000")
    r.add_argument("--model", required=True, help="the model name the server answers to")
    r.add_argument("--api-key", default=None)
    r.add_argument("--workload", default="reasoning-low", choices=[*sorted(WORKLOADS), RANDOM],
                   help=f"{RANDOM!r}: --random-input-len random token ids per prompt (needs --tokenizer), "
                        "--max-tokens output tokens (default 64)")
    r.add_argument("--random-input-len", type=int, default=128, help=f"prompt length of the {RANDOM!r} workload")
    r.add_argument("--scale", default="cpu", choices=["cpu", "paper"])
    r.add_argument("--tokenizer", default=None, help="model folder whose tokenizer cuts long prompts exactly")
    r.add_argument("--max-tokens", type=int, default=None, help="override the workload's output cap")
    r.add_argument("--num-requests", type=int, default=32)
    r.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed loop; several: one run each")
    r.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (open loop)")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--label", default=None, help="a name for this system in the JSONL and plots")
    r.add_argument("--out", default=None, help="append one JSON line per run here")
    r.add_argument("--save-requests", action="store_true", help="include per-request records in the JSONL")
    r.set_defaults(func=cmd_bench)
    p = bsub.add_parser("plot", help="draw throughput vs concurrency and latency CDFs from JSONL files")
    p.add_argument("files", nargs="+")
    p.add_argument("--out-dir", default="bench_plots")
    p.set_defaults(func=cmd_plot)
    from tokenrouter.bench.compare import add_compare_parser

    add_compare_parser(bsub)


def cmd_bench(args: argparse.Namespace) -> int:
    tok = None
    if args.tokenizer:
        from tokenrouter.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    prompts: list[str] | list[list[int]]
    if args.workload == RANDOM:
        if tok is None:
            raise SystemExit(f"--workload {RANDOM} needs --tokenizer (its vocabulary)")
        prompts, cap = random_id_prompts(args.num_requests, args.random_input_len, tok, args.seed), 64
    else:
        prompts, cap = build_prompts(args.workload, args.scale, args.num_requests, args.seed, tok)
    concurrencies = args.concurrency if args.concurrency else ([None] if args.request_rate else [8])
    for c in concurrencies:
        cfg = BenchConfig(base_url=args.base_url, model=args.model, prompts=prompts,
                          max_tokens=args.max_tokens or cap, num_requests=args.num_requests, concurrency=c,
                          request_rate=args.request_rate if c is None else None, warmup=args.warmup,
                          temperature=args.temperature, ignore_eos=not args.no_ignore_eos, api_key=args.api_key,
                          seed=args.seed)
        summary, results = asyncio.run(run_bench(cfg))
        extra = {"label": args.label or args.model, "workload": args.workload, "scale": args.scale}
        if args.out:
            write_jsonl(args.out, summary, extra, results if args.save_requests else None)
        print(json.dumps({**extra, **summary}, indent=None))
        print(f"[{extra['label']}] concurrency {c}: {summary['completed']} ok, {summary['failed']} failed, "
              f"{summary['output_throughput']:.1f} output tok/s, TTFT median {summary['ttft_s']['median']}, "
              f"per-user {summary['per_user_tok_s']['mean']} tok/s, tokens per model {summary['tokens_per_model']}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from tokenrouter.bench.plot import plot

    for path in plot(args.files, args.out_dir):
        print(path)
    return 0

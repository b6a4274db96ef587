"""`tokenrouter prepare` (make the default pair) and `tokenrouter eval` (its quality and cost)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def cmd_prepare(args: argparse.Namespace) -> int:
    from tokenrouter.training.prepare import prepare, settings_for

    pair = prepare(settings_for(args.quick), progress=not args.quiet, threads=args.num_threads)
    meta = pair.meta()
    st = meta["student"]
    print(f"large model: {pair.large}")
    print(f"small model: {pair.small} ({st['parameters'] / 1e6:.1f}M parameters, {st['train_tokens']} tokens, "
          f"{st['train_seconds']} s; held-out CE {st['held_out']['student_ce']:.3f} vs the large model's "
          f"{st['held_out']['teacher_ce']:.3f})")
    if "answer_top1_agreement" in st["held_out"]:
        print(f"small model on the large model's held-out answers: top-1 agreement "
              f"{st['held_out']['answer_top1_agreement']:.3f}, CE {st['held_out']['answer_ce']:.3f}")
    for kind, m in meta["router_metrics"].items():
        print(f"{kind} router: {pair.routers[kind]} (held-out AUC {m['auc']:.3f}; router.json threshold "
              f"{meta['corpus_thresholds'][kind]:.6g}; served {meta['thresholds'][kind]:.6g})")
        for p in meta["operating_points"].get(kind, []):
            print(f"  {p['param']}={p['value']:.6g}: validation accuracy {p['accuracy']:.3f}, "
                  f"large share {p['share']:.3f}")
    served = meta["served"]
    print(f"served: {served['algorithm']} {served['param']}={served['value']:.6g} (validation accuracy "
          f"{served['accuracy']:.3f} at a large share of {served['share']:.3f})")
    print(f"group config: {pair.config}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from tokenrouter.training.evaluation.run import EvalSettings, evaluate, table, write
    from tokenrouter.training.prepare import prepare, settings_for

    pair = prepare(settings_for(args.quick), progress=not args.quiet, threads=args.num_threads)
    # the evaluation's own forwards (NLL under the large model, query features) run in this process
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    for name in args.task:  # several tasks: one folder each under --out
        out = Path(args.out) / name if len(args.task) > 1 else Path(args.out)
        s = EvalSettings(task=name, problems=args.problems, max_tokens=args.max_tokens,
                         algorithms=tuple(args.algorithms),
                         points=args.points, query_train_problems=args.query_train_problems)
        results = evaluate(pair, s, progress=not args.quiet, log=lambda m: print(m, file=sys.stderr))
        write(results, out, s, pair)
        print(f"## {name}\n{table(results)}")
        print(f"written: {out}/eval.json, eval.md, quality_vs_cost.png")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="the reduced CI setting: a barely trained student carved from one layer, small routers")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: every core)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_prepare_parsers(subparsers: Any) -> None:
    from tokenrouter.training.evaluation.run import TOKEN_LEVEL, EvalSettings
    from tokenrouter.training.evaluation.tasks import TASKS

    p = subparsers.add_parser("prepare", help="make the embedded default routed pair and its routers (cached)")
    _common(p)
    p.set_defaults(func=cmd_prepare)

    d = EvalSettings()
    e = subparsers.add_parser("eval", help="quality and cost of routing on a task's held-out problems")
    _common(e)
    e.add_argument("--task", nargs="+", default=[d.task], choices=list(TASKS),
                   help="champ: CHAMP competition problems; arith: generated arithmetic and word problems; "
                        "arith_reworded: the same asked in wordings nothing trains on (several: one folder "
                        "each under --out)")
    e.add_argument("--problems", type=int, default=d.problems,
                   help="held-out problems answered (default: all of the task's)")
    e.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output tokens per answer (default: the task's, arith 32 and champ 96)")
    e.add_argument("--algorithms", nargs="+", default=list(d.algorithms), choices=list(TOKEN_LEVEL))
    e.add_argument("--points", type=int, default=d.points,
                   help="thresholds per algorithm, around the served one (an odd number includes it)")
    e.add_argument("--query-train-problems", type=int, default=d.query_train_problems,
                   help="training problems that fit the query-level router")
    e.add_argument("--out", default="eval-results", help="folder for eval.json, eval.md and the plot")
    e.set_defaults(func=cmd_eval)

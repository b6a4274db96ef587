"""`tokenrouter train-router`: train a CITER, R2R or Co-LLM router for a model pair on a corpus.

Wire into the main command line with `add_train_router_parser(subparsers)`; or run standalone:
`python -m tokenrouter.training.cli --kind r2r --small S --large L --corpus C --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HELP = "train a CITER, R2R or Co-LLM router head for a model pair on a text corpus"


def add_train_router_args(p: argparse.ArgumentParser) -> None:
    from tokenrouter.training.train import TrainSettings

    d = TrainSettings()
    p.add_argument("--kind", required=True, choices=["citer", "r2r", "co_llm"])
    p.add_argument("--small", required=True, help="the small model's Hugging Face folder (the router reads it)")
    p.add_argument("--large", required=True, help="the large model's Hugging Face folder")
    p.add_argument("--corpus", required=True,
                   help="a .txt file (one text), a .jsonl file (a \"text\" field per line), or a directory of them")
    p.add_argument("--out", required=True, help="the router folder to write")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("data")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens, help="stop after this many corpus tokens (0: all)")
    g.add_argument("--max-sequences", type=int, default=None, help="stop after this many sequences")
    g.add_argument("--held-out", type=float, default=d.held_out, help="share of sequences held out")
    g = p.add_argument_group("labels")
    g.add_argument("--top-k", type=int, default=d.top_k, help="R2R: top-k logits fed to the head")
    g.add_argument("--continuation", type=int, default=d.continuation,
                   help="R2R: greedy tokens compared after each differing position")
    g.add_argument("--label-batch-size", type=int, default=d.label_batch_size, help="sequences per forward")
    g.add_argument("--continuation-batch-size", type=int, default=d.continuation_batch_size,
                   help="rows per continuation forward")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=d.epochs)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="positions per step")
    g.add_argument("--patience", type=int, default=d.patience, help="early-stopping patience (epochs)")
    g.add_argument("--pos-weight", type=float, default=d.pos_weight,
                   help="BCE weight of positives (tokens that should go to the large model)")
    g.add_argument("--width", type=int, default=None,
                   help="R2R body width (default: a quarter of the hidden size, at least 64)")
    g.add_argument("--blocks", type=int, default=d.blocks, help="R2R residual blocks")
    g.add_argument("--init-epochs", type=int, default=d.init_epochs,
                   help="Co-LLM: epochs on the weak labels before the mixture loss")
    g.add_argument("--full-finetune", action="store_true",
                   help="Co-LLM: also fine-tune the whole small model (saved to OUT/small_model)")
    g.add_argument("--finetune-epochs", type=int, default=d.finetune_epochs)
    g.add_argument("--finetune-lr", type=float, default=d.finetune_lr)
    g.add_argument("--finetune-batch-size", type=int, default=d.finetune_batch_size)
    g = p.add_argument_group("calibration")
    t = g.add_mutually_exclusive_group()
    t.add_argument("--target-recall", type=float, default=None,
                   help="recall of should-go-large tokens to keep on held-out data (default 0.95)")
    t.add_argument("--target-large-share", type=float, default=None,
                   help="instead: the share of tokens to send to the large model")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"],
                   help="the models' dtype while labelling (heads always train in float32)")
    g.add_argument("--num-threads", type=int, default=1, help="torch threads on CPU (default 1)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        seed=args.seed, seq_len=args.seq_len, max_tokens=args.max_tokens or None,
        max_sequences=args.max_sequences, held_out=args.held_out, top_k=args.top_k,
        continuation=args.continuation, label_batch_size=args.label_batch_size,
        continuation_batch_size=args.continuation_batch_size, epochs=args.epochs, lr=args.lr,
        weight_decay=args.weight_decay, batch_size=args.batch_size, patience=args.patience,
        pos_weight=args.pos_weight, width=args.width, blocks=args.blocks, init_epochs=args.init_epochs,
        full_finetune=args.full_finetune, finetune_epochs=args.finetune_epochs, finetune_lr=args.finetune_lr,
        finetune_batch_size=args.finetune_batch_size, target_recall=args.target_recall,
        target_share=args.target_large_share, device=args.device, dtype=args.dtype,
        progress=not args.quiet,
    )


def _fmt(v: Any) -> str:
    return "n/a" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def cmd_train_router(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from tokenrouter.routing import algorithm_class
    from tokenrouter.training.labels import read_corpus
    from tokenrouter.training.train import train_router

    torch.set_num_threads(max(1, args.num_threads))
    texts = read_corpus(args.corpus)
    out = train_router(args.kind, args.small, args.large, texts, args.out, **settings_from_args(args))
    meta = json.loads((out / "router.json").read_text())
    m, data = meta["metrics"], meta["training"]["data"]
    print(f"router written to {out}")
    print(f"data: {data['sequences']} sequences, {data['positions']} positions, greedy tokens differ at "
          f"{_fmt(data['differs_share'])}" + (f", divergent {_fmt(data['divergent_share'])}"
                                             if "divergent_share" in data else ""))
    print(f"held-out ({m['positions']} positions, positive share {_fmt(m['positive_share'])}): "
          f"AUC {_fmt(m['auc'])}, threshold {m['threshold']!r} (route when score {m['rule']} threshold), "
          f"recall {_fmt(m['recall'])}, precision {_fmt(m['precision'])}, large share {_fmt(m['large_share'])}")
    param = algorithm_class(args.kind).knob_param()
    print(f"note: the {args.kind} algorithm serves this calibrated threshold (\"{param}\": {m['threshold']!r}) "
          f"unless the group config sets \"{param}\"")
    if meta["training"].get("full_finetune"):
        print(f"serve with the fine-tuned small model: {meta['pair']['small']['path']}")
    return 0


def add_train_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `train-router` to a command line's subparsers (sets func=cmd_train_router)."""
    p = subparsers.add_parser("train-router", help=HELP, description=HELP)
    add_train_router_args(p)
    p.set_defaults(func=cmd_train_router)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.training.cli", description=HELP)
    add_train_router_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return cmd_train_router(args)
    except (ValueError, OSError) as e:
        print(f"tokenrouter train-router: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The small model's recipes side by side: held-out cross-entropy against decode cost.

Each recipe trains a student of SmolLM2-135M-Instruct with `train_student` (the same training
sequences, teacher top-k targets, steps and schedule; only the student's starting point differs),
into a temporary folder; then every student and SmolLM2 are timed in our engine in alternating rounds
(tokenrouter.bench.decode_cost). Printed: per recipe its parameters, the held-out CE (16 x 256 tokens
of held-out CHAMP solutions), its training time, and its decode step against SmolLM2's at batch 1
and 8. The target: CE <= 3.5 at a decode cost <= 0.3 of SmolLM2's.

Run alone on the machine (training uses every core; one torch thread for the timing):

    python benchmarks/student_recipes.py [--recipes scratch carve3 carve4] [--steps 150]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch

from tokenrouter.bench.decode_cost import decode_costs
from tokenrouter.training.default_model import ensure_smollm2
from tokenrouter.training.student import StudentSettings, train_student

RECIPES = {
    # the earlier default's shape (hidden 256, 6 layers, own embedding from the teacher's top principal directions)
    "scratch": StudentSettings(layers=()),
    "carve3": StudentSettings(),  # the default: SmolLM2's layers 0, 1 and 29
    "carve4": StudentSettings(layers=(0, 1, 2, 29)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=list(RECIPES))
    ap.add_argument("--steps", type=int, default=StudentSettings().steps)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    large = ensure_smollm2(progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        folders, meta = {}, {}
        for name in args.recipes:
            torch.set_num_threads(os.cpu_count() or 1)
            s = dataclasses.replace(RECIPES[name], steps=args.steps)
            folders[name] = train_student(large, Path(tmp) / name, s, progress=False)
            meta[name] = json.loads((folders[name] / "student.json").read_text())
            print(f"{name}: held-out CE {meta[name]['held_out']['student_ce']:.3f} "
                  f"(teacher {meta[name]['held_out']['teacher_ce']:.3f}), {meta[name]['train_seconds']:.0f} s",
                  flush=True)
        torch.set_num_threads(1)
        cost = decode_costs({**folders, "smollm2": large}, args.batch_sizes)
    cols = " | ".join(f"decode / SmolLM2, batch {b}" for b in args.batch_sizes)
    print(f"| recipe | parameters | held-out CE | KL to SmolLM2 | train s (teacher s) | {cols} |")
    print("|---|---|---|---|---|" + "---|" * len(args.batch_sizes))
    for name in args.recipes:
        m = meta[name]
        ratios = " | ".join(f"{cost[(name, b)] / cost[('smollm2', b)]:.3f}" for b in args.batch_sizes)
        held = m["held_out"]
        print(f"| {name} | {m['parameters'] / 1e6:.1f}M | {held['student_ce']:.3f} | {held['kl_to_teacher']:.3f} | "
              f"{m['train_seconds']:.0f} ({m['teacher_seconds']:.0f}) | {ratios} |")
    ms = " | ".join(f"{cost[('smollm2', b)] * 1e3:.1f} ms" for b in args.batch_sizes)
    print(f"SmolLM2 decode step: {ms}; held-out CE {meta[args.recipes[0]]['held_out']['teacher_ce']:.3f}")


if __name__ == "__main__":
    main()

"""The small model's recipes side by side: agreement with SmolLM2 against decode cost.

Each recipe trains a student of SmolLM2-135M-Instruct with `train_student` as `tokenrouter prepare`
does (its corpus and answer sequences, teacher top-k targets and schedule; the recipes share one
teacher pass), into a temporary folder, and differs from the prepared default only where it says.
Then every student and SmolLM2 are timed in our engine in alternating rounds
(tokenrouter.bench.decode_cost). Printed per recipe: its parameters, top-1 agreement with SmolLM2 on
its answers to the routers' problems (answer tokens the student never trained on; as served, in
blocks, and before quantization), held-out CE on CHAMP solutions, training time, the decode step
against SmolLM2's at batch 1 and 8. Agreement drives both modes: quality at a share, and drafts
accepted per verification.

Reads the large model's answers that `tokenrouter prepare` keeps (it prepares the pair first if needed).
Run alone on the machine (training uses every core; one torch thread for the timing):

    .venv/bin/python benchmarks/student_recipes.py [--recipes carve3 carve4 carve5 carve3-2x carve3-4x carve5-2x]
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
from tokenrouter.training import large_answers
from tokenrouter.training.prepare import PrepareSettings, answers_path, prepare, split_answers
from tokenrouter.training.student import TeacherTargets, train_student

BASE = PrepareSettings().student  # the prepared default: SmolLM2's layers 0, 1 and 29, 160 steps
RECIPES = {
    "carve3": BASE,
    "carve4": dataclasses.replace(BASE, layers=(0, 1, 2, 29)),
    "carve5": dataclasses.replace(BASE, layers=(0, 1, 2, 3, 29)),
    "carve3-2x": dataclasses.replace(BASE, steps=2 * BASE.steps),  # twice the steps over the same sequences
    "carve3-4x": dataclasses.replace(BASE, steps=4 * BASE.steps),
    "carve5-2x": dataclasses.replace(BASE, layers=(0, 1, 2, 3, 29), steps=2 * BASE.steps),
    "scratch": dataclasses.replace(BASE, layers=()),  # a narrow Llama (hidden 256, 6 layers) from scratch
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", choices=sorted(RECIPES),
                    default=["carve3", "carve4", "carve5", "carve3-2x"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    settings = PrepareSettings()
    large = prepare(settings).large  # found in the cache where it was made before
    student_answers, held_answers = split_answers(settings, large_answers.load(answers_path(settings)))
    shared: dict[str, TeacherTargets] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders, meta = {}, {}
        for name in args.recipes:
            torch.set_num_threads(os.cpu_count() or 1)
            folders[name] = train_student(large, Path(tmp) / name, RECIPES[name], progress=False,
                                          exchanges=student_answers, held_exchanges=held_answers,
                                          targets_cache=shared)
            meta[name] = json.loads((folders[name] / "student.json").read_text())
            held = meta[name]["held_out"]
            print(f"{name}: agreement {held['answer_top1_agreement']:.4f}, held-out CE {held['student_ce']:.3f}, "
                  f"{meta[name]['train_seconds']:.0f} s (teacher {meta[name]['teacher_seconds']:.0f} s)", flush=True)
        torch.set_num_threads(1)
        cost = decode_costs({**folders, "smollm2": large}, args.batch_sizes)
    rows = []
    for name in args.recipes:
        m, f = meta[name]["held_out"], meta[name].get("held_out_float", meta[name]["held_out"])
        rows.append({"recipe": name, "parameters": meta[name]["parameters"],
                     "agreement": m["answer_top1_agreement"], "agreement_float": f["answer_top1_agreement"],
                     "answer_tokens": m["answer_tokens"], "held_out_ce": m["student_ce"],
                     "train_seconds": meta[name]["train_seconds"], "teacher_seconds": meta[name]["teacher_seconds"],
                     "decode_ratio": {b: cost[(name, b)] / cost[("smollm2", b)] for b in args.batch_sizes}})
    cols = " | ".join(f"decode / SmolLM2, batch {b}" for b in args.batch_sizes)
    print(f"| recipe | parameters | agreement, served (float) | held-out CE | s, teacher pass + training | {cols} |")
    print("|---|---:|---|---:|---:|" + "---:|" * len(args.batch_sizes))
    for r in rows:
        print(f"| {r['recipe']} | {r['parameters'] / 1e6:.1f}M | {100 * r['agreement']:.2f}% "
              f"({100 * r['agreement_float']:.2f}%) | {r['held_out_ce']:.3f} | "
              f"{r['teacher_seconds']:.0f} + {r['train_seconds'] - r['teacher_seconds']:.0f} | "
              + " | ".join(f"{r['decode_ratio'][b]:.3f}" for b in args.batch_sizes) + " |")
    ms = " | ".join(f"{cost[('smollm2', b)] * 1e3:.1f} ms" for b in args.batch_sizes)
    print(f"SmolLM2 decode step: {ms}; agreement measured on {rows[0]['answer_tokens']} answer tokens")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "smollm2_step_s": {b: cost[("smollm2", b)] for b in
                                                                               args.batch_sizes}}, indent=1))


if __name__ == "__main__":
    main()

"""Router labels from the pair's own trajectories against labels from corpus text (issue 18, item 1).

The default pair's routers are labelled by teacher forcing both models over CHAMP solutions the
student never read: text neither model wrote. Served, the router reads the pair's own answers. Here
a second router of the same kind is labelled on the served pair's rollouts instead (the served group,
greedy, answering every CHAMP and arithmetic *training* problem, prompt and answer as one text, as
CITER's paper iterates on its own rollouts), with every other setting as `prepare`'s; both routers are
calibrated on-policy to the same target share on the same calibration prompts, then both answer the
held-out problems of both tasks. Printed per router and task: the threshold, the large-token share,
the NLL under SmolLM2 and the accuracy with its 95% interval, with the two models alone.

Run alone on the machine, after `tokenrouter prepare`:

    python benchmarks/router_labels.py [--kind citer] [--arith-problems 200] [--champ-problems 40]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.training import arith, champ
from tokenrouter.training.champ import chat_prompts
from tokenrouter.training.evaluation.run import EvalSettings, SystemResult, evaluate
from tokenrouter.training.on_policy import calibrate_group
from tokenrouter.training.prepare import (
    PreparedPair,
    PrepareSettings,
    calibration_problems,
    group_dict,
    prepare,
)
from tokenrouter.training.train import train_router


def rollouts(pair: PreparedPair, kind: str, threshold: float, tok: Any, seed: int) -> list[str]:
    """The served group's greedy answers to every training problem of both tasks, as prompt + answer."""
    group = GroupConfig.from_dict(group_dict(pair.small, pair.large, pair.routers, {kind: threshold}, kind))
    texts = []
    with RoutedLLM(group) as llm:
        for problems, max_tokens in ((champ.split(seed=seed).train, 96), (arith.split(seed=seed).train, 32)):
            prompts = chat_prompts(tok, problems)
            outs = llm.generate(prompt_token_ids=prompts, use_tqdm=True,
                                sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
            texts += [tok.decode(p + o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    return texts


def with_router(pair: PreparedPair, kind: str, router: Path, threshold: float, folder: Path) -> PreparedPair:
    """The pair with `kind`'s router and served threshold replaced (a prepared.json in `folder`)."""
    meta = pair.meta()
    meta["routers"] = {**meta["routers"], kind: str(router)}
    meta["thresholds"] = {**meta["thresholds"], kind: threshold}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prepared.json").write_text(json.dumps(meta, indent=1))
    return PreparedPair(folder, pair.large, pair.small, {**pair.routers, kind: router})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("citer", "r2r", "co_llm"), default="citer")
    ap.add_argument("--arith-problems", type=int, default=200)
    ap.add_argument("--champ-problems", type=int, default=40)
    args = ap.parse_args()
    s = PrepareSettings()
    pair = prepare(s)
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(str(pair.large))
    meta = pair.meta()
    kind, seed = args.kind, s.student.seed
    settings = dict(seed=seed, seq_len=s.router_seq_len, max_tokens=s.label_tokens(kind), epochs=s.router_epochs,
                    continuation=s.continuation, continuation_batch_size=s.continuation_rows,
                    target_share=s.target_large_share, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        texts = rollouts(pair, kind, meta["thresholds"][kind], tok, seed)
        print(f"rollouts: {len(texts)} answers, {sum(len(tok.encode(t)) for t in texts)} tokens", flush=True)
        own = train_router(kind, pair.small, pair.large, texts, Path(tmp) / "router-rollouts", **settings)
        own_meta = json.loads((own / "router.json").read_text())
        group = GroupConfig.from_dict(group_dict(pair.small, pair.large, {kind: own},
                                                 {kind: float(own_meta["threshold"])}, kind))
        cal = calibrate_group(group, chat_prompts(tok, calibration_problems(s)), s.search_settings(), log=print)
        print(cal.summary(), flush=True)
        variants = {"corpus text (served)": pair,
                    "own rollouts": with_router(pair, kind, own, cal.value, Path(tmp) / "pair-rollouts")}
        rows: list[tuple[str, str, SystemResult]] = []
        for task_name, problems, max_tokens in (("arith", args.arith_problems, 32),
                                                ("champ", args.champ_problems, 96)):
            for label, p in variants.items():
                results = evaluate(p, EvalSettings(task=task_name, problems=problems, max_tokens=max_tokens,
                                                   algorithms=(kind,), points=1), progress=False)
                for r in results:
                    if r.system in ("small", "large") and label != "own rollouts":
                        rows.append((task_name, "-", r))
                    elif r.system == kind:
                        rows.append((task_name, label, r))
    corpus_auc = json.loads((pair.routers[kind] / "router.json").read_text())["metrics"]["auc"]
    print(f"held-out AUC of the {kind} router: corpus labels {corpus_auc:.3f} (on corpus text), own rollouts "
          f"{own_meta['metrics']['auc']:.3f} (on rollout text)")
    print("| task | system | labels | threshold | large-token share | NLL under SmolLM2 | accuracy [95% CI] |")
    print("|---|---|---|---|---|---|---|")
    for task_name, label, r in rows:
        t = r.totals
        print(f"| {task_name} | {r.system} | {label} | {r.param or '-'} | {t.large_share:.3f} | {t.nll:.3f} | "
              f"{t.accuracy:.3f} [{t.accuracy_low:.3f}, {t.accuracy_high:.3f}] |")


if __name__ == "__main__":
    main()

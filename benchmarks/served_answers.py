"""The served pair's answers on the validation problems of operations nothing has seen, kept to compare
two commits paired: did a change to the engine change the answers, or the accuracy?

Question: after a change to the products or the head (numerics, not routing), are the routed default's
held-out answers the same, and is its accuracy unchanged within the paired interval?

Answers each validation problem of tokenrouter/training/arith_unseen.py in both wordings (greedy, 64
tokens, R2R at the served threshold, through RoutedLLM as `tokenrouter eval` does) and writes them to
--out; with --against (another run's file, e.g. from a `git worktree` of the other commit) prints per
wording both accuracies, the paired difference [95% bootstrap] with McNemar's p, the answers that are
token-identical, and each run's share of tokens on SmolLM2.

    .venv/bin/python benchmarks/served_answers.py --out bench_results/answers_new.json \\
        --against bench_results/answers_old.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--against", default=None, help="another run's --out, to compare paired")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from tokenrouter.training import arith, arith_unseen
    from tokenrouter.training.champ import chat_prompts
    from tokenrouter.training.evaluation.metrics import PairedDifference
    from tokenrouter.training.evaluation.run import algorithm_config, answer
    from tokenrouter.training.prepare import prepare, settings_for

    pair = prepare(settings_for(False), progress=False, threads=1)
    served = pair.meta()["thresholds"]["r2r"]
    tok = AutoTokenizer.from_pretrained(str(pair.large))
    torch.set_num_threads(os.cpu_count() or 1)
    specs = [{"name": "small", "path": str(pair.small)}, {"name": "large", "path": str(pair.large)}]
    runs = {}
    for reworded in (False, True):
        problems = arith_unseen.split(reworded=reworded).validation
        start = time.perf_counter()
        ans = answer(specs, algorithm_config("r2r", pair, served), chat_prompts(tok, problems), args.max_tokens,
                     progress=False)
        runs["reworded" if reworded else "arith"] = {
            "correct": [float(arith.number_match(t, p.answer)) for t, p in zip(ans.texts, problems)],
            "outputs": [list(o) for o in ans.outputs],
            "large_tokens": [sum(m == "large" for m in ms) for ms in ans.models],
            "seconds": time.perf_counter() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threshold": served, "max_tokens": args.max_tokens, "runs": runs}))
    other = None if args.against is None else json.loads(Path(args.against).read_text())["runs"]
    for wording, run in runs.items():
        share = sum(run["large_tokens"]) / max(1, sum(len(o) for o in run["outputs"]))
        line = (f"{wording}: {sum(run['correct']):.0f} of {len(run['correct'])} right, share {100 * share:.1f}%, "
                f"{run['seconds']:.1f} s")
        if other is not None:
            o = other[wording]
            d = PairedDifference.of(run["correct"], o["correct"])
            same = sum(a == b for a, b in zip(run["outputs"], o["outputs"]))
            o_share = sum(o["large_tokens"]) / max(1, sum(len(x) for x in o["outputs"]))
            line += (f"; against {args.against}: {sum(o['correct']):.0f} right, share {100 * o_share:.1f}%; "
                     f"this - that {100 * d.difference:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] "
                     f"p={d.mcnemar_p:.3g}; {same} answers token-identical")
        print(line, flush=True)


if __name__ == "__main__":
    main()

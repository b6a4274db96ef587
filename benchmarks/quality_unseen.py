"""Quality of the default pair on operations nothing has seen (tokenrouter/training/arith_unseen.py),
against baselines at the same share of SmolLM2 tokens, with paired statistics.

Question: how much of SmolLM2's accuracy does token-level routing keep, at what share of tokens on
SmolLM2, and is that more than routing tokens or whole requests at random, or requests by a router
trained on correctness, at the same share?

--part validation (the default; every choice is made on it) or test (read once, for the final
table), in both wordings. Every answer greedy, --max-tokens tokens, through RoutedLLM as `tokenrouter
eval` answers. Systems:
  large, small     each model alone
  r2r t=...        the pair's R2R router at each --thresholds value (default: the served one and two
                   either side in logit); the reference point: --reference, else the most accurate with
                   at most --max-share of its tokens on SmolLM2
  speculative      with --fly E...: the pair's `speculative` algorithm, --fly-draft-tokens drafts a run,
                   FLy's gate at each entropy threshold E (1: exact, SmolLM2's own answers)
  random tokens    bernoulli at p = the reference point's share (each position to SmolLM2 at random)
  random requests  whole requests to SmolLM2 at random, at the reference's token share: each
                   answer's expected score, from the single-model answers
  query            a query-level router trained on correctness: ridge regression from the small model's
                   mean prompt state to (SmolLM2 right) - (small right) on arith.split's 200 training
                   problems (both models answer them); the top requests to SmolLM2 up to the token share
Per system: accuracy [95% Wilson], share of tokens on SmolLM2, answers cut at the token cap; each
system against the reference: the paired difference [95% bootstrap], McNemar's exact p, and the
reference's accuracy as a share of SmolLM2's; the oracle: the share of positions in SmolLM2's right
answers where the small model's greedy token departs from SmolLM2's.

Writes OUT/PART_MAXTOKENS.json.

    .venv/bin/python benchmarks/quality_unseen.py --part validation --max-tokens 64 --fly 0.3 0.6 --out docs/eval/unseen
    .venv/bin/python benchmarks/quality_unseen.py --part test --max-tokens 64 --thresholds 0.1314 0.2913 \
        --reference 0.1314 --fly 0.3 --out docs/eval/unseen
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("validation", "test"), default="validation")
    ap.add_argument("--thresholds", type=float, nargs="*", default=None)
    ap.add_argument("--reference", type=float, default=None, help="the r2r threshold to compare against")
    ap.add_argument("--max-share", type=float, default=0.30)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--fly", type=float, nargs="*", default=[], help="speculative rows at these FLy thresholds")
    ap.add_argument("--fly-draft-tokens", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenrouter.training import arith, arith_unseen
    from tokenrouter.training.champ import chat_prompts
    from tokenrouter.training.evaluation.metrics import PairedDifference, forced, wilson
    from tokenrouter.training.evaluation.query_router import QueryRouter, prompt_features
    from tokenrouter.training.evaluation.run import algorithm_config, answer, threshold_grid
    from tokenrouter.training.prepare import prepare, settings_for

    pair = prepare(settings_for(False), progress=False, threads=1)
    served = pair.meta()["thresholds"]["r2r"]
    thresholds = args.thresholds or ([args.reference] if args.reference is not None
                                     else threshold_grid("r2r", served, 3, 1.0))
    tok = AutoTokenizer.from_pretrained(str(pair.large))
    torch.set_num_threads(os.cpu_count() or 1)
    small_model = AutoModelForCausalLM.from_pretrained(str(pair.small), dtype=torch.float32).eval()
    large_spec, small_spec = {"name": "large", "path": str(pair.large)}, {"name": "small", "path": str(pair.small)}

    def run(specs: list[dict[str, Any]], algorithm: dict[str, Any], prompts: list[list[int]], problems: list[Any]
            ) -> dict[str, Any]:
        ans = answer(specs, algorithm, prompts, args.max_tokens, progress=False)
        tokens = sum(len(o) for o in ans.outputs)
        return {"correct": [float(arith.number_match(t, p.answer)) for t, p in zip(ans.texts, problems)],
                "large_tokens": [sum(m == "large" for m in ms) for ms in ans.models],
                "tokens": [len(o) for o in ans.outputs], "outputs": ans.outputs,
                "share": sum(sum(m == "large" for m in ms) for ms in ans.models) / max(1, tokens),
                "truncated": sum(len(o) >= args.max_tokens for o in ans.outputs), "seconds": ans.seconds}

    # The correctness-trained query router: both models answer arith.split's training problems.
    train = list(arith.split(seed=0).train)
    train_prompts = chat_prompts(tok, train)
    print(f"{time.strftime('%H:%M:%S')} query router: both models on {len(train)} training problems", flush=True)
    t_large = run([large_spec], {"name": "single"}, train_prompts, train)
    t_small = run([small_spec], {"name": "single"}, train_prompts, train)
    gain = torch.tensor([a - b for a, b in zip(t_large["correct"], t_small["correct"])])
    router = QueryRouter().fit(prompt_features(small_model, train_prompts), gain)

    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "part": args.part, "served_threshold": served,
                              "args": vars(args), "wordings": {}}
    for reworded in (False, True):
        wording = "reworded" if reworded else "arith"
        problems = getattr(arith_unseen.split(reworded=reworded), args.part)
        prompts = chat_prompts(tok, problems)
        print(f"{time.strftime('%H:%M:%S')} {wording}: {len(problems)} {args.part} problems", flush=True)
        systems: dict[str, dict[str, Any]] = {"large": run([large_spec], {"name": "single"}, prompts, problems),
                                              "small": run([small_spec], {"name": "single"}, prompts, problems)}
        for t in thresholds:
            systems[f"r2r t={t:.4g}"] = run([small_spec, large_spec], algorithm_config("r2r", pair, t), prompts,
                                            problems)
        for e in args.fly:
            systems[f"speculative fly={e:g}"] = run(
                [small_spec, large_spec], {"name": "speculative", "draft_tokens": args.fly_draft_tokens,
                                           "fly_entropy_threshold": e}, prompts, problems)
        routed = [k for k in systems if k.startswith("r2r")]
        acc = {k: sum(v["correct"]) / len(problems) for k, v in systems.items()}
        if args.reference is not None:
            ref = f"r2r t={args.reference:.4g}"
        else:
            within = [k for k in routed if systems[k]["share"] <= args.max_share] or routed
            ref = max(within, key=lambda k: (acc[k], -systems[k]["share"]))
        share = systems[ref]["share"]
        systems["random tokens"] = run([small_spec, large_spec], {"name": "bernoulli", "p": share}, prompts, problems)
        large, small = systems["large"], systems["small"]
        big, little = sum(large["tokens"]), sum(small["tokens"])
        q = share * little / max(1e-9, big - share * big + share * little)  # request share giving that token share
        systems["random requests"] = {
            "correct": [q * a + (1 - q) * b for a, b in zip(large["correct"], small["correct"])],
            "share": share, "truncated": q * large["truncated"] + (1 - q) * small["truncated"]}
        order = torch.argsort(router.scores(prompt_features(small_model, prompts)), descending=True).tolist()
        best, chosen = None, set()
        for k in range(len(problems) + 1):
            picked = set(order[:k])
            lt = sum(large["tokens"][i] for i in picked)
            total = lt + sum(small["tokens"][i] for i in range(len(problems)) if i not in picked)
            gap = abs(lt / max(1, total) - share)
            if best is None or gap < best:
                best, chosen = gap, picked
        mixed = [large if i in chosen else small for i in range(len(problems))]
        lt = sum(m["tokens"][i] for i, m in enumerate(mixed) if m is large)
        systems["query"] = {"correct": [m["correct"][i] for i, m in enumerate(mixed)],
                            "share": lt / max(1, sum(m["tokens"][i] for i, m in enumerate(mixed))),
                            "truncated": sum(m["outputs"][i].__len__() >= args.max_tokens for i, m in enumerate(mixed))}
        # The oracle: where the small model's greedy token departs from SmolLM2's, in SmolLM2's right answers.
        right = [i for i, c in enumerate(large["correct"]) if c]
        greedy = forced(small_model, [prompts[i] for i in right], [large["outputs"][i] for i in right])
        critical = sum(sum(a != b for a, b in zip(f.greedy, large["outputs"][i])) for f, i in zip(greedy, right))
        rows = {}
        for name, v in systems.items():
            n_right = sum(v["correct"])
            low, high = wilson(round(n_right), len(problems))
            d = PairedDifference.of(systems[ref]["correct"], v["correct"]) if name != ref else None
            rows[name] = {"accuracy": n_right / len(problems), "wilson": [low, high], "share": v["share"],
                          "truncated": v["truncated"],
                          "reference_minus_this": None if d is None else d._asdict()}
        report["wordings"][wording] = {
            "problems": len(problems), "reference": ref, "systems": rows,
            "kept_of_large": acc[ref] / acc["large"] if acc["large"] else None,
            "oracle_share_in_right_answers": critical / max(1, sum(len(large["outputs"][i]) for i in right))}
        for name, row in rows.items():
            d = row["reference_minus_this"]
            print(f"  {name:>16}: {100 * row['accuracy']:5.1f}% [{100 * row['wilson'][0]:.1f}, "
                  f"{100 * row['wilson'][1]:.1f}]  share {100 * row['share']:5.1f}%  cut {row['truncated']:.0f}"
                  + ("" if d is None else f"  ref - this {100 * d['difference']:+.1f} [{100 * d['low']:+.1f}, "
                     f"{100 * d['high']:+.1f}] p={d['mcnemar_p']}"), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.part}_{args.max_tokens}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`tokenrouter eval`: what routing buys in quality and what it costs, on the held-out problems of a
task (evaluation/tasks.py: CHAMP, or generated arithmetic and word problems).

Systems, each answering every held-out problem greedily through the real runtime (RoutedLLM):
- the small model alone and the large model alone;
- the oracle router: it hands a position to the large model exactly where the small model's greedy
  token differs from the large model's on the same prefix, so it writes the large model's answers with
  the fewest large tokens there are (the bound of token-level routing on this pair; counted by
  teacher-forcing the small model on the large model's answers, not run);
- each token-level algorithm (CITER, R2R, Co-LLM, R-Stitch) at several thresholds, spread around
  the served (on-policy calibrated) one;
- query-level routing in the style of RouteLLM (evaluation/query_router.py) at several shares of
  requests, assembled from the two single-model runs (a routed request's answer is exactly that
  model's answer).
Each system gets: the share of output tokens written by the large model, the mean NLL of its output
under the large model, the agreement with the large model's greedy answer (common prefix over output
tokens), final-answer accuracy with its 95% Wilson interval, and for a routed system the precision and
recall of its hand-offs against the oracle's labels on its own prefixes (both models teacher-forced on
its answers). The results go to JSON, a Markdown table and a PNG plot of quality against cost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tokenrouter.routing import algorithm_class
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.training.champ import chat_prompts
from tokenrouter.training.evaluation.metrics import AnswerScore, OracleMatch, Totals, common_prefix, forced
from tokenrouter.training.evaluation.query_router import QueryRouter, gain_labels, prompt_features, route_top
from tokenrouter.training.evaluation.tasks import Task, task
from tokenrouter.training.operating_point import shifted
from tokenrouter.training.prepare import PreparedPair

TOKEN_LEVEL = ("citer", "r2r", "co_llm", "r_stitch")
R_STITCH_TAUS = (0.02, 0.05, 0.1, 0.2, 0.3)


@dataclass
class EvalSettings:
    task: str = "champ"  # evaluation/tasks.py
    problems: int | None = None  # held-out problems answered (default: all of the task's)
    max_tokens: int | None = None  # per answer; default the task's (arith 32, CHAMP 96)
    algorithms: tuple[str, ...] = TOKEN_LEVEL
    points: int = 5  # thresholds per algorithm
    spread: float = 2.0  # thresholds span the served one +- this much in logit
    query_train_problems: int = 120  # training problems that fit the query-level router
    reference_tokens: int = 128  # reference-solution tokens per problem for its labels
    query_shares: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
    seed: int = 0


class SystemResult(NamedTuple):
    system: str  # "small", "large", "oracle", "r2r", "query", ...
    param: str  # the threshold setting ("... (served)" for the pair's served one), "" for single models
    totals: Totals
    seconds: float
    oracle: OracleMatch | None = None  # a routed system's hand-offs against the oracle's labels


def threshold_grid(kind: str, calibrated: float | None, points: int, spread: float) -> list[float]:
    """Thresholds for a sweep: R-Stitch's fixed entropy taus, else the served threshold moved in
    logit space (scores are sigmoid outputs, so equal logit steps spread the routed share evenly); an
    odd number of points includes the served threshold itself."""
    if kind == "r_stitch":
        return list(R_STITCH_TAUS[:points])
    if calibrated is None:
        raise ValueError(f"{kind}: no calibrated threshold to sweep around")
    if points == 1:
        return [calibrated]
    return [shifted(calibrated, -spread + 2 * spread * i / (points - 1)) for i in range(points)]


def algorithm_config(kind: str, pair: PreparedPair, value: float) -> dict[str, Any]:
    """`kind` at `value` of its share knob, with the pair's router where it reads one."""
    cls = algorithm_class(kind)
    router = {"router": str(pair.routers[kind])} if cls.needs_router else {}
    return {"name": kind, **router, cls.knob_param(): value}


class Answers(NamedTuple):
    outputs: list[list[int]]
    models: list[list[str]]
    texts: list[str]
    seconds: float


def answer(models: list[dict[str, Any]], algorithm: dict[str, Any], prompts: list[list[int]], max_tokens: int,
           progress: bool) -> Answers:
    from tokenrouter.routed_llm import RoutedLLM

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with RoutedLLM({"name": "eval", "models": models, "algorithm": algorithm}) as llm:
        start = time.monotonic()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=progress)
        seconds = time.monotonic() - start
    c = [o.outputs[0] for o in outs]
    return Answers([x.token_ids for x in c], [x.token_models or [] for x in c], [x.text for x in c], seconds)


def score(ans: Answers, prompts: list[list[int]], large_greedy: list[list[int]], problems: Sequence[Any],
          large_model: Any, small_model: Any, t: Task) -> tuple[list[AnswerScore], OracleMatch]:
    under_large = forced(large_model, prompts, ans.outputs)
    under_small = forced(small_model, prompts, ans.outputs)
    scores = [AnswerScore(len(o), sum(m == "large" for m in ms), f.nll_sum, common_prefix(o, g),
                          t.correct(text, p.answer))
              for o, ms, f, g, text, p in zip(ans.outputs, ans.models, under_large, large_greedy, ans.texts, problems)]
    match = OracleMatch.of([[m == "large" for m in ms] for ms in ans.models], [f.greedy for f in under_small],
                           [f.greedy for f in under_large])
    return scores, match


def oracle_scores(large_ans: Answers, large_scores: list[AnswerScore], small_model: Any,
                  prompts: list[list[int]]) -> list[AnswerScore]:
    """The oracle router's answers are the large model's; it writes each position where the small
    model's greedy token on the large model's prefix is not the large model's token."""
    small_greedy = forced(small_model, prompts, large_ans.outputs)
    return [s._replace(large_tokens=sum(a != b for a, b in zip(f.greedy, o)))
            for s, f, o in zip(large_scores, small_greedy, large_ans.outputs)]


def fit_query_router(tokenizer: Any, small: Any, large: Any, s: EvalSettings) -> QueryRouter:
    train = list(task(s.task).split(s.seed)[0])[:s.query_train_problems]
    train = [p for p in train if p.solutions]
    prompts = chat_prompts(tokenizer, train)
    refs = [tokenizer.encode(p.solutions[0], add_special_tokens=False)[:s.reference_tokens] for p in train]
    return QueryRouter().fit(prompt_features(small, prompts), gain_labels(small, large, prompts, refs))


def evaluate(pair: PreparedPair, s: EvalSettings, progress: bool = True, log: Any = print) -> list[SystemResult]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = task(s.task)
    count = t.held_out if s.problems is None else s.problems
    if not 1 <= count <= t.held_out:
        raise ValueError(f"problems must be between 1 and {t.held_out} (the {t.name} task's held-out problems), "
                         f"got {s.problems}")
    unknown = sorted(set(s.algorithms) - set(TOKEN_LEVEL))
    if unknown:
        raise ValueError(f"unknown algorithms {unknown}; eval knows {', '.join(TOKEN_LEVEL)}")
    max_tokens = t.max_tokens if s.max_tokens is None else s.max_tokens
    tok = AutoTokenizer.from_pretrained(str(pair.large))
    problems = list(t.split(s.seed)[1])[:count]
    prompts = chat_prompts(tok, problems)
    small_spec = {"name": "small", "path": str(pair.small)}
    large_spec = {"name": "large", "path": str(pair.large)}
    large_model = AutoModelForCausalLM.from_pretrained(str(pair.large), dtype=torch.float32).eval()
    small_model = AutoModelForCausalLM.from_pretrained(str(pair.small), dtype=torch.float32).eval()

    results: list[SystemResult] = []
    log("answering with the large model alone")
    large_ans = answer([large_spec], {"name": "single"}, prompts, max_tokens, progress)
    log("answering with the small model alone")
    small_ans = answer([small_spec], {"name": "single"}, prompts, max_tokens, progress)
    # single-model runs name their one model "large"/"small" already, so token shares come out right
    large_scores, _ = score(large_ans, prompts, large_ans.outputs, problems, large_model, small_model, t)
    small_scores, _ = score(small_ans, prompts, large_ans.outputs, problems, large_model, small_model, t)
    results += [SystemResult("small", "", Totals.of(small_scores), small_ans.seconds),
                SystemResult("large", "", Totals.of(large_scores), large_ans.seconds),
                SystemResult("oracle", "", Totals.of(oracle_scores(large_ans, large_scores, small_model, prompts)),
                             0.0)]

    log("fitting the query-level router on training problems")
    router = fit_query_router(tok, small_model, large_model, s)
    q_scores = router.scores(prompt_features(small_model, prompts))
    for share in s.query_shares:
        mask = route_top(q_scores, share).tolist()
        mixed = [lg if m else sm for m, lg, sm in zip(mask, large_scores, small_scores)]
        results.append(SystemResult("query", f"share={share:g}", Totals.of(mixed), 0.0))

    served = pair.meta()["thresholds"]
    for kind in s.algorithms:
        for value in threshold_grid(kind, served.get(kind), s.points, s.spread):
            log(f"answering with {kind} at {value:.6g}")
            ans = answer([small_spec, large_spec], algorithm_config(kind, pair, value), prompts, max_tokens,
                         progress)
            scores, match = score(ans, prompts, large_ans.outputs, problems, large_model, small_model, t)
            mark = " (served)" if kind in served and value == served[kind] else ""
            results.append(SystemResult(kind, f"{value:.6g}{mark}", Totals.of(scores), ans.seconds, match))
    return results


def front_gap(r: SystemResult, results: Sequence[SystemResult]) -> float:
    """r's accuracy minus the query-level front's at r's large-token share (linear between the query
    points); positive: on this task r beats sending whole requests at the same cost."""
    import numpy as np

    front = sorted((q.totals.large_share, q.totals.accuracy) for q in results if q.system == "query")
    if not front:
        return float("nan")
    xs, ys = zip(*front)
    return r.totals.accuracy - float(np.interp(r.totals.large_share, xs, ys))


def gap_closed(r: SystemResult, small: Totals, large: Totals) -> float:
    gap = small.nll - large.nll
    return (small.nll - r.totals.nll) / gap if gap else float("nan")


def table(results: Sequence[SystemResult]) -> str:
    by = {r.system: r.totals for r in results if r.system in ("small", "large")}
    rows = ["| system | threshold | large-token share | NLL under large | NLL gap closed | agreement | accuracy |"
            " accuracy 95% CI | vs query front | oracle precision | oracle recall | answers | tokens | seconds |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r.totals
        closed = gap_closed(r, by["small"], by["large"]) if {"small", "large"} <= set(by) else float("nan")
        seconds = f"{r.seconds:.1f}" if r.seconds else "-"
        prec, rec = (f"{r.oracle.precision:.3f}", f"{r.oracle.recall:.3f}") if r.oracle else ("-", "-")
        vs_front = f"{front_gap(r, results):+.3f}" if r.oracle else "-"
        rows.append(f"| {r.system} | {r.param or '-'} | {t.large_share:.3f} | {t.nll:.3f} | {closed:.2f} | "
                    f"{t.agreement:.3f} | {t.accuracy:.3f} | [{t.accuracy_low:.3f}, {t.accuracy_high:.3f}] | "
                    f"{vs_front} | {prec} | {rec} | {t.answers} | {t.tokens} | {seconds} |")
    return "\n".join(rows)


def plot(results: Sequence[SystemResult], path: Path, title: str = "held-out CHAMP problems") -> None:
    """Quality against the large-token share: NLL, agreement, and accuracy with 95% Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    systems = list(dict.fromkeys(r.system for r in results if r.system not in ("small", "large", "oracle")))
    for ax, metric, label in ((axes[0], "nll", "mean NLL under the large model (lower is better)"),
                              (axes[1], "agreement", "agreement with the large model's greedy answer"),
                              (axes[2], "accuracy", "accuracy (bars: 95% Wilson interval)")):
        for name in systems:
            pts = sorted((r.totals for r in results if r.system == name), key=lambda t: t.large_share)
            xs, ys = [t.large_share for t in pts], [getattr(t, metric) for t in pts]
            style = "o-" if name != "query" else "s--"
            if metric == "accuracy":
                err = [[y - t.accuracy_low for y, t in zip(ys, pts)], [t.accuracy_high - y for y, t in zip(ys, pts)]]
                ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=name)
            else:
                ax.plot(xs, ys, style, label=name)
        for r in results:
            if r.system in ("small", "large", "oracle"):
                y = getattr(r.totals, metric)
                fmt = "kD" if r.system == "oracle" else "k*"
                if metric == "accuracy":
                    ax.errorbar([r.totals.large_share], [y], fmt=fmt, markersize=10, capsize=3,
                                yerr=[[y - r.totals.accuracy_low], [r.totals.accuracy_high - y]])
                else:
                    ax.plot(r.totals.large_share, y, fmt, markersize=10)
                ax.annotate(r.system, (r.totals.large_share, y), textcoords="offset points", xytext=(5, 5))
        ax.set_xlabel("share of output tokens written by the large model")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"token-level vs query-level routing on {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: Sequence[SystemResult], out: Path, settings: EvalSettings, pair: PreparedPair) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"system": r.system, "param": r.param, "seconds": r.seconds, **r.totals._asdict(),
             **({"oracle_precision": r.oracle.precision, "oracle_recall": r.oracle.recall, **r.oracle._asdict(),
                 "vs_query_front": front_gap(r, results)} if r.oracle else {})} for r in results]
    (out / "eval.json").write_text(json.dumps({"settings": settings.__dict__, "pair": str(pair.folder),
                                               "results": rows}, indent=1, default=list))
    (out / "eval.md").write_text(table(results) + "\n")
    plot(results, out / "quality_vs_cost.png", task(settings.task).title)

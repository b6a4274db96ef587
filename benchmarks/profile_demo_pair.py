"""Latency profiles of the default (demo) pair measured on this CPU, for the latency-model executor
and the planner: one with the models on separate cores, one with both on the same core.

- separate: each model's decode-step table and prefill cost, measured alone on its own core
  (small on core 0, large on core 1); interference 0.
- shared: the same tables, plus the interference of the large model on the small one, measured as
  how much the small model's batch-8 step stretches while a large-model decode loop runs on the same
  core: alpha = min(1, t_shared / t_alone - 1) (1 = the small model makes no progress while the
  large one runs, as when time-slicing halves its speed).

    python benchmarks/profile_demo_pair.py [--out-dir profiles] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tokenrouter.training.prepare import prepare

BATCHES = ["1", "2", "4", "8", "16"]


def profile(path: Path, name: str, core: int, out: Path, steps: int, notes: str) -> None:
    subprocess.run(["taskset", "-c", str(core), sys.executable, "-m", "tokenrouter.cli", "profile", "--model-path",
                    str(path), "--name", name, "--out", str(out), "--batch-sizes", *BATCHES, "--steps", str(steps),
                    "--notes", notes], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def small_step_while_large_runs(small: Path, large: Path, steps: int) -> float:
    """The small model's batch-8 decode step (seconds) on core 0 while the large one decodes there too."""
    load = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "tokenrouter.cli", "profile", "--model-path",
                             str(large), "--name", "large", "--out", "/tmp/tokenrouter-load.json", "--batch-sizes", "8",
                             "--steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(15)  # the large model loads and starts decoding
        tmp = Path("/tmp/tokenrouter-shared-small.json")
        tmp.unlink(missing_ok=True)
        profile(small, "small", 0, tmp, steps, "")
        return dict(map(tuple, json.loads(tmp.read_text())["models"]["small"]["table"]))[8]
    finally:
        load.kill()
        load.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="profiles")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    pair = prepare()
    out = Path(args.out_dir)
    sep = out / "demo_pair_cpu_separate.json"
    sep.unlink(missing_ok=True)
    when = time.strftime("%Y-%m-%d")
    notes = (f"default pair (student {pair.small.name}, SmolLM2-135M-Instruct) measured by "
             f"benchmarks/profile_demo_pair.py on {when}: 2-core AMD EPYC, no GPU, torch 2.13.0+cpu, one thread "
             "per model, small on core 0, large on core 1")
    profile(pair.small, "small", 0, sep, args.steps, notes)
    profile(pair.large, "large", 1, sep, args.steps, notes)
    prof = json.loads(sep.read_text())
    alone = dict(map(tuple, prof["models"]["small"]["table"]))[8]
    shared = small_step_while_large_runs(pair.small, pair.large, args.steps)
    alpha = min(1.0, max(0.0, shared / alone - 1))
    prof_shared = {**prof, "interference": {"small": {"large": round(alpha, 3)}},
                   "notes": prof["notes"] + f"; shared: the small model's batch-8 step is {alone * 1e3:.1f} ms alone "
                   f"and {shared * 1e3:.1f} ms on the same core as a decoding large model: interference "
                   f"{alpha:.2f}"}
    (out / "demo_pair_cpu_shared.json").write_text(json.dumps(prof_shared, indent=1))
    for name in ("small", "large"):
        print(name, {b: round(t * 1e3, 1) for b, t in prof["models"][name]["table"]}, "ms per decode step")
    print(f"shared core: small batch-8 step {alone * 1e3:.1f} -> {shared * 1e3:.1f} ms, interference {alpha:.2f}")
    print(f"written: {sep}, {out / 'demo_pair_cpu_shared.json'}")


if __name__ == "__main__":
    main()

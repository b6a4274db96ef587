"""The forms the screened head's screen can read, side by side on SmolLM2's head.

Question: at the row counts the quantized screen serves (1-16), how long do the screen's products take
on the bfloat16 pair panels (the skinny kernel, one thread), on the head as int8 per channel (torch's
int8 kernel, what a Q8_0 head took before block_gemm), and on the head's own Q8_0 blocks on
block_gemm (tokenrouter/models/block_gemm.c), on one thread and on two? And how tight is each
quantized form's bound (tokenrouter/models/quantized_linear.py `error_bound`), which decides how many
columns a step recomputes exactly?

The caches are flushed (a 256 MB write) before every call, as a decode step finds them after the
layers; best of --repeats. Prints ms per form and row count, and the bounds' median ratio.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/head_screen_forms.py
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from tokenrouter.models import block_gemm, quantized_linear, skinny_gemm
    from tokenrouter.models.config import ModelConfig
    from tokenrouter.models.gguf_weights import BlockWeight, read_gguf
    from tokenrouter.training.default_model import ensure_smollm2

    folder = ensure_smollm2(progress=False)
    source = read_gguf(folder / "model.gguf", ModelConfig.from_folder(folder))["model.embed_tokens.weight"]
    assert isinstance(source, BlockWeight) and source.kind == "Q8_0"
    weight = source.dequantize().contiguous()
    kernel, dots = skinny_gemm.load_kernel(), block_gemm.load_kernel()
    assert kernel is not None and dots is not None and dots.serves, "needs the skinny kernel and block_gemm on VNNI"
    pairs = skinny_gemm.pack_pairs(weight)
    int8 = quantized_linear.int8_per_channel(weight)
    blocks = block_gemm.pack(source)
    vocab = weight.shape[0]
    forms = {"pairs": lambda x: kernel.screen(x, pairs, vocab), "int8": lambda x: quantized_linear.linear(x, int8),
             "block_gemm": lambda x: quantized_linear.bounded_product(x, blocks)}
    flush = torch.ones(64 * 2 ** 20)
    print(f"SmolLM2's head, {vocab} x {weight.shape[1]} ({folder.name}), Q8_0 blocks")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
            best = {name: float("inf") for name in forms}
            for _ in range(args.repeats):
                for name, fn in forms.items():
                    flush.add_(1)
                    start = time.perf_counter()
                    fn(x)
                    best[name] = min(best[name], time.perf_counter() - start)
            times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items())
            ratio = min(best["pairs"], best["int8"]) / best["block_gemm"]
            print(f"  {threads} thread(s), {rows:2d} rows: {times}; block_gemm against the best other {ratio:.2f}x",
                  flush=True)
    tight = quantized_linear.error_bound(blocks, source, weight).columns
    loose = quantized_linear.error_bound(int8, None, weight).columns
    print(f"bound per column, block_gemm / int8 per channel: median {float((tight / loose).median()):.4f}")


if __name__ == "__main__":
    main()

"""Microbenchmark of the attention backends alone: one step's `plan` plus `forward` on every layer.

    OMP_NUM_THREADS=1 .venv/bin/python -m tokenrouter.models.attention.microbench
    OMP_NUM_THREADS=1 .venv/bin/python -m tokenrouter.models.attention.microbench --context 1000

Shapes default to a 30m Llama's decode steps (8 layers, 8 query / 4 KV heads of 64, page size 16, KV
pool of 64 x 272 tokens, batch 64). Pages are handed out in a random order, so each request's pages are
scattered over the pool, and every layer has its own pool slice, so K/V reads come from memory rather
than cache, as in the engine.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tokenrouter.models.attention.registry import BACKENDS, make_backend  # noqa: E402
from tokenrouter.models.forward_batch import ForwardBatch  # noqa: E402
from tokenrouter.models.kv_pool import KVPool  # noqa: E402


def make_batch(prefix: list[int], extend: list[int], pool: KVPool, gen: torch.Generator) -> ForwardBatch:
    p = pool.page_size
    need = [-(-(a + b) // p) for a, b in zip(prefix, extend)]
    order = torch.randperm(pool.num_pages, generator=gen).tolist()
    table = torch.zeros(len(need), max(need), dtype=torch.long)
    out_slots, at = [], 0
    for i, (a, b) in enumerate(zip(prefix, extend)):
        pages = order[at:at + need[i]]
        at += need[i]
        table[i, :len(pages)] = torch.tensor(pages)
        out_slots += [pages[pos // p] * p + pos % p for pos in range(a, a + b)]
    ext = torch.tensor(extend)
    return ForwardBatch(torch.zeros(len(out_slots), dtype=torch.long), torch.zeros(len(out_slots), dtype=torch.long),
                        torch.tensor(out_slots), table, torch.tensor(prefix), ext, torch.cumsum(ext, 0) - 1,
                        list(prefix), list(extend), p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=165, help="decode: mean cached tokens per request")
    ap.add_argument("--prefill", default="16x128", help="extend case: REQUESTSxTOKENS, prefix 0")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    b, ctx = args.batch, args.context
    # Contexts vary around the mean (as after requests of different lengths) so masks are needed.
    dec_prefix = [ctx - 7 + (i % 15) for i in range(b)]
    n_req, n_tok = (int(x) for x in args.prefill.split("x"))
    tokens = max(b * (ctx + 8 + 2 * args.page_size), n_req * (n_tok + args.page_size), 64 * 272)
    num_pages = -(-tokens // args.page_size)
    pool = KVPool(num_pages, args.page_size, args.layers, args.kv_heads, args.head_dim, torch.float32,
                  torch.device("cpu"))
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    cases = {
        f"decode b={b} ctx~{ctx}": make_batch(dec_prefix, [1] * b, pool, gen),
        f"prefill {args.prefill}": make_batch([0] * n_req, [n_tok] * n_req, pool, gen),
    }
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, pool {tuple(pool.k.shape)}")
    for case, batch in cases.items():
        t = batch.num_tokens
        qs = [torch.randn(t, h, d, generator=gen) for _ in range(args.layers)]
        kvs = [torch.randn(t, hkv, d, generator=gen) for _ in range(args.layers)]
        steps, outs, times = {}, {}, {}
        for name in args.backends.split(","):
            be = make_backend(name, pool, h, hkv, d)

            def step(be=be, batch=batch, qs=qs, kvs=kvs) -> list[torch.Tensor]:
                be.plan(batch)
                return [be.forward(layer, qs[layer], kvs[layer], kvs[layer]) for layer in range(args.layers)]

            steps[name], outs[name], times[name] = step, step(), []
        # Backends alternate step by step, so a busy machine slows them alike; the median is reported.
        for _ in range(args.iters):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
        results = {name: (sorted(ts)[len(ts) // 2] * 1e3, outs[name]) for name, ts in times.items()}
        base = results.get("torch-reference")
        for name, (ms, outs) in results.items():
            line = f"{case:24s} {name:16s} {ms:8.2f} ms/step ({args.layers} layers, median of {args.iters})"
            if base is not None and name != "torch-reference":
                err = max((a - c).abs().max().item() for a, c in zip(outs, base[1]))
                line += f"  {base[0] / ms:5.2f}x  max abs diff {err:.1e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()

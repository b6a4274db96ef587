"""Where decode attention's time goes on CPU, and the alternatives tried (one thread, float32).

SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads of 64, pages of 16), every layer its own
slice of a pool far larger than the caches, each request's pages scattered over it. For batch B
and context S:

1. the costs of the parts, K only, 30 layers: the backend's gather (256-byte rows, one per slot and
   KV head), the same bytes as whole pages and as per-head page blocks, a sequential read of as many
   bytes (the floor a kernel reading K once would approach), and baddbmm + softmax + bmm on
   already-gathered keys;
2. whole decode attention per step (`plan` + `forward` of 30 layers): the engine's backend
   (tokenrouter/models/attention/torch_backend.py), on its gather path and on its paged kernel
   (tokenrouter/models/attention/paged_decode.c), against page-granular gathers followed by one
   SDPA call, and followed by per-KV-head strided bmm; with --inductor also a torch.compile'd
   gather-and-reduce (dynamic shapes; compiles for about 20 s first).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_attention_costs.py [--inductor]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenrouter.models.attention.microbench import make_batch
from tokenrouter.models.attention.torch_backend import TorchAttentionBackend
from tokenrouter.models.kv_pool import KVPool

LAYERS, HEADS, KV_HEADS, DIM, PAGE = 30, 9, 3, 64, 16
CASES = ((1, 112), (8, 96), (32, 208))


def median_ms(fn: Callable[[], object], n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def parts(b: int, s: int, pool: KVPool, pages: torch.Tensor) -> None:
    k = pool.k
    slots = (pages[:, :, None] * PAGE + torch.arange(PAGE)).reshape(b, s)
    slot_idx = (slots[:, None, :] * KV_HEADS + torch.arange(KV_HEADS)[:, None]).reshape(-1)
    page_idx = pages.reshape(-1)
    gathered = k[0].view(-1, DIM).index_select(0, slot_idx).view(b * KV_HEADS, s, DIM)
    q = torch.randn(b * KV_HEADS, HEADS // KV_HEADS, DIM)
    cases = {
        "gather by slot and head (the backend's)": lambda: [k[i].view(-1, DIM).index_select(0, slot_idx)
                                                            for i in range(LAYERS)],
        "gather whole pages": lambda: [k[i].view(-1, PAGE * KV_HEADS * DIM).index_select(0, page_idx)
                                       for i in range(LAYERS)],
        "sequential read of as many bytes": lambda: [k[i, :b * s].sum() for i in range(LAYERS)],
        "baddbmm + softmax + bmm on gathered keys": lambda: [
            torch.bmm(torch.softmax(torch.bmm(q, gathered.transpose(1, 2)), -1), gathered) for _ in range(LAYERS)],
    }
    for name, fn in cases.items():
        print(f"  B={b:2d} S={s}: {name:42s} {min(median_ms(fn) for _ in range(3)):7.2f} ms (30 layers)", flush=True)


def page_views(pool: KVPool, layer: int, pages: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = PAGE * KV_HEADS * DIM
    keys = pool.k[layer].view(-1, width).index_select(0, pages.reshape(-1)).view(b, -1, KV_HEADS, DIM)
    values = pool.v[layer].view(-1, width).index_select(0, pages.reshape(-1)).view(b, -1, KV_HEADS, DIM)
    return keys, values


def page_sdpa(pool: KVPool, layer: int, q: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b = q.shape[0]
    keys, values = page_views(pool, layer, pages, b)
    o = F.scaled_dot_product_attention(q.view(b, HEADS, 1, DIM), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], scale=DIM ** -0.5, enable_gqa=True)
    return o.view(b, HEADS, DIM)


def page_bmm(pool: KVPool, layer: int, q: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b, g = q.shape[0], HEADS // KV_HEADS
    keys, values = page_views(pool, layer, pages, b)
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))[:, None, :]
    qv, out = q.view(b, KV_HEADS, g, DIM), torch.empty(b, KV_HEADS, g, DIM)
    for j in range(KV_HEADS):
        scores = torch.baddbmm(additive, qv[:, j], keys[:, :, j].transpose(1, 2), alpha=DIM ** -0.5)
        torch.bmm(torch.softmax(scores, -1), values[:, :, j], out=out[:, j])
    return out.view(b, HEADS, DIM)


def gather_reduce(q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, index: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    keys, values = kf[index], vf[index]  # [N, S, D], for inductor to fuse into the reductions
    scores = (q[:, :, None, :] * keys[:, None, :, :]).sum(-1) * DIM ** -0.5 + mask
    return (torch.softmax(scores, dim=-1)[..., None] * values[:, None, :, :]).sum(2)


def whole(b: int, s: int, pool: KVPool, gen: torch.Generator, inductor: bool) -> None:
    prefix = [s - 1 - (i % 15) for i in range(b)]
    batch = make_batch(prefix, [1] * b, pool, gen)
    n_pages = max(-(-(p + 1) // PAGE) for p in prefix)
    pages = batch.page_table[:, :n_pages]
    mask = torch.arange(n_pages * PAGE)[None, :] < (batch.prefix_lens + 1)[:, None]
    qs = [torch.randn(b, HEADS, DIM, generator=gen) for _ in range(LAYERS)]
    kvs = [torch.randn(b, KV_HEADS, DIM, generator=gen) for _ in range(LAYERS)]
    backend = TorchAttentionBackend(pool, HEADS, KV_HEADS, DIM, kernel=False)
    kernel = TorchAttentionBackend(pool, HEADS, KV_HEADS, DIM, kernel=True)

    def engine(be: TorchAttentionBackend = backend) -> list[torch.Tensor]:
        be.plan(batch)
        return [be.forward(i, qs[i], kvs[i], kvs[i]) for i in range(LAYERS)]

    variants: dict[str, Callable[[], list[torch.Tensor]]] = {
        "the backend's gather path": engine,
        "the backend's paged kernel": lambda: engine(kernel),
        "page gathers + one SDPA": lambda: [page_sdpa(pool, i, qs[i], pages, mask) for i in range(LAYERS)],
        "page gathers + strided bmm per KV head": lambda: [page_bmm(pool, i, qs[i], pages, mask)
                                                           for i in range(LAYERS)],
    }
    if inductor:
        compiled = torch.compile(gather_reduce, dynamic=True)
        slots = (pages[:, :, None] * PAGE + torch.arange(PAGE)).reshape(b, -1)
        index = (slots[:, None, :] * KV_HEADS + torch.arange(KV_HEADS)[:, None]).reshape(b * KV_HEADS, -1)
        additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
        additive = additive[:, None, :].expand(-1, KV_HEADS, -1).reshape(b * KV_HEADS, 1, -1)
        variants["torch.compile'd gather and reduce"] = lambda: [
            compiled(qs[i].view(b * KV_HEADS, -1, DIM), pool.k[i].view(-1, DIM), pool.v[i].view(-1, DIM), index,
                     additive).view(b, HEADS, DIM) for i in range(LAYERS)]
    reference = engine()  # writes this step's K/V, so every variant reads the same pool
    times: dict[str, list[float]] = {name: [] for name in variants}
    diffs = {}
    for _ in range(9):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            outs = fn()
            times[name].append(time.perf_counter() - t0)
            diffs[name] = max((a - r).abs().max().item() for a, r in zip(outs, reference))
    for name, ts in times.items():
        print(f"  B={b:2d} S~{s}: {name:40s} {sorted(ts)[4] * 1e3:7.2f} ms/step (median of 9; max abs diff "
              f"{diffs[name]:.1e})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inductor", action="store_true", help="also the torch.compile'd gather and reduce")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for b, s in CASES:
        gen = torch.Generator().manual_seed(0)
        num_pages = max(2000, b * s // PAGE + 64)
        pool = KVPool(num_pages, PAGE, LAYERS, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
        pool.k.normal_(generator=gen)
        pool.v.normal_(generator=gen)
        pages = torch.stack([torch.randperm(num_pages, generator=gen)[:s // PAGE] for _ in range(b)])
        print(f"batch {b}, context {s}: the parts", flush=True)
        parts(b, s, pool, pages)
        print(f"batch {b}, context ~{s}: whole decode attention", flush=True)
        whole(b, s, pool, gen, args.inductor)


if __name__ == "__main__":
    main()

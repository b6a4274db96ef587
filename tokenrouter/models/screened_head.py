"""The screened output head: a step's exact argmax and top-k logits without the float32 product of the
whole vocabulary, for float32 on CPU (the skinny kernel's three screen products, skinny_gemm.c).

Why: the output head is the widest product of a small model (the default student's 49,152 x 576 head
is 113 MB of its 156 MB a step), and greedy decoding and the routers that read the top-k logits
need only the few largest of its products. The screen reads a bfloat16 copy (half the bytes, two
multiply-adds an instruction lane with AVX512-BF16), bounds its error rigorously, and recomputes
exactly, in float32, only the columns the bound cannot rule out; those values are bit-identical to
the full head's (the same tile computes them), so the tokens and the top-k values do not change.

The bound. For a row x and column w (float32, k features), let e be the float32 head's value (an
ordered sum of k fused multiply-adds) and a the screen's (x and w rounded to bfloat16 to nearest,
unit roundoff u_b = 2^-8; their products exact in float32; k roundings of unit u = 2^-24). With
g = k u / (1 - k u) and s = sum_j |x_j w_j| <= ||x|| ||w|| (Cauchy-Schwarz):
    |e - x.w| <= g s,    |a - x.w| <= (2 u_b + u_b^2) s + g (1 + u_b)^2 s,
so |a - e| <= c ||x|| ||w|| with c = 2 u_b + u_b^2 + g ((1 + u_b)^2 + 1), taken 1e-6 larger to cover
the float64 arithmetic of the selection, plus an absolute term for the subnormal inputs, products and
sums AVX512-BF16 flushes to zero: a term is off by less than 2^-126 (2 + |x_j| + |w_j|)(1 + u_b), under
3 * 2^-126 (1 + max|x_j|)(1 + max|w_j|), so k times that covers the row.

The selection. Let b_j be column j's bound. The top-k-th largest of a_j - b_j is at most the exact
k-th largest logit, so a column whose a_j + b_j falls below it cannot be among the exact top k. The
union of the other columns over the rows (ascending) holds every row's exact top k and every index
of its largest logit; recomputed exactly, their top k is the full head's and their first maximum its
argmax (tests/test_screened_head.py).

The quantized screen. Where the head's weights come as GGUF blocks (or int8, models/quantized_linear.py),
the screen reads a quantized form instead: the blocks as stored on block_gemm where it serves the CPU
(a Q8_0 head a quarter of the float32 bytes, Q4 an eighth); elsewhere Q4 blocks on torch's int4
kernel, a Q8_0 head, or a float one, as int8 per channel on its int8 kernel. The exact columns are
still the float32 weights' (the file's values). Its bound is the kernel's (quantized_linear.ErrorBound,
against the exact product) plus the exact value's own g ||w_j||.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from tokenrouter.models import onednn_linear, quantized_linear, skinny_gemm
from tokenrouter.models.block_gemm import PackedBlocks
from tokenrouter.models.gguf_weights import BlockWeight

_UB, _U = 2.0 ** -8, 2.0 ** -24
MAX_ROWS = onednn_linear.MAX_EXACT_ROWS  # larger steps (prompt scoring, long catch-ups) take the full head
# The row count `fit_rows` times at load. Past the quantized kernel's rows the screen is the pair
# kernel's, on one thread, against the full head on oneDNN: on the EPYC the screen won 1.36x at 64 rows,
# on the 2-core Xeon with AMX it lost from 32 rows in every run (0.61-0.74x at 64; docs/BENCHMARKS.md,
# "The screened head"), so which wins is measured on the machine that serves.
FIT_ROWS = 32


class ScreenedTop(NamedTuple):
    """Per row: the argmax (the first index of the largest logit, as torch.argmax) and, when asked,
    the k largest exact logits (descending) and their token ids."""

    argmax: torch.Tensor
    values: torch.Tensor | None
    ids: torch.Tensor | None


class ScreenedHead:
    """Over a float32 head weight [vocab, k] (the model's own tensor, not copied) and its bfloat16 pair
    panels (built here, half its size; the skinny kernel's screen); `add_quantized` adds the head as
    the quantized kernel holds it, which then screens that kernel's row counts. Where `top(x, k)` is
    None the caller computes the full logits."""

    def __init__(self, weight: torch.Tensor, kernel: skinny_gemm.SkinnyGemm) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(f"the screened head takes a float32 [vocab, hidden] weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.weight = weight.detach()
        self.kernel = kernel
        self.norms = norms = torch.linalg.vector_norm(self.weight, dim=1, dtype=torch.float64)
        k = weight.shape[1]
        g = _gamma(k)
        self.pairs = skinny_gemm.pack_pairs(self.weight)
        low, high = torch.aminmax(self.weight)
        # per column: (2 u_b + u_b^2 + g ((1 + u_b)^2 + 1)) ||w_j||
        self.pair_bounds = _Bounds((2 * _UB + _UB ** 2 + g * ((1 + _UB) ** 2 + 1)) * (1 + 1e-6) * norms,
                                   _flushed(k, max(-float(low), float(high))))
        self.quantized: quantized_linear.QuantizedLinear | PackedBlocks | None = None
        self.quantized_bounds: _Bounds | None = None
        # Past this many columns to recompute (a flat row), the full head is cheaper.
        self.max_columns = max(weight.shape[0] // 8, 1)
        self.max_rows = MAX_ROWS  # the most rows a step screens (fit_rows)

    def add_quantized(self, quantized: quantized_linear.QuantizedLinear | PackedBlocks,
                      source: BlockWeight | None) -> None:
        """Screen the quantized kernel's row counts on `quantized`, the head as that kernel holds it
        (`source`: the GGUF blocks it was made from; None for int8 per channel)."""
        bound = quantized_linear.error_bound(quantized, source, self.weight)
        # the exact value's own error, g ||w_j||, on top of the kernel's against the exact product
        self.quantized = quantized
        self.quantized_bounds = _Bounds(bound.columns + _gamma(self.weight.shape[1]) * self.norms * (1 + 1e-6),
                                        bound.flushed)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the screen serves these rows (float32 on CPU, up to `max_rows` rows)."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and 1 <= x.shape[0] <= self.max_rows

    def fit_rows(self, full: Callable[[torch.Tensor], torch.Tensor], rounds: int = 3) -> int:
        """Time the screen's products against `full` (the model's full head) at FIT_ROWS rows on this
        thread count, best of `rounds` each; where the screen is not faster, steps of more than the
        quantized kernel's rows (quantized_linear.MAX_ROWS) take the full head. Returns `max_rows`."""
        x = torch.randn(FIT_ROWS, self.weight.shape[1], generator=torch.Generator().manual_seed(0))

        def best(fn: Callable[[], object]) -> float:
            fn()
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        screen = best(lambda: self.kernel.screen(x, self.pairs, self.weight.shape[0]))
        self.max_rows = MAX_ROWS if screen < best(lambda: full(x)) else quantized_linear.MAX_ROWS
        return self.max_rows

    def uses_quantized(self, x: torch.Tensor) -> bool:
        """Whether rows x take the quantized screen or the pairs: the quantized one on the quantized
        kernel's row counts; on torch's kernels only while the step runs on more than one thread (they
        spread over them; the pair screen runs on one). In SmolLM2's decode steps torch's int8 screen
        measured 11.6 against 13.8 ms a step at batch 1 on two threads, and no faster than the pairs
        on one (17.0-17.5 against 17.1-17.3 ms at batch 1, 26.8-27.5 against 25.8-26.2 at batch 4).
        block_gemm's screen of SmolLM2's Q8_0 head beat both at 1 to 16 rows on one thread and on two
        (benchmarks/head_screen_forms.py)."""
        if self.quantized is None or x.shape[0] > quantized_linear.MAX_ROWS:
            return False
        return isinstance(self.quantized, PackedBlocks) or torch.get_num_threads() > 1

    def approx(self, x: torch.Tensor) -> torch.Tensor:
        """The screen's products [rows, vocab], float32."""
        if self.uses_quantized(x):
            assert self.quantized is not None
            return quantized_linear.bounded_product(x, self.quantized)
        return self.kernel.screen(x, self.pairs, self.weight.shape[0])

    def bounds(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(scale per row, bound per column, offset): |approx[r, j] - exact[r, j]| <= scale[r] *
        column[j] + offset, exact being the float32 head's value."""
        b = self.quantized_bounds if self.uses_quantized(x) else self.pair_bounds
        assert b is not None
        # float64 norms as the bound's derivation takes them; the largest |x_j| is exact in float32
        return (torch.linalg.vector_norm(x, dim=1, dtype=torch.float64), b.columns,
                b.flushed * (1 + float(x.abs().max())))

    def columns(self, x: torch.Tensor, k: int, approx: torch.Tensor | None = None) -> torch.Tensor | None:
        """The columns (ascending) the screen cannot rule out of some row's k largest logits (k >= 1);
        `approx`: the screen's products of x where already computed."""
        scale, columns, offset = self.bounds(x)
        return self.kernel.select(self.approx(x) if approx is None else approx, k, scale, columns, offset)

    def top(self, x: torch.Tensor, k: int, exact: bool = True) -> ScreenedTop | None:
        """x [rows, hidden] float32: each row's argmax and, for k > 0, its k largest exact logits (k <= vocab;
        the ids of equal logits may come in another order than torch.topk's over the full row). None
        where a row is not finite or the screen leaves more than `max_columns` to recompute.

        `exact` False, for k > 1: the k columns the screen's products rank highest, with their exact
        logits, descending: a column within the screen's bound of the k-th largest logit may stand in
        for it. The argmax stays exact. Why: a wide k (R2R's 100) on the quantized screen leaves
        thousands of columns to recompute (6,000-14,000 of the default student's 49,152, more than
        `max_columns`, so the full head), where its features move the router's score by under 1e-5."""
        approx = self.approx(x)
        if not exact and k > 1:  # one C call: at one row the torch calls it replaces took 0.4 ms of 1.8
            scale, columns, offset = self.bounds(x)
            ranked = self.kernel.top_ranked(x, self.weight, approx, k, scale, columns, offset, self.max_columns)
            return None if ranked is None else ScreenedTop(*ranked)
        cols = self.columns(x, max(k, 1), approx)
        if cols is None or len(cols) > self.max_columns:
            return None
        products = self.kernel.gather(x, self.weight, cols)
        argmax = cols[products.argmax(dim=1)]
        if not k:
            return ScreenedTop(argmax, None, None)
        values, at = products.topk(k, dim=1)
        return ScreenedTop(argmax, values, cols[at])


class _Bounds(NamedTuple):
    columns: torch.Tensor  # float64 [vocab]: each column's factor of ||x||
    flushed: float  # the flushed-subnormal term, times (1 + max|x_j|)


def _flushed(terms: int, largest: float) -> float:
    """What flushing subnormal inputs, products and sums to zero can change in a sum of `terms`
    products whose weights are at most `largest` in magnitude, per unit of (1 + max|x_j|)."""
    return 3 * terms * 2.0 ** -126 * (1 + largest)


def _gamma(n: int) -> float:
    """The float32 summation factor of n terms, n u / (1 - n u)."""
    return n * _U / (1 - n * _U)

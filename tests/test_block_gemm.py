"""The GGUF block product on integer dot products (models/block_gemm.c, block_gemm.py): within its
stated bound of the exact product with the file's weights for every block type, row count and input
type; the plain C loop (any CPU) and the dot-product path give the same bits; a layer's blocks take it
where it serves the CPU (tests/test_quantized_linear.py: an engine's layers, and the rows they take)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import need_compiler

from tokenrouter.models import block_gemm, quantized_linear
from tokenrouter.models.block_gemm import PackedBlocks
from tokenrouter.models.gguf_weights import BLOCK, BlockWeight
from tokenrouter.models.native_build import load_library

KINDS = ("Q4_0", "Q4_1", "Q8_0")


def blocks(kind: str, n: int, k: int, seed: int) -> BlockWeight:
    """Random blocks with float16 scales (and Q4_1 minimums) of mixed sign and size across rows."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "Q8_0":
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    spread = torch.logspace(-3, 0, n)[:, None]
    d = ((torch.rand(n, k // BLOCK, generator=gen) - 0.3) * spread).half().float()
    m = ((torch.rand(n, k // BLOCK, generator=gen) - 0.5) * spread).half().float() if kind == "Q4_1" else None
    return BlockWeight(kind, codes, d, m)


def stated_bound(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """The kernel's error against x . w (exact): each input stands as two int8 codes on its block's
    scale dx = max |x_b| / 127, off by at most dx / 508 (the remainder's rounding) plus the float32
    rounding of x / dx (under 1e-4 dx), times the block's |d q| (Q4; Q8_0 |w|), summed over the blocks;
    plus the float32 arithmetic on top of the exact int32 sums (the scales' products, the blocks' sums
    of x, the sum over blocks): under 1e-5 of x's magnitudes times those of d q and m."""
    rows, k = x.shape
    dx = x.double().view(rows, k // BLOCK, BLOCK).abs().amax(dim=2) / 127
    scaled = (w.scales.double().repeat_interleave(BLOCK, dim=1) * w.codes.double()).abs()
    per_block = scaled.view(w.shape[0], k // BLOCK, BLOCK).sum(dim=2)
    offsets = 0 if w.mins is None else w.mins.double().abs().repeat_interleave(BLOCK, dim=1)
    return dx * (1 / 508 + 1e-4) @ per_block.T + 1e-5 * (x.double().abs() @ (scaled + offsets).T) + 1e-30


@pytest.fixture(scope="module")
def kernel() -> block_gemm.BlockGemm:
    need_compiler()
    k = block_gemm.load_kernel()
    assert k is not None
    return k


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_within_its_stated_bound(kernel, kind, rows, dtype):
    """Against the exact product with the file's weights (40 columns: a partial panel; 96 inputs):
    within the bound everywhere, and not trivially (the worst error is over a 64th of its bound);
    the bfloat16 output is the float32 one rounded to nearest even."""
    w = blocks(kind, 40, 96, seed=rows)
    packed = block_gemm.pack(w)
    x = (torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)) * torch.logspace(-1, 1, 96)).to(dtype)
    y = kernel(x, packed, torch.float32)
    assert y.shape == (rows, 40) and y.dtype == torch.float32
    exact = x.double() @ w.dequantize().double().T
    ratio = (y.double() - exact).abs() / stated_bound(x.float(), w)
    assert float(ratio.max()) <= 1
    assert float(ratio.max()) > 1 / 64
    assert torch.equal(kernel(x, packed, torch.bfloat16), y.to(torch.bfloat16))


def test_the_plain_loop_gives_the_dot_product_paths_bits(kernel):
    """The library built for a baseline x86-64 (no dot-product instructions: the plain C loop, the
    arithmetic in the same order) returns what the vectorised path returns, bit for bit."""
    if not kernel.serves:
        pytest.skip("this CPU has no AVX512-VNNI: the native build is the plain loop already")
    flags = tuple(f for f in block_gemm.COMPILE_FLAGS if f != "-march=native") + ("-march=x86-64",)
    lib = load_library(block_gemm.SOURCE, flags, "GGUF block GEMM (plain)", "test fails", block_gemm.LINK_FLAGS)
    assert lib is not None
    plain = block_gemm.BlockGemm(lib)
    assert not plain.serves
    for kind in KINDS:
        w = block_gemm.pack(blocks(kind, 40, 64, seed=3))  # a partial last panel
        x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(plain(x.to(dtype), w, dtype), kernel(x.to(dtype), w, dtype)), (kind, dtype)


def test_a_weight_or_type_it_cannot_take_is_refused(kernel):
    with pytest.raises(ValueError, match="block_gemm serves Q4_0, Q4_1, Q8_0 blocks, not Q5_0"):
        block_gemm.pack(BlockWeight("Q5_0", torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1)))
    w = block_gemm.pack(blocks("Q4_1", 16, 32, seed=0))
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float32 -> torch.float16"):
        kernel(torch.ones(1, 32), w, torch.float16)
    # Q4_0's m = -8 d past float16's range: the layer stays on torch's kernel
    big = BlockWeight("Q4_0", torch.zeros(16, 32, dtype=torch.uint8), torch.full((16, 1), 9000.0))
    assert not quantized_linear.on_block_gemm(big)


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_input_makes_its_row_nan(kernel, kind):
    """A NaN (or an infinity) among a row's inputs makes every output of that row NaN, as the float
    product's would be, the other rows untouched (Q8_0 has no float sum of the inputs to carry it)."""
    w = block_gemm.pack(blocks(kind, 40, 96, seed=2))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    clean = kernel(x, w, torch.float32)
    for bad in (float("nan"), float("inf")):
        x[1, 50] = bad
        y = kernel(x, w, torch.float32)
        assert y[1].isnan().all(), bad
        assert torch.equal(y[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("magnitude", [1e-40, 1e-37, 1e-30, 1.0, 1e30])
def test_the_bound_holds_for_rows_far_from_one(kernel, magnitude):
    """Rows of tiny (subnormal, or under float32's normal range once divided by 127) and huge inputs:
    the kernel scales each row by a power of two, so the stated bound holds at every magnitude."""
    w = blocks("Q8_0", 40, 96, seed=6)
    packed = block_gemm.pack(w)
    ref = w.dequantize()
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3)) * magnitude
    x[1, :32] *= 1e-3  # a block far below the row's largest input
    err = (quantized_linear.bounded_product(x, packed).double() - x.double() @ ref.double().T).abs()
    bound = quantized_linear.error_bound(packed, w, ref)
    limit = x.double().norm(dim=1)[:, None] * bound.columns[None] + bound.flushed * (1 + float(x.abs().max()))
    assert (err <= limit).all()


@pytest.mark.parametrize("kind", KINDS)
def test_layers_take_it_where_it_serves(kernel, kind):
    """`for_layer`: block_gemm's layout where the kernel serves this CPU, torch's int4 kernel's
    elsewhere; either way `linear` gives the product within the kernel's bound."""
    w = blocks(kind, 32, 64, seed=11)
    q = quantized_linear.for_layer(w)
    assert isinstance(q, PackedBlocks) == kernel.serves
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    y = quantized_linear.linear(x, q)
    exact = x.double() @ w.dequantize().double().T
    # torch's kernel rounds x to bfloat16 where block_gemm rounds it to int8: the looser bound serves
    slack = 2.0 ** -7 * (x.double().abs() @ w.dequantize().double().abs().T)
    assert ((y.double() - exact).abs() <= stated_bound(x, w) + slack).all()


def test_the_screens_bound_holds_where_the_remainders_lean(kernel):
    """quantized_linear.error_bound for block_gemm (the head's screen rests on it): inputs just under
    half a remainder unit above 1 in a block whose largest input is 127 (dx = 1) all round down by
    almost 1/508, against positive weights, so the errors add up: the product stays within the bound,
    and the error is over 3/4 of it (a bound with a smaller factor on the inputs' rounding fails)."""
    k, n = BLOCK, 16
    block = BlockWeight("Q8_0", torch.full((n, k), 127, dtype=torch.int8), torch.full((n, 1), 2.0 ** -7))
    packed = block_gemm.pack(block)
    x = torch.full((1, k), 1 + 0.998 / 508)
    x[0, 0] = 127.0
    ref = block.dequantize()
    err = (quantized_linear.bounded_product(x, packed).double() - x.double() @ ref.double().T).abs()
    bound = quantized_linear.error_bound(packed, block, ref)
    limit = x.double().norm(dim=1)[:, None] * bound.columns[None] + bound.flushed * (1 + float(x.abs().max()))
    assert (err <= limit).all()
    assert (err > 0.75 * limit).all()


@pytest.mark.parametrize("kind", KINDS)
def test_the_screens_bound_holds_on_random_blocks(kernel, kind):
    w = blocks(kind, 40, 96, seed=4)
    packed = block_gemm.pack(w)
    ref = w.dequantize()
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(9)) * torch.logspace(-2, 1, 96)
    err = (quantized_linear.bounded_product(x, packed).double() - x.double() @ ref.double().T).abs()
    bound = quantized_linear.error_bound(packed, w, ref)
    assert (err <= x.double().norm(dim=1)[:, None] * bound.columns[None] + bound.flushed).all()

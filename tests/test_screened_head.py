"""The screened head (models/screened_head.py, the skinny kernel's screen products): the bfloat16
screen within its stated bound, the exact columns bit-identical to the float32 head, the top-k
logits and the argmax equal to the full head's on near-ties and exact ties, and an engine's greedy
steps taking it with the tokens and routing signals they had on the full head (any request that
reads more than the argmax takes the full logits)."""

from __future__ import annotations

import time

import pytest
import torch
from engine_utils import need_compiler, prompts_of, skinny_kernel

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.logits_processing import processed
from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.models import native_build, onednn_linear, quantized_linear, skinny_gemm
from tokenrouter.models.screened_head import FIT_ROWS, MAX_ROWS, ScreenedHead
from tokenrouter.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="PyTorch built without oneDNN")


def near_ties(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose first 48 columns differ from one direction by less than bfloat16 resolves (so the
    screen cannot order them), columns 5 and 40 exactly equal (a true tie), and rows x along that
    direction (those columns hold every row's top logits)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.3
    w[:48] = base + torch.randn(48, k, generator=gen) * 1e-4
    w[40] = w[5]
    x = base + torch.randn(9, k, generator=gen) * 0.05
    return w.contiguous(), x.contiguous()


def bound_of(head: ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    """The screen's stated bound [rows, n] on |approx - exact| for rows x."""
    scale, columns, offset = head.bounds(x)
    return scale[:, None] * columns[None] + offset


@pytest.mark.parametrize("rows,k,n", [(1, 70, 300), (5, 64, 33), (9, 576, 500), (3, 1, 17)])
def test_screen_stays_within_its_bound(rows: int, k: int, n: int) -> None:
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(rows + k + n)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 4
    x = torch.randn(rows, k, generator=gen) * 3
    head = ScreenedHead(w, gemm)
    approx = gemm.screen(x, head.pairs, n)
    exact = gemm(x, skinny_gemm.pack(w), n, None)
    assert ((approx.double() - exact.double()).abs() <= bound_of(head, x)).all()
    # and it is the product of the bfloat16 roundings, to float32 summation error
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    summed = k * 2.0 ** -24 * (xb.abs() @ wb.abs().T)
    assert ((approx.double() - xb @ wb.T).abs() <= 1.01 * summed).all()


def test_screen_without_avx512_bf16_stays_within_its_bound() -> None:
    """The widening path CPUs without AVX512-BF16 take (built here with the instructions turned off):
    the same bound, the same products to float32 summation error."""
    need_compiler()
    lib = native_build.load_library(skinny_gemm.SOURCE, (*skinny_gemm.COMPILE_FLAGS, "-mno-avx512bf16"),
                                    "skinny GEMM without AVX512-BF16", "skipped")
    if lib is None:
        pytest.skip("the compiler takes no -mno-avx512bf16 (not x86)")
    widening, gemm = skinny_gemm.SkinnyGemm(lib), skinny_kernel()
    gen = torch.Generator().manual_seed(8)
    w, x = torch.randn(200, 77, generator=gen), torch.randn(6, 77, generator=gen) * 2
    head = ScreenedHead(w, gemm)
    approx = widening.screen(x, head.pairs, 200)
    exact = gemm(x, skinny_gemm.pack(w), 200, None)
    assert ((approx.double() - exact.double()).abs() <= bound_of(head, x)).all()
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    assert ((approx.double() - xb @ wb.T).abs() <= 1.01 * 77 * 2.0 ** -24 * (xb.abs() @ wb.abs().T)).all()


def test_gather_is_bit_identical_to_the_float32_head() -> None:
    gemm = skinny_kernel()
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(200, 96, generator=gen), torch.randn(13, 96, generator=gen)
    full = gemm(x, skinny_gemm.pack(w), 200, None)
    cols = torch.tensor([199, 0, 17, 17, 5] + list(range(30, 66)))  # any order, repeats, a ragged panel
    for r in (1, 4, 8, 13):
        assert torch.equal(gemm.gather(x[:r], w, cols), full[:r, cols]), r
    with pytest.raises(ValueError, match="outside"):
        gemm.gather(x, w, torch.tensor([200]))


def sorted_head(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random head with its columns in falling order of their logits for the first row."""
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=gen), torch.randn(6, k, generator=gen)
    return w[(w @ x[0]).argsort(descending=True)].contiguous(), x


@pytest.mark.parametrize("top", [0, 1, 7, 32])
@pytest.mark.parametrize("make", [near_ties, sorted_head])
def test_top_is_the_full_heads(top: int, make) -> None:
    """On columns the screen cannot tell apart (near_ties), and where the largest come first
    (sorted_head), the exact top-k values and the first argmax are the full head's (shrinking the
    bound below the screen's error makes this fail)."""
    gemm = skinny_kernel()
    w, x = make(4000, 96, seed=3)  # wide enough that no batch leaves more than 4000 // 8 to recompute
    full = gemm(x, skinny_gemm.pack(w), 4000, None)
    got = ScreenedHead(w, gemm).top(x, top)
    assert got is not None
    assert torch.equal(got.argmax, full.argmax(dim=1))
    if top:
        assert got.values is not None and got.ids is not None
        assert torch.equal(got.values, full.topk(top, dim=1).values)
        assert torch.equal(full.gather(1, got.ids), got.values)
    else:
        assert got.values is None and got.ids is None


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("make", [near_ties, sorted_head])
def test_ranked_top_has_the_screens_ranking_and_exact_logits(rows: int, make) -> None:
    """top(exact=False) (skinny_gemm.c skinny_top_ranked, one call): each row's k columns the screen
    ranks highest (as approx.topk's, up to which of equal screen values), their exact logits
    (bit-identical to the full head's) descending, and the argmax exact on near-ties; None where the
    recompute would pass max_columns or a row is not finite."""
    gemm = skinny_kernel()
    w, x = make(4000, 96, seed=8)
    x, k = x[:rows].clone(), 20
    head = ScreenedHead(w, gemm)
    full, approx = gemm(x, skinny_gemm.pack(w), 4000, None), head.approx(x)
    got = head.top(x, k, exact=False)
    assert got is not None and got.values is not None and got.ids is not None
    assert torch.equal(got.argmax, full.argmax(dim=1))
    assert torch.equal(approx.gather(1, got.ids).sort(dim=1).values, approx.topk(k, dim=1).values.sort(dim=1).values)
    assert all(len(set(row)) == k for row in got.ids.tolist())  # no column twice
    assert torch.equal(got.values, full.gather(1, got.ids))
    assert (got.values[:, :-1] >= got.values[:, 1:]).all()
    head.max_columns = k - 1  # fewer than the k ranked columns
    assert head.top(x, k, exact=False) is None
    head.max_columns = 4000
    x[-1, 3] = float("nan")
    assert head.top(x, k, exact=False) is None


def test_exact_ties_keep_the_first_index() -> None:
    gemm = skinny_kernel()
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    w[50] = w[9] = w[30] = w[9] * 3  # the largest logit of x = w[9], three times
    x = w[9:10].clone() / 3
    for exact in (True, False):  # exact=False: skinny_top_ranked's own argmax
        got = ScreenedHead(w.contiguous(), gemm).top(x, 3, exact=exact)
        assert got is not None and got.argmax.tolist() == [9]
        assert sorted(got.ids[0].tolist()) == [9, 30, 50]


def test_what_is_not_finite_goes_to_the_full_head() -> None:
    gemm = skinny_kernel()
    w, x = near_ties(1000, 32, seed=4)
    assert ScreenedHead(w, gemm).top(x, 4) is not None
    x[2, 3] = float("nan")
    assert ScreenedHead(w, gemm).top(x, 4) is None
    x[2, 3] = float("inf")
    assert ScreenedHead(w, gemm).top(x, 4) is None
    w, x = near_ties(1000, 32, seed=4)
    w[70, 1] = float("inf")
    assert ScreenedHead(w, gemm).top(x, 4) is None
    # finite inputs, one column's sum not finite (+inf and -inf products) where the rest are
    w = torch.randn(1000, 2, generator=torch.Generator().manual_seed(6))
    w[70] = torch.tensor([1e20, -1e20])
    x = torch.full((1, 2), 1e20)
    assert ScreenedHead(w, gemm).top(x, 4) is None


def test_a_flat_row_goes_to_the_full_head() -> None:
    """A row the screen cannot narrow (x = 0: every column ties) would recompute the whole head."""
    gemm = skinny_kernel()
    w, x = near_ties(800, 32, seed=5)  # a row of x alone leaves the 48 near-ties, under 800 // 8
    head = ScreenedHead(w, gemm)
    x[1] = 0.0
    assert head.top(x[:1], 3) is not None and head.top(x, 3) is None


def test_past_the_quantized_rows_the_screen_serves_only_where_it_measured_faster(model_paths, monkeypatch) -> None:
    """fit_rows times the screen's products against the full head at FIT_ROWS rows: against a full head
    that costs nothing the screen stops at the quantized kernel's rows, against a slow one it keeps
    MAX_ROWS. An engine whose steps sample more rows than the quantized kernel's fits its head at load."""
    head = ScreenedHead(near_ties(800, 32, seed=7)[0], skinny_kernel())
    rows = torch.zeros(FIT_ROWS, 32)
    assert head.takes(rows)
    assert head.fit_rows(lambda x: x) == quantized_linear.MAX_ROWS
    assert not head.takes(rows) and head.takes(rows[:quantized_linear.MAX_ROWS])

    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x

    assert head.fit_rows(slow) == MAX_ROWS and head.takes(rows)
    need_compiler()
    fitted = []
    monkeypatch.setattr(ScreenedHead, "fit_rows", lambda self, full: fitted.append(full) or MAX_ROWS)
    for running, times in ((quantized_linear.MAX_ROWS, 0), (FIT_ROWS, 1)):
        eng = Engine(EngineConfig(model_path=str(model_paths["llama"]), kv_cache_tokens=1024, page_size=4,
                                  device="cpu", linear_backend="skinny", max_running_requests=running))
        assert len(fitted) == times and (not times or fitted[0] == eng.model.compute_logits)


def run_steps(eng: Engine, params: list[SamplingParams]) -> list[StepOutput]:
    for i, p in enumerate(params):
        eng.add_request(prompts_of([6 + i], seed=i)[0], p)
    steps = []
    while eng.has_unfinished():
        out = eng.step().step
        if out is not None and out.reqs:
            steps.append(out)
    eng.check_integrity()
    return steps


def test_greedy_steps_take_the_screen_with_the_full_heads_results(model_paths, monkeypatch) -> None:
    """An engine on the skinny kernel (CPU default, one thread) builds the screen; its greedy steps take
    it and give the tokens and the top logits (R2R's signal) of the same engine without it. A step with
    a request that reads more than the argmax (logprobs, sampling, a logits rule) takes the full head."""
    need_compiler()
    spec = StepOutputSpec(hidden=True, top_logits=4)

    def engine() -> Engine:
        return Engine(EngineConfig(model_path=str(model_paths["llama"]), kv_cache_tokens=1024, page_size=4,
                                   device="cpu", linear_backend="skinny"), outputs=spec)

    greedy = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in range(5)]
    screened, full = engine(), engine()
    assert screened.model.lm_head_screened is not None
    full.model.lm_head_screened = None
    calls = []
    real_top = ScreenedHead.top
    monkeypatch.setattr(ScreenedHead, "top", lambda self, x, *a: calls.append(len(x)) or real_top(self, x, *a))
    a, b = run_steps(screened, greedy), run_steps(full, greedy)
    assert sum(calls) == sum(len(s.reqs) for s in a)  # every sampled row went through the screen
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for sa, sb in zip(a, b):
        assert sa.logits is None and sb.logits is None
        assert torch.equal(sa.top_logits[0], sb.top_logits[0]) and torch.equal(sa.top_logits[1], sb.top_logits[1])
    for extra in (dict(logprobs=1), dict(temperature=0.8, seed=3), dict(logit_bias={3: 2.0}),
                  dict(min_tokens=4), dict(repetition_penalty=1.3)):
        reqs = [screened.add_request(p, q) for p, q in zip(prompts_of([6, 7], seed=5), greedy)]
        special = screened.add_request(prompts_of([8], seed=6)[0],
                                       SamplingParams(max_tokens=4, ignore_eos=True, **{"temperature": 0.0, **extra}))
        with_special = 0
        while screened.has_unfinished():
            before = len(calls)
            out = screened.step().step
            if out is not None and special in out.reqs:
                with_special += 1
                assert len(calls) == before, extra  # the whole step on the full head
            elif out is not None and out.reqs:
                assert len(calls) == before + 1, extra
        assert with_special == 4 and all(r.num_output == 12 for r in reqs), extra
        screened.check_integrity()
    # A structured-output request reads the grammar's mask over the whole vocabulary.
    req = screened.add_request(prompts_of([5], seed=9)[0], greedy[0])
    assert not processed(req)
    req.grammar = object()  # any matcher: the predicate reads only its presence
    assert processed(req)
    screened.abort_all()

"""The default torch attention backend, with and without its paged kernel, matches the reference SDPA
backend on random paged batches."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_engine, need_compiler
from torch.profiler import ProfilerActivity, profile

from tokenrouter.models.attention import paged_decode_kernel
from tokenrouter.models.attention import torch_backend as tb
from tokenrouter.models.attention.reference_backend import ReferenceAttentionBackend
from tokenrouter.models.attention.registry import make_backend
from tokenrouter.models.attention.torch_backend import TorchAttentionBackend, sdpa_scope
from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.kv_pool import KVPool
from tokenrouter.sampling_params import SamplingParams

TOL = 1e-5
PAGE = 4
LAYERS = 2


def make_batch(prefix: list[int], extend: list[int], num_pages: int, gen: torch.Generator) -> ForwardBatch:
    """Requests get random, scattered pages; row t of request i writes its position's slot."""
    need = [-(-(p + e) // PAGE) for p, e in zip(prefix, extend)]
    order = torch.randperm(num_pages, generator=gen).tolist()
    assert sum(need) <= num_pages
    width = max(need)
    table = torch.zeros(len(need), width, dtype=torch.long)
    out_slots, positions = [], []
    at = 0
    for i, (p, e) in enumerate(zip(prefix, extend)):
        pages = order[at:at + need[i]]
        at += need[i]
        table[i, :len(pages)] = torch.tensor(pages)
        for pos in range(p, p + e):
            out_slots.append(pages[pos // PAGE] * PAGE + pos % PAGE)
            positions.append(pos)
    ext = torch.tensor(extend)
    return ForwardBatch(
        input_ids=torch.zeros(len(out_slots), dtype=torch.long),
        positions=torch.tensor(positions),
        out_slots=torch.tensor(out_slots),
        page_table=table,
        prefix_lens=torch.tensor(prefix),
        extend_lens=ext,
        sample_rows=torch.cumsum(ext, 0) - 1,
        prefix_lens_list=list(prefix),
        extend_lens_list=list(extend),
        page_size=PAGE,
    )


def run_both(prefix, extend, heads, kv_heads, head_dim=16, dtype=torch.float32, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(p + e) // PAGE) for p, e in zip(prefix, extend)) + 5
    pools = []
    slots = (num_pages + 1) * PAGE  # the pool's pages and its scratch page
    init_k = torch.randn(LAYERS, slots, kv_heads, head_dim, generator=gen).to(dtype)
    init_v = torch.randn(LAYERS, slots, kv_heads, head_dim, generator=gen).to(dtype)
    for _ in range(2):
        pool = KVPool(num_pages, PAGE, LAYERS, kv_heads, head_dim, dtype, torch.device("cpu"))
        pool.k.copy_(init_k)
        pool.v.copy_(init_v)
        pools.append(pool)
    ref = ReferenceAttentionBackend(pools[0], heads, kv_heads, head_dim)
    new = TorchAttentionBackend(pools[1], heads, kv_heads, head_dim, **kw)
    batch = make_batch(prefix, extend, num_pages, gen)
    t = batch.num_tokens
    ref.plan(batch)
    new.plan(batch)
    outs = []
    for layer in range(LAYERS):
        q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
        # v as the model passes it: a non-contiguous slice of a fused projection.
        v = torch.randn(t, kv_heads, 2 * head_dim, generator=gen).to(dtype)[:, :, :head_dim]
        outs.append((ref.forward(layer, q, k, v), new.forward(layer, q, k, v)))
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
    return outs


CASES = {
    "mixed": ([0, 7, 13, 0, 3, 21, 5], [1, 1, 1, 9, 6, 1, 4]),  # decodes, fresh and continued extends
    "decode_only": ([3, 17, 0, 9, 30], [1, 1, 1, 1, 1]),
    "decode_equal": ([12, 12, 12], [1, 1, 1]),
    "fresh_equal": ([0, 0, 0], [10, 10, 10]),
    "fresh_ragged": ([0, 0, 0, 0], [11, 3, 2, 16]),
    "continued_only": ([4, 9], [8, 3]),
    "one_long": ([0], [37]),
    "decode_and_fresh": ([6, 0, 15], [1, 12, 1]),
}


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 3)])
def test_matches_reference(case, heads, kv_heads, kernel):
    if kernel:
        need_compiler()
    prefix, extend = CASES[case]
    for ref, new in run_both(prefix, extend, heads, kv_heads, kernel=kernel):
        assert (ref - new).abs().max().item() <= TOL


@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_kernel_head_sizes_and_long_contexts(head_dim):
    """The kernel's unrolled head sizes (64, 128) and its general loop, over contexts of many pages."""
    need_compiler()
    prefix, extend = [0, 130, 61, 200, 15], [1, 1, 4, 1, 3]  # extends across page boundaries
    for ref, new in run_both(prefix, extend, 9, 3, head_dim=head_dim, seed=4, kernel=True):
        assert (ref - new).abs().max().item() <= TOL


def test_kernel_rows_do_not_depend_on_the_batch():
    """A query row's output is bit-identical whether it shares the kernel's call with others or not."""
    need_compiler()
    prefix, extend = [5, 40, 17], [1, 3, 1]
    gen = torch.Generator().manual_seed(6)
    pool = KVPool(40, PAGE, 1, 2, 16, torch.float32, torch.device("cpu"))
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    backend = TorchAttentionBackend(pool, 8, 2, 16, kernel=True)
    batch = make_batch(prefix, extend, 40, gen)
    q = torch.randn(batch.num_tokens, 8, 16, generator=gen)
    k = torch.randn(batch.num_tokens, 2, 16, generator=gen)
    v = torch.randn(batch.num_tokens, 2, 16, generator=gen)
    backend.plan(batch)
    full = backend.forward(0, q, k, v)
    for i in range(3):
        a = sum(extend[:i])
        rows = slice(a, a + extend[i])
        one = ForwardBatch(batch.input_ids[rows], batch.positions[rows], batch.out_slots[rows],
                           batch.page_table[i:i + 1], batch.prefix_lens[i:i + 1], batch.extend_lens[i:i + 1],
                           torch.tensor([extend[i] - 1]), [prefix[i]], [extend[i]], PAGE)
        backend.plan(one)
        assert torch.equal(backend.forward(0, q[rows], k[rows], v[rows]), full[rows])


def test_the_kernel_takes_longer_extends_only_over_few_keys():
    """Extends of up to KERNEL_MAX_EXTEND rows at any length, longer ones up to KERNEL_WIDE_EXTEND
    while extend x keys stays within KERNEL_MAX_PAIRS: a step wholly on the kernel has a kernel plan
    (the layer loop takes it); any other request leaves the step to the eager paths."""
    need_compiler()
    gen = torch.Generator().manual_seed(2)
    pool = KVPool(300, PAGE, 1, 2, 16, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(pool, 8, 2, 16, kernel=True)
    assert tb.KERNEL_MAX_EXTEND < 12 <= tb.KERNEL_WIDE_EXTEND and 12 * 400 > tb.KERNEL_MAX_PAIRS
    for prefix, extend, whole in [([900], [8], True), ([30], [12], True), ([0, 5], [16, 1], True),
                                  ([400], [12], False), ([0], [tb.KERNEL_WIDE_EXTEND + 1], False),
                                  ([30, 3], [12, 9], True), ([400, 3], [12, 1], False)]:
        backend.plan(make_batch(prefix, extend, 300, gen))
        assert (backend.kernel_plan() is not None) == whole, (prefix, extend)
    for ref, new in run_both([30, 0], [12, 16], 8, 2, seed=3, kernel=True):
        assert (ref - new).abs().max().item() <= TOL


def test_kernel_leaves_the_process_float_mode_alone():
    """Loading the -ffast-math library must not turn on flush-to-zero for the whole process."""
    need_compiler()
    assert paged_decode_kernel.load_kernel() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0 and (tiny + tiny).item() != 0.0


def test_without_a_compiler_the_gather_path_serves(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    paged_decode_kernel.load_kernel.cache_clear()
    try:
        pool = KVPool(8, PAGE, 1, 2, 16, torch.float32, torch.device("cpu"))
        assert TorchAttentionBackend(pool, 4, 2, 16).kernel is None
        assert "no C compiler" in caplog.text
        with pytest.raises(RuntimeError, match="could not be built"):
            TorchAttentionBackend(pool, 4, 2, 16, kernel=True)
    finally:
        paged_decode_kernel.load_kernel.cache_clear()
    bf16 = KVPool(8, PAGE, 1, 2, 16, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="float32 CPU pool"):
        TorchAttentionBackend(bf16, 4, 2, 16, kernel=True)


@pytest.mark.parametrize("kw", [dict(decode_chunk_bytes=1), dict(decode_chunk_bytes=3 * 22 * 16 * 4),
                                dict(bmm_decode=False)])
def test_decode_variants_match_reference(kw):
    """Chunks of one row, chunks of 3 rows (splitting a request's 2 KV heads), and the SDPA decode path
    (CUDA's), with the kernel off (it would take the decodes)."""
    kw = {**kw, "kernel": False}
    prefix, extend = CASES["mixed"]
    for ref, new in run_both(prefix, extend, 8, 2, seed=1, **kw):
        assert (ref - new).abs().max().item() <= TOL
    for ref, new in run_both(*CASES["decode_only"], 8, 2, seed=2, **kw):
        assert (ref - new).abs().max().item() <= TOL


def test_bfloat16_pool_close_to_reference():
    prefix, extend = CASES["mixed"]
    for ref, new in run_both(prefix, extend, 8, 2, dtype=torch.bfloat16, seed=3):
        assert new.dtype == torch.bfloat16
        assert (ref.float() - new.float()).abs().max().item() <= 2e-2


def test_make_backend_names():
    pool = KVPool(2, PAGE, 1, 2, 8, torch.float32, torch.device("cpu"))
    assert isinstance(make_backend("torch", pool, 4, 2, 8), TorchAttentionBackend)
    assert isinstance(make_backend("torch-reference", pool, 4, 2, 8), ReferenceAttentionBackend)
    with pytest.raises(ValueError):
        make_backend("nope", pool, 4, 2, 8)


def test_sdpa_off_the_cpu_leaves_out_cudnn():
    """cuDNN's SDPA builds a graph on the CPU for every new key length (9 ms a layer on an H200), so
    calls off the CPU may pick any backend but it; calls on the CPU keep torch's choice."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_scope(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with sdpa_scope(torch.device("cpu")):
            assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eager_steps_run_no_cudnn_attention(model_paths):
    """An eager decode and a catch-up extend on CUDA, profiled: no SDPA call went to cuDNN."""
    eng = make_engine(model_paths["llama"], device="cuda", disable_cuda_graph=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request(list(range(3, 40)), params)
    eng.step()  # the prefill
    eng.add_request(list(range(3, 40)) + [5, 6, 7], params)  # a cached prefix and three new tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            eng.step()
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not [n for n in names if "cudnn_attention" in n]

"""The decode step compiled per batch bucket: torch.compile (inductor) on CPU, CUDA graphs on CUDA.

It takes every batch whose requests all sample and whose new tokens fit the largest bucket: decodes,
and short extends (a catch-up after a peer model's turn, a short prompt), one row per new token. A
row attends its request's keys up to its own position, and every row's K/V is written before any
row attends, so an extend's later rows see its earlier ones (static_decode.py). The rows are padded
to the next bucket size (`batch_buckets`); padding rows write their K/V to the pool's scratch slot and
their outputs are dropped, as are the rows a request does not sample from. The step (model, logits
and the StepOutputSpec outputs) runs as one prepared callable over `DecodeInputs`
(tokenrouter/models/attention/static_decode.py):

- CPU: `torch.compile` (inductor) of one decoder layer, which every layer calls (its weights are
  graph inputs and its KV a tensor offset into the pool, see StaticDecodeAttention.enter_layer), and
  of the output head (logits and the StepOutputSpec outputs): a static-shape graph per bucket, the
  key length S marked dynamic (it grows every step). A batch dimension marked dynamic too (one graph
  for every bucket) was no faster (measured with float32 weights, 2026-12-02). Compiling the whole
  step instead unrolls every layer into one graph: for SmolLM2-135M (30 layers) that took 22 minutes
  for two buckets on a loaded 2-core machine.
- CUDA: one `torch.cuda.CUDAGraph` per (bucket, S rounded up to a power of two), all in one memory
  pool; the runner copies each step's inputs into the graph's static buffers and replays. The
  buckets at the shortest S are captured at start-up, longer ones when first needed.

Longer extends and batches with a request that does not sample (a prompt chunk) stay eager.
Inductor's cache lives under the project's cache folder, so a second start of the same model reuses
its kernels.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenrouter.cache_dir import cache_dir
from tokenrouter.engine.req import Req
from tokenrouter.engine.step_outputs import StepOutputSpec, StepTensors, step_tensors
from tokenrouter.models.attention.static_decode import DecodeInputs, StaticDecodeAttention, decode_inputs
from tokenrouter.models.kv_pool import KVPool
from tokenrouter.models.layers import Rope
from tokenrouter.models.llama import DecoderLayer, LayerCall, LlamaForCausalLM

logger = logging.getLogger(__name__)

CUDA_MIN_SEQ = 64  # the shortest key length a CUDA graph is captured for


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 32, of 16 to 64, of 32 beyond; the last is max_bs itself."""
    out, b = [], 1
    while b < max_bs:
        out.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 32 else 16 if b < 64 else 32)
    return out + [max_bs]


def inductor_cache_dir() -> Path:
    return cache_dir() / "inductor"


def _run_layer(layer: DecoderLayer, x: torch.Tensor, rope: Rope, attn: StaticDecodeAttention) -> torch.Tensor:
    return layer(x, rope, attn)


def _decode_step(model: LlamaForCausalLM, attn: StaticDecodeAttention, layer_fn: LayerCall,
                 head: Callable[[torch.Tensor], StepTensors], inputs: DecodeInputs) -> StepTensors:
    attn.bind(inputs)

    def run_layer(layer: DecoderLayer, x: torch.Tensor, rope: Rope, attn: StaticDecodeAttention) -> torch.Tensor:
        attn.enter_layer(layer.self_attn.layer)
        return layer_fn(layer, x, rope, attn)

    return head(model.forward_tokens(inputs.input_ids, inputs.positions, attn, run_layer))


class CompiledDecode:
    """Runs batches of up to `max_bs` new tokens whose requests all sample through the step prepared
    for their bucket, one row per new token."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, spec: StepOutputSpec, max_bs: int, max_seq: int) -> None:
        self.pool, self.device, self.num_kv_heads = pool, device, num_kv_heads
        self.buckets = batch_buckets(max_bs)
        self.max_bs = max_bs
        self.max_seq = max_seq
        self.attn = StaticDecodeAttention(pool, num_heads, num_kv_heads, head_dim)
        self.mask_dtype = self.attn.compute_dtype
        head = functools.partial(step_tensors, model, spec=spec)
        self.cuda = device.type == "cuda"
        if self.cuda:  # the graph captures the whole step
            self.step = functools.partial(_decode_step, model, self.attn, _run_layer, head)
            self.mem_pool = torch.cuda.graph_pool_handle()
            self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeInputs, StepTensors]] = {}
        else:
            # Inductor is imported here, not with the module: it takes 1.4 s, and every process that loads a
            # model would pay it while the compiled step is off on CPU (module docstring). Importing it
            # writes its /tmp default into the variable: only a value someone chose stays.
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
            # Each bucket compiles one layer graph (the layer's KV is a tensor offset, its weights are
            # graph inputs) and one head graph.
            limit = 2 * len(self.buckets) + 4
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 2 * limit)
            self.step = functools.partial(_decode_step, model, self.attn, torch.compile(_run_layer, dynamic=False),
                                          torch.compile(head, dynamic=False))

    def accepts(self, reqs: list[Req], extend_lens: list[int]) -> bool:
        """Every request samples after its extend (no prompt chunk), none wants prompt logprobs (the
        eager step's hidden rows give those), and the new tokens fit the largest bucket."""
        return sum(extend_lens) <= self.max_bs and all(
            r.kv_len + e == len(r.tokens) and not r.wants_prompt_logprobs for r, e in zip(reqs, extend_lens))

    def _seq(self, seq: int) -> int:
        """The key length a step runs at: exact on CPU (a dynamic dimension), bucketed for CUDA graphs."""
        if not self.cuda:
            return seq
        return min(max(CUDA_MIN_SEQ, 1 << (seq - 1).bit_length()), max(self.max_seq, seq))

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (CPU) or capture (CUDA) every bucket; returns the seconds it took."""
        t0 = time.perf_counter()
        for bs in self.buckets:
            self._run(decode_inputs(self.pool, self.num_kv_heads, [], [], [], bs, self._seq(2), self.mask_dtype), 0)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def run(self, reqs: list[Req], extend_lens: list[int]) -> StepTensors:
        """Outputs of each request's last row (the one it samples from), in order; for a request
        verifying drafts, of its last drafts + 1 rows (ModelRunner.build_batch's sample rows)."""
        tokens: list[int] = []
        kv: list[int] = []
        pages: list[list[int]] = []
        for r, e in zip(reqs, extend_lens):
            tokens += r.tokens[r.kv_len:r.kv_len + e]
            kv += range(r.kv_len, r.kv_len + e)
            pages += [r.pages] * e
        bs = next(b for b in self.buckets if b >= len(tokens))
        inputs = decode_inputs(self.pool, self.num_kv_heads, tokens, kv, pages, bs, self._seq(max(kv) + 1),
                               self.mask_dtype)
        if len(tokens) == len(reqs):  # all decodes: the first rows
            return self._run(inputs, len(reqs))
        ends = list(itertools.accumulate(extend_lens))
        rows = [i for r, end in zip(reqs, ends) for i in range(end - 1 - r.drafts, end)]
        # queued behind the step's inputs, so the host does not wait for the step
        return self._run(inputs, torch.tensor(rows).to(self.device, non_blocking=True))

    def _run(self, inputs: DecodeInputs, rows: int | torch.Tensor) -> StepTensors:
        """The step's outputs at `rows`: the first `rows` rows, or the rows an index names."""
        if not self.cuda:
            # S (the last dim of the index and mask) changes every step: one graph serves all of them.
            torch._dynamo.maybe_mark_dynamic(inputs.kv_index, 1)
            torch._dynamo.maybe_mark_dynamic(inputs.kv_mask, 2)
            out = self.step(inputs)
            return out.head(rows) if isinstance(rows, int) else out.rows(rows)
        key = (inputs.input_ids.shape[0], inputs.kv_mask.shape[2])
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        graph, static, out = self.graphs[key]
        for dst, src in zip(static, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        if isinstance(rows, int):
            # A graph's outputs are overwritten by its next replay: hand out copies.
            return StepTensors(*(None if t is None else _clone(t) for t in out.head(rows)))
        return out.rows(rows)  # indexing copies already

    def _capture(self, inputs: DecodeInputs) -> tuple[torch.cuda.CUDAGraph, DecodeInputs, StepTensors]:
        static = DecodeInputs(*(t.to(self.device) for t in inputs))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up run off the capture (lazy inits, autotuning)
            self.step(static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mem_pool):
            out = self.step(static)
        return graph, static, out


def _clone(t: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return tuple(x.clone() for x in t) if isinstance(t, tuple) else t.clone()

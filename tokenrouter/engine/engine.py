"""The single-model engine: requests in, schedule -> forward -> commit, finished requests out."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from tokenrouter.engine.compiled_step import CompiledDecode
from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.grammar import GrammarCompiler, GrammarViolation, check_structured_output
from tokenrouter.engine.latency_model import LatencyModelRunner
from tokenrouter.engine.model_loader import load_model, quantize
from tokenrouter.engine.model_runner import ModelRunner, StepOutput, StepOutputSpec
from tokenrouter.engine.radix_cache import RadixCache
from tokenrouter.engine.req import LooseVerify, Req, ReqStatus
from tokenrouter.engine.request_validation import validate_prompt
from tokenrouter.engine.scheduler import LaunchPolicy, Scheduler, SchedulerConfig
from tokenrouter.engine.step_board import CoreShare
from tokenrouter.engine.step_trace import StepTraceWriter
from tokenrouter.engine.stop_strings import output_stop
from tokenrouter.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from tokenrouter.engine.tp_worker import TensorParallel, TPWorkerError
from tokenrouter.models import fused_ops, onednn_linear, skinny_gemm
from tokenrouter.models.attention.registry import make_backend
from tokenrouter.models.config import ModelConfig
from tokenrouter.models.gguf_weights import GGUF_FILE
from tokenrouter.models.kv_pool import KVPool, available_memory_bytes
from tokenrouter.models.tp_group import check_tp_divisible
from tokenrouter.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _on_every_rank(tp: TensorParallel | None, stage: str, make: Callable[[], T]) -> T:
    """Run rank 0's part of a start-up stage. With workers, every rank reports on the stage and a
    failure anywhere stops them all (TensorParallel.sync raises); alone, an error propagates as is."""
    if tp is None:
        return make()
    try:
        result = make()
    except Exception as e:
        tp.sync(stage, e)
        raise
    tp.sync(stage)
    return result


@dataclass
class EngineStats:
    steps: int = 0
    extended_tokens: int = 0  # tokens run through the model
    sampled_tokens: int = 0  # samples handed to the caller: a step's rows, and look-ahead rows when answered
    finished: int = 0
    look_aheads: int = 0  # rows run ahead for a request at a peer (Engine.hand_off)
    look_ahead_hits: int = 0  # of those, the ones taken when the request came back
    drafts_verified: int = 0  # peers' drafts this model's steps verified (Req.drafts)
    drafts_accepted: int = 0  # of those, the ones its own samples agreed with


class StepFailed(RuntimeError):
    """A step failed on some of its requests. Those are finished (reason "error", pages freed); the
    rest of the batch keeps its place and runs again at the next step (uncommitted KV is rewritten).
    None are, when the step's look-ahead rows, given up, may have been what broke it."""

    def __init__(self, failed: list[Req], cause: BaseException) -> None:
        super().__init__(f"the step failed on {len(failed)} request(s): {type(cause).__name__}: {cause}")
        self.failed = failed


class StepResult(NamedTuple):
    updated: list[Req]  # requests that got a token this step
    finished: list[Req]
    step: StepOutput | None


class Engine:
    """One model, its KV pool, prefix cache, scheduler and runner; no I/O.

    Requests are validated on `add_request`, so a bad request raises there and never reaches the
    scheduler: the engine keeps serving the others.
    """

    def __init__(self, cfg: EngineConfig, launch: LaunchPolicy | None = None,
                 outputs: StepOutputSpec = StepOutputSpec(), latency_runner: LatencyModelRunner | None = None,
                 trace_index: int | None = None, cores: CoreShare | None = None) -> None:
        """`latency_runner` replaces the model (the latency-model executor): no weights are loaded and
        the KV pool only keeps page accounting. `trace_index`: the model's index in its group; with
        TOKENROUTER_STEP_TRACE set, each step is then traced as the latency executor traces its own
        (engine/step_trace.py), so a group of real models gives the same per-step trace. `cores`:
        sizes each step's torch threads (step_board.py; the subserver's, on a shared CPU host);
        without it steps run on cfg.num_threads."""
        self.cfg = cfg
        self.cores = cores
        # the latency executor writes its own step lines (inside its sleep), real models are traced here
        self.trace_index = trace_index
        self.trace = StepTraceWriter(None) if trace_index is None or latency_runner is not None \
            else StepTraceWriter.from_env()
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.device = cfg.torch_device()
        self.dtype = cfg.torch_dtype(self.device)
        self.model_config = ModelConfig.from_folder(cfg.model_path)
        if latency_runner is not None and outputs != StepOutputSpec():
            raise ValueError("the latency-model executor computes no hidden states, logits or entropy; "
                             "use an algorithm that needs none (single, bernoulli, ensemble)")
        mc = self.model_config
        # Tensor parallelism: rank 0 (this process) schedules and samples; the workers run the model.
        self.tp: TensorParallel | None = None
        self.tp_size = cfg.tp_size if latency_runner is None else 1  # the latency executor runs no model
        check_tp_divisible(mc, self.tp_size, repr(cfg.model_path))
        if self.tp_size > 1:
            self.tp = TensorParallel(cfg, self.device)
            self._finalizer = weakref.finalize(self, self.tp.shutdown)
        try:
            self._build(cfg, mc, launch, outputs, latency_runner)
        except BaseException:
            if self.tp is not None:
                self.tp.kill()
            raise
        self.reqs: dict[str, Req] = {}
        self.ahead: dict[str, StepOutput] = {}  # rid -> the row a look-ahead set aside (hand_off)
        self._grammars: GrammarCompiler | None = None  # built at the first structured-output request
        self._seed_rng = random.Random(cfg.seed)
        self._next_rid = 0
        self.stats = EngineStats()

    def _build(self, cfg: EngineConfig, mc: ModelConfig, launch: LaunchPolicy | None, outputs: StepOutputSpec,
               latency_runner: LatencyModelRunner | None) -> None:
        tp = self.tp
        self.model = None
        self.quantization = "none"  # what the model's products serve (model_loader.quantize)
        if latency_runner is None:
            self.model = _on_every_rank(tp, "loading its weights", lambda: load_model(
                cfg.model_path, self.dtype, self.device, tp.group if tp else None))
            if cfg.packs_linears(self.device, self.dtype, onednn_linear.available()):
                skinny = skinny_gemm.load_kernel() if cfg.uses_skinny() else None
                if skinny is None and cfg.linear_backend == "skinny":
                    raise RuntimeError("linear_backend skinny: the skinny GEMM could not be built (see the log)")
                self.model.pack_linear_weights(max(cfg.chunked_prefill_size, cfg.max_running_requests),
                                               cfg.max_running_requests, skinny)
                ops = fused_ops.load_kernel() if skinny is not None else None
                if ops is not None:
                    self.model.use_fused_ops(ops)
                self.quantization = quantize(self.model, cfg.model_path, cfg.quantization)
            elif cfg.quantization == "int8":
                raise ValueError("quantization int8 needs packed linears: float32 on CPU, tp_size 1, eager decode "
                                 "steps and a PyTorch built with oneDNN")
            elif (Path(cfg.model_path) / GGUF_FILE).is_file() and cfg.quantization == "auto":
                logger.info("%s: its %s blocks are served as float weights here (the quantized kernels take float32 "
                            "on CPU, one rank, eager decode)", cfg.model_path, GGUF_FILE)
            if self.quantization != "none":
                logger.info("%s: quantized products: %s", cfg.model_path, self.quantization)
        self.tokenizer = load_tokenizer(cfg.model_path) if cfg.load_tokenizer else None
        self.eos_token_ids = set(mc.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        num_pages = self._kv_pages(mc)
        n = self.tp_size
        if latency_runner is None:
            if tp is not None:
                tp.broadcast_int(num_pages)
            # each rank's pool holds its own KV heads
            self.pool = _on_every_rank(tp, "allocating its KV pool", lambda: KVPool(
                num_pages, cfg.page_size, mc.num_layers, mc.num_kv_heads // n, mc.head_dim, self.dtype, self.device))
            if tp is not None:
                tp.serving = True
        else:  # pages are only counted: one float per slot
            self.pool = KVPool(num_pages, cfg.page_size, 1, 1, 1, torch.float32, torch.device("cpu"))
        context = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if context > self.pool.capacity_tokens:
            logger.warning("context length %d capped to the KV pool's %d tokens", context, self.pool.capacity_tokens)
            context = self.pool.capacity_tokens
        self.max_model_len = context
        self.cache = RadixCache(self.pool, enabled=cfg.enable_prefix_cache)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.page_size, cfg.max_running_requests, cfg.chunked_prefill_size),
            self.pool, self.cache, launch)
        self.runner: ModelRunner | LatencyModelRunner
        if latency_runner is not None:
            self.runner = latency_runner
        else:
            assert self.model is not None
            backend = make_backend(cfg.attention_backend, self.pool, mc.num_heads // n, mc.num_kv_heads // n,
                                   mc.head_dim)
            self.runner = ModelRunner(self.model, self.pool, backend, self.device, outputs,
                                      tp.group if tp is not None else None, frozenset(self.eos_token_ids),
                                      self._compiled_decode(mc, outputs))

    def _compiled_decode(self, mc: ModelConfig, outputs: StepOutputSpec) -> CompiledDecode | None:
        """The compiled decode step, warmed up (compiled or captured) for every batch bucket."""
        cfg = self.cfg
        if not cfg.compiles_decode(self.device) or self.tp is not None:
            return None
        assert self.model is not None
        max_bs = min(cfg.cuda_graph_max_bs or cfg.max_running_requests, cfg.max_running_requests)
        decode = CompiledDecode(self.model, self.pool, mc.num_heads, mc.num_kv_heads, mc.head_dim, self.device,
                                outputs, max_bs, self.max_model_len)
        seconds = decode.warm_up()
        logger.info("%s: decode step %s for batch sizes %s in %.1f s", cfg.model_path,
                       "captured" if self.device.type == "cuda" else "compiled", decode.buckets, seconds)
        return decode

    def _kv_pages(self, mc: ModelConfig) -> int:
        cfg = self.cfg
        # Under TP each rank's pool holds num_kv_heads / tp heads; on CPU the ranks share host memory,
        # so the budget is for all of them together.
        kv_heads = mc.num_kv_heads // self.tp_size if self.device.type == "cuda" else mc.num_kv_heads
        per_token = KVPool.bytes_per_token(mc.num_layers, kv_heads, mc.head_dim, self.dtype)
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
        else:
            frac = cfg.mem_fraction or (0.8 if self.device.type == "cuda" else 0.2)
            tokens = int(available_memory_bytes(self.device) * frac) // per_token
            if cfg.mem_fraction is None:
                # Without an explicit budget, no need for more than every slot at full context.
                context = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
                tokens = min(tokens, cfg.max_running_requests * context)
        return max(1, math.ceil(tokens / cfg.page_size))

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was started without a tokenizer: pass token ids, not text")
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request; touches no state."""
        params.validate()
        validate_prompt(prompt_ids, self.model_config.vocab_size, self.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        params.check_vocab(self.model_config.vocab_size)
        if self.model is None and (params.prompt_logprobs is not None or params.structured_output is not None):
            raise ValueError("the latency-model executor computes no logits: no prompt_logprobs or structured output")
        if params.prompt_logprobs is not None and self.tp is not None:
            raise ValueError("prompt_logprobs are not supported with tensor parallelism")
        if params.structured_output is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer")
            check_structured_output(params.structured_output)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                    detokenize: bool = False, seed: int | None = None, prompt_len: int | None = None,
                    drafts: int = 0, loose: LooseVerify | None = None) -> Req:
        """Validate and queue a request. `detokenize` keeps `req.text` current at every token
        (streaming); requests with stop strings are always detokenized. A request arriving from a peer
        brings its seed and, when output was already written, its prompt length, and may end in
        `drafts` for this model to verify (Req.drafts) by the rule `loose` (None: exactly)."""
        self.validate(prompt_ids, params)
        if rid is None:
            rid = f"req-{self._next_rid}"
            self._next_rid += 1
        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        if detokenize and self.tokenizer is None:
            raise ValueError("text output needs a tokenizer")
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        n_prompt = len(prompt_ids) if prompt_len is None else prompt_len
        req = Req(rid=rid, tokens=list(prompt_ids), prompt_len=n_prompt, params=params, seed=seed)
        self._check_drafts(req, drafts, len(prompt_ids) - n_prompt)
        req.drafts, req.loose = drafts, loose if drafts else None
        if params.structured_output is not None:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
            # Output written elsewhere (a peer's first hand-off) is caught up on at the first mask.
            req.grammar = self._grammars.state(params.structured_output)
        if detokenize or params.stop:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.tokens[:len(req.tokens) - drafts])
        self.reqs[rid] = req
        self.scheduler.add(req)
        return req

    def hand_off(self, req: Req, look_ahead: bool = False) -> None:
        """req goes to a peer: PENDING here. With `look_ahead`, when this model wrote req's last token
        (so has not computed it), that token first runs as one row of the next step that launches for
        other work, and the row's sample is set aside: `receive` returns it when the request comes
        back with its tokens unchanged, so the model answers without a step. The row is one its next
        visit would compute anyway; sampling is keyed by (seed, position), so the set-aside token is
        the one that visit would draw."""
        if look_ahead and req.extend_len == 1 and req.status is ReqStatus.RUNNING:
            req.look_ahead = True
        else:
            self.scheduler.set_pending(req)

    def receive(self, rid: str, loc: int, suffix: list[int], drafts: int = 0,
                loose: LooseVerify | None = None) -> StepOutput | None:
        """A peer hands request rid back: cut our copy to `loc`, append the suffix, run again.
        Only the unseen suffix is computed; KV past `loc` is rolled back. Returns the row of the
        request's next token when a look-ahead already sampled it from these very tokens: the caller
        commits it as a step's row, and the request runs nothing. The suffix's last `drafts` tokens
        are proposals this model verifies (Req.drafts) by the rule `loose` (None: exactly); the cut
        drops what this model drafted past `loc` (Engine.append_draft)."""
        req = self.reqs[rid]
        self._check_drafts(req, drafts, len(suffix))
        ahead = self.ahead.pop(rid, None)
        unchanged = loc == len(req.tokens) and not suffix
        req.look_ahead = False  # back before its look-ahead row ran: it runs as a normal row
        self.scheduler.truncate(req, loc)
        if req.grammar is not None:
            req.grammar.truncate(max(0, loc - req.prompt_len))
        req.tokens.extend(suffix)
        req.drafts, req.loose = drafts, loose if drafts else None
        if req.status is ReqStatus.PENDING:
            self.scheduler.resume(req)
        if ahead is not None and unchanged and req.extend_len == 0:
            self.stats.look_ahead_hits += 1
            self.stats.sampled_tokens += 1
            return ahead
        if req.extend_len <= drafts:
            # Too little to feed: recompute the last token (whose logits the next sample needs), or
            # the token before the drafts (whose logits verify the first).
            tail = req.tokens[-1 - drafts:]
            self.scheduler.truncate(req, len(req.tokens) - len(tail))
            req.tokens.extend(tail)
        return None

    @staticmethod
    def _check_drafts(req: Req, drafts: int, new: int) -> None:
        if drafts < 0 or drafts > new:
            raise ValueError(f"request {req.rid}: {drafts} drafts to verify among {new} new tokens")
        if drafts and not req.may_draft:
            raise ValueError(f"request {req.rid}: drafts to verify, but its logits are processed or its "
                             "logprobs asked for (Req.may_draft)")

    def append_draft(self, req: Req, tok: int) -> None:
        """Append a proposal to req: no output, no stop check; a peer verifies it (Req.drafts there)
        and hands the request back cut at the first one it rejected."""
        req.tokens.append(tok)

    def accept_drafts(self, req: Req, now: float) -> int:
        """Commit as output the drafts this model's step accepted (req.drafts of them, at the end of
        its tokens, with KV), in order, each with append_token's stop checks; how many were committed
        (fewer when one of them finished the request)."""
        n, req.drafts = req.drafts, 0
        kv, tail = req.kv_len, req.tokens[len(req.tokens) - n:]
        del req.tokens[len(req.tokens) - n:]
        req.kv_len = min(kv, len(req.tokens))
        for j, tok in enumerate(tail):
            req.tokens.append(tok)
            req.kv_len = min(kv, len(req.tokens))
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, *reason)
                return j + 1
        return n

    def abort(self, rid: str) -> Req | None:
        req = self.reqs.get(rid)
        if req is None:
            return None
        self._finish(req, "abort")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    # ---- the step ----------------------------------------------------------------------------
    def forward_step(self, overlap: Callable[[], None] | None = None) -> StepOutput | None:
        """Schedule and run one step; KV is committed, sampled tokens are not (see append_token).
        None when nothing launched. `overlap` runs once while the model step is in flight (the
        runner calls it after launching the step, before waiting for it): work that must touch
        neither this batch nor the scheduler, such as sending the previous step's outputs."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        start = time.perf_counter()
        if self.tp is None:
            try:
                out = self._run(batch.reqs, batch.extend_lens, overlap)
            except Exception as e:
                raise self._contain(batch.reqs, batch.extend_lens, e) from e
        else:
            try:
                out = self._run(batch.reqs, batch.extend_lens, overlap)
            except BaseException as e:
                self.tp.serving = False  # the ranks may be out of step now: shutdown kills, sends no STOP
                dead = self.tp.dead_workers(wait=2.0)
                if dead is None or not isinstance(e, RuntimeError):
                    raise
                raise TPWorkerError(f"tensor-parallel worker {dead} exited; the step failed: {e}") from e
        if self.trace.enabled:
            assert self.trace_index is not None
            self.trace.write_batch(self.trace_index, start, time.perf_counter(), batch.reqs, batch.extend_lens)
        self.scheduler.commit(batch)
        self.stats.steps += 1
        self.stats.extended_tokens += batch.num_tokens
        if out.accepted is not None:
            out = self._cut_rejected(out)
        if any(r.look_ahead for r in out.reqs):
            out = self._set_aside(out)
        self.stats.sampled_tokens += len(out.token_ids)
        return out

    def _cut_rejected(self, out: StepOutput) -> StepOutput:
        """A verifying step's rows: drop each request's drafts past the run it accepted (KV rolled
        back); the accepted ones stay its drafts until the caller commits them (accept_drafts). The
        step, with the drafts each row rejected."""
        assert out.accepted is not None
        rejected: list[list[int]] = []
        for req, a in zip(out.reqs, out.accepted):
            cut = len(req.tokens) - req.drafts + a
            rejected.append(req.tokens[cut:] if req.drafts else [])
            if req.drafts:
                self.stats.drafts_verified += req.drafts
                self.stats.drafts_accepted += a
                self.scheduler.truncate(req, cut)
                req.drafts, req.loose = a, None  # verified: the rule is spent
        return out._replace(rejected=rejected)

    def _set_aside(self, out: StepOutput) -> StepOutput:
        """Keep the look-ahead rows' samples for `receive` (their requests turn PENDING); the rest of
        the step, for the caller to commit."""
        keep = []
        for i, req in enumerate(out.reqs):
            if req.look_ahead:
                self.scheduler.end_look_ahead(req)
                self.ahead[req.rid] = out.rows([i])
                self.stats.look_aheads += 1
            else:
                keep.append(i)
        return out.rows(keep)

    def _run(self, reqs: list[Req], extend_lens: list[int], overlap: Callable[[], None] | None) -> StepOutput:
        with self.cores.step(sum(extend_lens), len(self.reqs)) if self.cores is not None else contextlib.nullcontext():
            if overlap is None:
                return self.runner.run(reqs, extend_lens)
            return self.runner.run(reqs, extend_lens, overlap)

    def _contain(self, reqs: list[Req], extend_lens: list[int], cause: Exception) -> StepFailed:
        """Find the requests a failed step failed on by running each alone, and finish them with an
        error; when none fails alone and the batch was only theirs (it failed as a whole), all of
        them. A look-ahead row is never blamed: its request lives at a peer, so it only gives the row
        up (PENDING), and its next visit runs the row as an ordinary one, contained as any. So a batch
        that held look-ahead rows blames only what fails alone, even a single request: the row may be
        what broke it."""
        own = [(r, n) for r, n in zip(reqs, extend_lens) if not r.look_ahead]
        had_rows = len(own) < len(reqs)
        for req in reqs:
            if req.look_ahead:
                self.scheduler.end_look_ahead(req)
        failed = []
        if had_rows or len(own) > 1:  # a lone request without rows already ran alone
            for req, n in own:
                try:
                    self.runner.run([req], [n])
                except Exception:  # noqa: BLE001 - this request is one the step fails on
                    failed.append(req)
        if not failed and not had_rows:
            failed = [r for r, _ in own]
        for req in failed:
            self._finish(req, "error")
        return StepFailed(failed, cause)

    def step(self) -> StepResult:
        """One step of single-model decoding: every sampled token is committed. Requests the step
        failed on come back finished with reason "error"."""
        try:
            out = self.forward_step()
        except StepFailed as e:
            logger.error("%s", e)
            return StepResult([], e.failed, None)
        if out is None:
            return StepResult([], [], None)
        now = time.monotonic()
        finished = []
        for i, (req, tok) in enumerate(zip(out.reqs, out.token_ids)):
            self.append_token(req, tok, now, out, i)
            if req.finished:
                finished.append(req)
        return StepResult(out.reqs, finished, out)

    def append_token(self, req: Req, tok: int, now: float, out: StepOutput | None = None, row: int = 0) -> None:
        """Commit one sampled token to req and finish it if a stop condition holds."""
        req.tokens.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        if out is not None and out.logprobs is not None and req.params.logprobs is not None:
            req.output_logprobs.append(out.logprobs[row])
            assert out.top_logprobs is not None
            req.output_top_logprobs.append(out.top_logprobs[row] or {})
        reason = self._stop_reason(req, tok)
        if reason is not None:
            self._finish(req, *reason)

    def _stop_reason(self, req: Req, tok: int) -> tuple[str, int | str | None] | None:
        p = req.params
        if req.grammar is not None:
            try:
                req.grammar.sync(req.output_ids)
            except GrammarViolation:
                logger.exception("request %s: its output left its grammar", req.rid)
                return "error", None
            if req.grammar.terminated:  # the grammar is complete and took its stop token: EOS, ignored or not
                return "stop", None
        if tok in p.stop_token_ids:
            return "stop", tok
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop", None
        det = req.detok
        if det is not None:
            new = det.add([tok])
            if p.stop and new:
                hit = output_stop(det.text, len(new), p.stop, p.include_stop_str_in_output, req.num_output,
                                  p.min_tokens)
                if hit is not None:
                    det.text = hit.text
                    return "stop", hit.stop
        if (p.max_tokens is not None and req.num_output >= p.max_tokens) or len(req.tokens) >= self.max_model_len:
            return "length", None
        return None

    def _finish(self, req: Req, reason: str, stop: int | str | None = None) -> None:
        req.finish_reason = reason
        req.stop_reason = stop
        req.finish_time = time.monotonic()
        if req.detok is not None:
            req.text, req.detok = req.detok.text, None
        self.ahead.pop(req.rid, None)
        req.look_ahead = False
        self.scheduler.finish(req)
        self.reqs.pop(req.rid, None)
        self.stats.finished += 1

    def check_integrity(self) -> None:
        """The scheduler's page invariants, and look-ahead's (Engine.hand_off): a look-ahead request is
        RUNNING with exactly its own last token to run; a set-aside row belongs to a PENDING request
        whose tokens all have KV, and samples its next position. Drafts are output positions, and
        a request verifying them here has the token before them to run (Req.drafts)."""
        self.scheduler.check_integrity()
        for req in self.reqs.values():
            if not 0 <= req.drafts <= req.num_output:
                raise AssertionError(f"request {req.rid}: {req.drafts} drafts among {req.num_output} output tokens")
            if req.loose is not None and not req.drafts:
                raise AssertionError(f"request {req.rid}: a verification rule without drafts")
            if req.drafts and req.status is ReqStatus.RUNNING and req.extend_len <= req.drafts:
                raise AssertionError(f"request {req.rid}: verifies {req.drafts} drafts with {req.extend_len} to run")
            if req.look_ahead and (req.status is not ReqStatus.RUNNING or req.extend_len != 1):
                raise AssertionError(f"request {req.rid}: look-ahead while {req.status.value} with "
                                     f"{req.extend_len} tokens to run")
        for rid, row in self.ahead.items():
            req = self.reqs.get(rid)
            if req is None or row.reqs != [req] or req.status is not ReqStatus.PENDING or req.extend_len != 0:
                raise AssertionError(f"request {rid}: a set-aside row without a PENDING request fully computed")

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def abort_all(self) -> None:
        """Drop every request (its pages freed); the engine stays usable (see shutdown)."""
        for rid in list(self.reqs):
            self.abort(rid)

    def shutdown(self) -> None:
        """Drop every request and stop the tensor-parallel workers (STOP broadcast, then join); the
        engine cannot step afterwards. Without tensor parallelism the engine holds no processes, so
        this is abort_all()."""
        self.abort_all()
        if self.tp is not None:
            self.tp.shutdown()

    def embedding_weight(self) -> torch.Tensor:
        """The model's whole input embedding [vocab, hidden] (routers read it). Under tensor
        parallelism this rank holds a vocabulary slice, so the whole one is read from the checkpoint
        (once, cached)."""
        assert self.model is not None, "the latency-model executor has no embedding"
        if self.tp is None:
            return self.model.model.embed_tokens.weight
        if getattr(self, "_full_embedding", None) is None:
            from tokenrouter.engine.model_loader import load_tensor

            w = load_tensor(self.cfg.model_path, "model.embed_tokens.weight")
            self._full_embedding = w.to(self.device, self.dtype)
        return self._full_embedding

    def info(self) -> dict[str, Any]:
        return {
            "model": self.cfg.model_path,
            "architecture": self.model_config.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "kv_pages": self.pool.num_pages,
            "page_size": self.pool.page_size,
            "max_model_len": self.max_model_len,
            "tp_size": self.tp_size,
            "quantization": self.quantization,
        }

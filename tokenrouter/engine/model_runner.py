"""One forward step over a flat batch of extends, then sampling and the step outputs routers need."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from tokenrouter.engine.compiled_step import CompiledDecode
from tokenrouter.engine.logits_processing import process_logits, processed
from tokenrouter.engine.req import LooseVerify, Req
from tokenrouter.engine.sampler import Sampler, SamplingBatch
from tokenrouter.engine.step_outputs import StepOutputSpec, StepTensors, step_tensors
from tokenrouter.engine.tp_step import broadcast_batch
from tokenrouter.models.attention.backend import AttentionBackend
from tokenrouter.models.forward_batch import ForwardBatch
from tokenrouter.models.kv_pool import KVPool
from tokenrouter.models.llama import LlamaForCausalLM
from tokenrouter.models.tp_group import TPGroup

_PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per lm_head call


class StepOutput(NamedTuple):
    """Results for the requests that sampled this step, in row order."""

    reqs: list[Req]
    token_ids: list[int]
    logprobs: list[float] | None  # of each sampled token, when any request asked for logprobs
    top_logprobs: list[dict[int, float] | None] | None
    hidden: torch.Tensor | None
    logits: torch.Tensor | None
    top_logits: tuple[torch.Tensor, torch.Tensor] | None
    entropy: torch.Tensor | None
    # Per row, how many of its request's drafts the step accepted (Req.drafts); None when no row
    # verified drafts. A verifying row's token and outputs are those at the first rejected draft
    # (or after the last draft when all were accepted).
    accepted: list[int] | None = None
    # Per row, the drafts the step rejected (Engine._cut_rejected: the run past the accepted ones).
    rejected: list[list[int]] | None = None

    def rows(self, idx: list[int]) -> StepOutput:
        """The rows `idx` of this step, in that order, as a step of those requests."""
        def pick(t):  # type: ignore[no-untyped-def]
            if t is None:
                return None
            return [t[i] for i in idx] if isinstance(t, list) else t[idx]

        top = None if self.top_logits is None else (pick(self.top_logits[0]), pick(self.top_logits[1]))
        return StepOutput([self.reqs[i] for i in idx], [self.token_ids[i] for i in idx], pick(self.logprobs),
                          pick(self.top_logprobs), pick(self.hidden), pick(self.logits), top, pick(self.entropy),
                          pick(self.accepted), pick(self.rejected))


def _loosely_kept(rule: LooseVerify, agree: list[bool], a: int, unsure: float) -> bool:
    """Whether draft `a`, which the verifier's own sample rejects, is kept by `rule`."""
    window = agree[a + 1:a + 1 + rule.window]
    return unsure > rule.entropy and bool(window) and all(window)


class ModelRunner:
    """Owns the model and its attention backend; knows nothing of scheduling.

    `run(reqs, extend_lens)` feeds each request `tokens[kv_len:kv_len + extend_len]`; its pages must
    already cover positions up to kv_len + extend_len. Requests whose extend reaches the end of their
    tokens are sampled. The runner writes KV but does not advance kv_len: the caller commits.

    Under tensor parallelism (`tp` of size > 1) this is rank 0: each step's batch is broadcast to the
    other ranks before the forward (they run the same model code, so the collectives pair up), and
    sampling happens here only.

    `decode`, when given, runs the batches it accepts (every request samples, and the new tokens fit
    its largest bucket: decodes, catch-ups, short prompts) through a compiled step, one row per new
    token (tokenrouter/engine/compiled_step.py); the rest run eagerly here.
    """

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, backend: AttentionBackend,
                 device: torch.device, outputs: StepOutputSpec = StepOutputSpec(), tp: TPGroup | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), decode: CompiledDecode | None = None) -> None:
        self.model = model
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.pool = pool
        self.backend = backend
        self.device = device
        self.outputs = outputs
        self.sampler = Sampler(device, model.fused_ops)
        self.eos_token_ids = eos_token_ids  # masked while a request is below its min_tokens
        self.decode = decode

    def build_batch(self, reqs: list[Req], extend_lens: list[int]) -> tuple[ForwardBatch, list[int]]:
        """The forward batch, and the indices (into reqs) of the requests that sample. A sampled
        request with drafts samples at its last `drafts + 1` rows (sample_rows in that order)."""
        dev = self.device
        p = self.pool.page_size
        prefix = [r.kv_len for r in reqs]
        ids = list(itertools.chain.from_iterable(
            r.tokens[k:k + e] for r, k, e in zip(reqs, prefix, extend_lens)))
        n_pages = [math.ceil((k + e) / p) for k, e in zip(prefix, extend_lens)]
        width = max(n_pages)
        table = [r.pages[:n] + [0] * (width - n) for r, n in zip(reqs, n_pages)]
        sampled = [i for i, (r, k, e) in enumerate(zip(reqs, prefix, extend_lens)) if k + e == len(r.tokens)]

        prefix_t = torch.tensor(prefix, dtype=torch.int64)
        ext_t = torch.tensor(extend_lens, dtype=torch.int64)
        starts = torch.cumsum(ext_t, 0) - ext_t
        total = int(ext_t.sum())
        req_of_row = torch.repeat_interleave(torch.arange(len(reqs)), ext_t, output_size=total)
        positions = torch.arange(total) - starts[req_of_row] + prefix_t[req_of_row]
        table_t = torch.tensor(table, dtype=torch.int64)
        slots = table_t[req_of_row, positions // p] * p + positions % p
        ends = (starts + ext_t)[torch.tensor(sampled, dtype=torch.int64)]
        if any(reqs[i].drafts for i in sampled):
            span = torch.tensor([reqs[i].drafts + 1 for i in sampled], dtype=torch.int64)
            first = torch.repeat_interleave(ends - span, span)
            sample_rows = first + torch.arange(len(first)) - torch.repeat_interleave(torch.cumsum(span, 0) - span, span)
        else:
            sample_rows = ends - 1
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            out_slots=slots.to(dev, non_blocking=True),
            page_table=table_t.to(dev, non_blocking=True),
            prefix_lens=prefix_t.to(dev, non_blocking=True),
            extend_lens=ext_t.to(dev, non_blocking=True),
            sample_rows=sample_rows.to(dev, non_blocking=True),
            prefix_lens_list=prefix,
            extend_lens_list=list(extend_lens),
            page_size=p,
        )
        return batch, sampled

    @torch.inference_mode()
    def run(self, reqs: list[Req], extend_lens: list[int], overlap: Callable[[], None] | None = None) -> StepOutput:
        """`overlap` runs once the forward is launched: on a GPU, while the device computes (the
        kernels are queued asynchronously); on a CPU, after it."""
        if self.decode is not None and self.decode.accepts(reqs, extend_lens):
            t = self.decode.run(reqs, extend_lens)
            if overlap is not None:
                overlap()
            return self._verify(reqs, t) if any(r.drafts for r in reqs) else self._sample(reqs, t)
        batch, sampled_idx = self.build_batch(reqs, extend_lens)
        if self.tp is not None:
            broadcast_batch(self.tp, batch)
        self.backend.plan(batch)
        hidden = self.model(batch, self.backend)
        if overlap is not None:
            overlap()
        if any(r.wants_prompt_logprobs for r in reqs):
            self._prompt_logprobs(reqs, extend_lens, hidden)
        sampled = [reqs[i] for i in sampled_idx]
        if not sampled:
            return StepOutput([], [], None, None, None, None, None, None)
        t = step_tensors(self.model, hidden[batch.sample_rows], self.outputs, greedy=self._greedy(sampled))
        if any(r.drafts for r in sampled):
            return self._verify(sampled, t)
        return self._sample(sampled, t)

    @staticmethod
    def _greedy(sampled: list[Req]) -> bool:
        """Whether every row takes the argmax of the model's own logits and reads nothing else of them
        (so a step may take the screened head: tokenrouter/models/screened_head.py)."""
        return all(r.params.temperature == 0.0 and r.params.logprobs is None and not processed(r) for r in sampled)

    def _verify(self, sampled: list[Req], t: StepTensors) -> StepOutput:
        """Speculative verification (Req.drafts): each request's rows sample at the token before its
        drafts and at each draft, keyed by position like any sample, so row j draws the token this
        model would write at that position itself. The request keeps its drafts up to the first one
        its own draw disagrees with (or, by a request's `loose` rule, the first it does not keep
        loosely), and takes that row's draw as its next token."""
        span = [r.drafts + 1 for r in sampled]
        rows = [r for r, n in zip(sampled, span) for _ in range(n)]
        ends = [len(r.tokens) + 1 - n for r, n in zip(sampled, span)]  # position of each request's first draft
        positions = [e + j for e, n in zip(ends, span) for j in range(n)]
        drawn = self._draw(rows, t, positions)
        unsure = self._unsure(rows, t) if any(r.loose for r in sampled) else []  # read only for loose rows
        pick, accepted, start = [], [], 0
        for r, n in zip(sampled, span):
            agree = [drawn[start + j] == tok for j, tok in enumerate(r.tokens[len(r.tokens) - r.drafts:])]
            a = 0
            while a < n - 1 and (agree[a] or (r.loose is not None
                                              and _loosely_kept(r.loose, agree, a, unsure[start + a]))):
                a += 1
            accepted.append(a)
            pick.append(start + a)
            start += n
        index = torch.tensor(pick, dtype=torch.int64, device=t.hidden.device)
        out = self._sample(sampled, t.rows(index), [len(r.tokens) - r.drafts + a for r, a in zip(sampled, accepted)])
        return out._replace(accepted=accepted)

    def _unsure(self, rows: list[Req], t: StepTensors) -> list[float]:
        """Per row, the normalised entropy of its three largest probabilities (LooseVerify), at its
        temperature (greedy rows at 1), from the step's logits or, on the screened head, its exact top 3
        of these rows."""
        if t.logits is not None:
            top = t.logits.topk(3, dim=-1).values
        else:
            screened = self.model.lm_head_screened
            got = screened.top(t.hidden, 3) if screened is not None else None
            top = (got.values if got is not None and got.values is not None
                   else self.model.compute_logits(t.hidden).topk(3, dim=-1).values)
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], dtype=torch.float32, device=top.device)
        logp = torch.log_softmax(top.float() / temps[:, None], dim=-1)
        return (-(logp.exp() * logp).sum(dim=-1) / math.log(3)).tolist()

    def _draw(self, rows: list[Req], t: StepTensors, positions: list[int]) -> list[int]:
        """The token each row samples at its position (logits processing is not applied: a request
        that needs it never drafts)."""
        if t.logits is None:
            assert t.argmax is not None
            return t.argmax.tolist()
        sb = SamplingBatch([r.params.temperature for r in rows], [r.params.top_k for r in rows],
                           [r.params.top_p for r in rows], [r.seed for r in rows], positions)
        return self.sampler.sample(t.logits, sb).tolist()

    def _sample(self, sampled: list[Req], t: StepTensors, positions: list[int] | None = None) -> StepOutput:
        """`positions`: of the token each row samples (default: after the request's last token)."""
        spec = self.outputs
        if t.logits is None:  # the screened head: every row greedy (see _greedy)
            assert t.argmax is not None
            return StepOutput(sampled, t.argmax.tolist(), None, None, t.hidden if spec.hidden else None, None,
                              t.top_logits, None)
        sb = SamplingBatch(
            temperatures=[r.params.temperature for r in sampled],
            top_ks=[r.params.top_k for r in sampled],
            top_ps=[r.params.top_p for r in sampled],
            seeds=[r.seed for r in sampled],
            positions=positions if positions is not None else [len(r.tokens) for r in sampled],
        )
        next_ids = self.sampler.sample(process_logits(t.logits, sampled, self.eos_token_ids), sb)
        logprobs = top_lps = None
        if any(r.params.logprobs is not None for r in sampled):
            lsm = torch.log_softmax(t.logits, dim=-1)
            logprobs = lsm.gather(1, next_ids[:, None]).squeeze(1).tolist()
            top_lps = self._top_logprobs(lsm, sampled)
        return StepOutput(
            reqs=sampled,
            token_ids=next_ids.tolist(),
            logprobs=logprobs,
            top_logprobs=top_lps,
            hidden=t.hidden if spec.hidden else None,
            logits=t.logits if spec.logits else None,
            top_logits=t.top_logits,
            entropy=t.entropy,
        )

    def _prompt_logprobs(self, reqs: list[Req], extend_lens: list[int], hidden: torch.Tensor) -> None:
        """Append to each request that wants them the logprobs of the prompt tokens this extend
        predicts: row j of the extend (position kv_len + j) scores token kv_len + j + 1. Positions
        already scored (a rerun after a failed step or a preemption) are skipped."""
        start = 0
        for req, n in zip(reqs, extend_lens):
            if req.wants_prompt_logprobs:
                first = max(req.kv_len, len(req.prompt_logprobs))  # the next position to score
                end = min(req.kv_len + n, req.prompt_len - 1)
                for lo in range(first, end, _PROMPT_LOGPROB_ROWS):  # bounded memory: rows x vocab floats
                    hi = min(lo + _PROMPT_LOGPROB_ROWS, end)
                    rows = hidden[start + lo - req.kv_len:start + hi - req.kv_len]
                    lsm = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
                    targets = torch.tensor(req.tokens[lo + 1:hi + 1], device=lsm.device)
                    req.prompt_logprobs += lsm.gather(1, targets[:, None]).squeeze(1).tolist()
                    k = req.params.prompt_logprobs or 0
                    if k:
                        vals, ids = lsm.topk(k, dim=-1)
                        req.prompt_top_logprobs += [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
                    else:
                        req.prompt_top_logprobs += [{} for _ in range(hi - lo)]
            start += n

    @staticmethod
    def _top_logprobs(lsm: torch.Tensor, reqs: list[Req]) -> list[dict[int, float] | None]:
        k_max = max(r.params.logprobs or 0 for r in reqs)
        if k_max == 0:
            return [{} if r.params.logprobs is not None else None for r in reqs]
        vals, ids = lsm.topk(k_max, dim=-1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        out: list[dict[int, float] | None] = []
        for r, v, i in zip(reqs, vals_l, ids_l):
            k = r.params.logprobs
            out.append(None if k is None else dict(zip(i[:k], v[:k])))
        return out

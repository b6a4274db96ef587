"""`speculative`: lossless routing. The first model drafts a run of `draft_tokens` tokens; the second
verifies the run in one step, keeps the longest prefix its own samples agree with, writes the next
token itself and hands the request back (Route.draft, Req.drafts). Samples are keyed by (seed,
position), so the second model's sample at a draft's position is the token it would write there
alone: the answer is the second model's own, token for token, greedy or sampled with the same seed
(up to the rounding of a step's batch shape, as between any two batches).

A request whose logits a rule changes (grammar, logit_bias, min_tokens, penalties) or that asks for
logprobs is not drafted: the first model prefills it and the second writes every token.

The lossy knob (vLLM's FLy verification, `fly_entropy_threshold` and `fly_window_size`): below 1, the
verifier also keeps a draft it would reject where it is unsure itself and agrees with the next
`fly_window_size` drafts (as many as follow; engine/req.py LooseVerify), so a user slides from the
second model's own answers toward the first's; it needs runs of two drafts or more. 1, the default,
is exact: everything above holds only there.

The run's length (`draft_schedule`): "constant" drafts `draft_tokens` every run; "heuristic"
(transformers' `num_assistant_tokens_schedule` rule) starts there and, per request, drafts two more
after a run the verifier kept whole and one fewer after a run it cut, from 1 (2 under the lossy knob)
to MAX_DRAFT_TOKENS: the run follows the acceptance the request meets.

Under load (`disable_by_batch_size`, vLLM's `speculative_disable_by_batch_size`): a request that starts
while the group holds at least that many live requests, itself among them, is written by the
verifier alone; on a CPU host the verifier then has every core while the drafter holds nothing
(engine/step_board.py). Drafting pays at low batch, where the verifier's step costs about the same
for a few more rows; at a full batch each draft's row is paid for again and rejected drafts cost
twice. None (the default) drafts at any load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.engine.req import LooseVerify, Req
from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm, RoutingParamError, unit_interval
from tokenrouter.routing.peer_req import PeerReq

if TYPE_CHECKING:
    from tokenrouter.engine.engine import Engine

MAX_DRAFT_TOKENS = 16
DRAFT_SCHEDULES = ("constant", "heuristic")


@dataclass
class DraftRun:
    """A request's drafting state on the drafter: `verified` of its tokens are output (past them:
    drafts), `length` the run it drafts now, `sent` the drafts of the run last sent for verification."""

    verified: int
    length: int
    sent: int = 0


def draft_length(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DRAFT_TOKENS:
        raise RoutingParamError(field, f"must be an integer in [1, {MAX_DRAFT_TOKENS}], got {value!r}")
    return value


def lossy_knob(params: Mapping[str, Any]) -> None:
    """FLy keeps a rejected draft only on the agreement of drafts after it: a run of one has none."""
    if params["fly_entropy_threshold"] < 1.0 and params["draft_tokens"] < 2:
        raise RoutingParamError("fly_entropy_threshold", f"below 1 needs draft_tokens of at least 2 (a kept draft "
                                f"needs drafts after it that agree), got draft_tokens {params['draft_tokens']}")


class Speculative(RoutingAlgorithm):
    name = "speculative"
    request_params = ("draft_tokens", "draft_schedule", "fly_entropy_threshold", "fly_window_size")

    def __init__(self, models: list[str], draft_tokens: int = 1, draft_schedule: str = "constant",
                 fly_entropy_threshold: float = 1.0, fly_window_size: int = 6,
                 disable_by_batch_size: int | None = None) -> None:
        super().__init__(models)
        if len(models) != 2:
            raise ValueError(f"speculative: needs two models (drafter, verifier), got {models}")
        if disable_by_batch_size is not None and (isinstance(disable_by_batch_size, bool)
                                                  or not isinstance(disable_by_batch_size, int)
                                                  or disable_by_batch_size < 1):
            raise ValueError(f"speculative: disable_by_batch_size must be a positive integer or null, "
                             f"got {disable_by_batch_size!r}")
        self.drafter, self.verifier = models
        self.disable_by_batch_size = disable_by_batch_size
        try:
            self.draft_tokens = self.check_request_value("draft_tokens", draft_tokens)
            self.draft_schedule = self.check_request_value("draft_schedule", draft_schedule)
            self.fly_entropy_threshold = self.check_request_value("fly_entropy_threshold", fly_entropy_threshold)
            self.fly_window_size = self.check_request_value("fly_window_size", fly_window_size)
            lossy_knob(self.request_defaults())
        except RoutingParamError as e:
            raise ValueError(f"speculative: {e}") from None
        self.runs: dict[str, DraftRun] = {}  # rid -> its drafting state (read on the drafter only)
        self.eos: frozenset[int] = frozenset()
        self.max_len = 0

    @classmethod
    def check_request_value(cls, field: str, value: Any) -> Any:
        if field == "fly_entropy_threshold":
            return unit_interval(field, value)
        if field == "draft_schedule":
            if value not in DRAFT_SCHEDULES:
                raise RoutingParamError(field, f"must be one of {', '.join(DRAFT_SCHEDULES)}, got {value!r}")
            return value
        return draft_length(field, value)

    def resolve_request(self, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
        params = super().resolve_request(overrides)
        lossy_knob(params)
        return params

    def alone_at(self, live: int) -> str | None:
        if self.disable_by_batch_size is not None and live >= self.disable_by_batch_size:
            return self.verifier
        return None

    def bind(self, model: str, engine: Engine) -> None:
        self.eos = frozenset(engine.eos_token_ids)
        self.max_len = engine.max_model_len

    def on_start(self, req: Req) -> None:
        self.runs[req.rid] = DraftRun(len(req.tokens), self.params_of[req.rid]["draft_tokens"])

    def on_finish(self, req: Req) -> None:
        self.runs.pop(req.rid, None)

    def send(self, req: Req, dest: str, known: int) -> PeerReq:
        peer = super().send(req, dest, known)
        params = self.params_of[req.rid]
        if dest == self.verifier and params["fly_entropy_threshold"] < 1.0:
            peer.loose = LooseVerify(params["fly_entropy_threshold"], params["fly_window_size"])
        return peer

    def receive(self, peer: PeerReq, model: str) -> PeerReq:
        run = self.runs.get(peer.rid) if model == self.drafter and not peer.finished else None
        if run is None:
            return peer
        # the verifier's hand-back: loc past the drafts it kept, the suffix its own token
        verified = peer.loc + len(peer.suffix)
        params = self.params_of[peer.rid]
        if params["draft_schedule"] == "heuristic" and run.sent:
            if verified - run.verified - 1 >= run.sent:
                run.length = min(run.length + 2, MAX_DRAFT_TOKENS)
            else:
                run.length = max(run.length - 1, 2 if params["fly_entropy_threshold"] < 1.0 else 1)
        run.verified, run.sent = verified, 0
        return peer

    def route(self, model: str, step: StepOutput) -> list[Route]:
        if model == self.verifier:
            return [Route(self.drafter) if r.may_draft else STAY for r in step.reqs]
        routes = []
        for req, tok in zip(step.reqs, step.token_ids):
            if not req.may_draft:
                routes.append(Route(self.verifier, keep=False))
                continue
            run = self.runs[req.rid]
            n = len(req.tokens) + 1 - run.verified  # this token is the run's n-th draft
            p = req.params
            last = (n >= run.length or (tok in self.eos and not p.ignore_eos)
                    or tok in p.stop_token_ids or len(req.tokens) + 1 >= self.max_len
                    or (p.max_tokens is not None and req.num_output + 1 >= p.max_tokens))
            if last:
                run.sent = n  # the same value if route runs again after a failure
            routes.append(Route(self.verifier if last else None, draft=True))
        return routes

"""What a subserver keeps of each live request beside the engine's Req, one record per request: the
hand-off protocol's state (docs/DESIGN.md section 3) and, for a request that asked for it
(`routing.trace`), its per-token attribution; and the recently aborted request ids.

Attribution: each token a traced request commits here carries a Trace (runtime/messages.py): the
hand-offs since its previous token and the router's score at its position. A hand-off carries the
same to the peer, which puts it on the next token it commits: the path so far and, when this model
handed the position away without keeping its token, the score that did it. With no traced request
live, the subserver never asks the algorithm for scores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenrouter.engine.req import Req
from tokenrouter.routing.algorithm import Route, Scores
from tokenrouter.runtime.messages import Trace

ABORT_MEMORY_S = 300.0  # how long an aborted rid is remembered, to drop hand-offs still in flight


@dataclass
class RequestState:
    """One live request on this model.

    Invariants (RequestStates.check_integrity):
    - it lives exactly as long as `req` is the engine's live request of its rid (between messages and
      steps): it outlives it only while the subserver ends the request;
    - `at_peer` exactly while the engine's request is at a peer (Req.at_peer);
    - `incoming` only on a traced request.
    """

    req: Req  # the engine's request: the algorithm's on_finish needs it after the engine let it go
    known: dict[str, int] = field(default_factory=dict)  # peer -> how many of its tokens that peer holds
    handoffs: int = 0  # its hand-offs so far (every model's, as last seen here)
    at_peer: bool = False  # handed to a peer and not back (PENDING here, or first running its look-ahead row)
    prompt_logprobs_due: bool = False  # the entry still awaits its prompt logprobs from this model
    alone: bool = False  # this model writes it alone (routing.model): never routed, so never scored
    drafted: int = 0  # its last tokens, this model's drafts for the next hand-off to verify (Route.draft)
    drafter: str | None = None  # the peer whose drafts this model's next step verifies (Req.drafts)
    traced: bool = False  # it asked for a per-token trace (routing.trace)
    incoming: Trace | None = None  # what the hand-off that brought it here carried, until a token or hand-off uses it

    def end_pending(self, now: float) -> float:
        """It is back (or gone; before the engine resumes or drops it): the seconds it was PENDING, 0
        if it was not. They run from when the engine made it PENDING, not from the hand-off: a
        look-ahead row may have run here in between."""
        at_peer, self.at_peer = self.at_peer, False
        return self.req.pending_seconds(now) if at_peer else 0.0

    def received(self, trace: Trace | None) -> None:
        if trace is not None and self.traced:
            self.incoming = trace

    def token_trace(self, scores: Scores | None, row: int) -> Trace | None:
        """The trace of the token this model just committed for it (row `row` of the step)."""
        if not self.traced:
            return None
        came, self.incoming = self.incoming, None
        if came is not None and came.score is not None:  # the position was handed here: that score
            return Trace(came.path, came.score, came.threshold)
        return Trace(came.path if came is not None else [], *self._score(scores, row))

    def handoff_trace(self, model: str, route: Route, scores: Scores | None, row: int) -> Trace | None:
        """What its hand-off from `model` to route.dest after this step tells the peer (None: untraced)."""
        if not self.traced or route.dest is None:
            return None
        if route.keep:  # this model's token is committed (its trace already sent): the path starts here
            return Trace([model, route.dest])
        came, self.incoming = self.incoming, None
        path = (came.path if came is not None else [model]) + [route.dest]
        if came is not None and came.score is not None:  # handed on again: the first score stands
            return Trace(path, came.score, came.threshold)
        return Trace(path, *self._score(scores, row))

    def _score(self, scores: Scores | None, row: int) -> tuple[float | None, float | None]:
        if scores is None or self.alone:
            return None, None
        return scores.score[row], scores.threshold[row]


class RequestStates:
    """The live requests' records (exactly the engine's live requests, between messages and steps),
    and the aborted rids remembered for ABORT_MEMORY_S. The subserver's loop thread only."""

    def __init__(self) -> None:
        self.live: dict[str, RequestState] = {}
        self.aborted: dict[str, float] = {}  # rid -> when its Abort arrived (monotonic)
        # Counts of live requests with a flag set: a step with none of one skips its per-row pass.
        self.alone = 0
        self.prompt_logprobs_due = 0
        self.traced = 0

    def start(self, state: RequestState) -> None:
        rid = state.req.rid
        assert rid not in self.live, f"request {rid} started twice"
        self.live[rid] = state
        self.alone += state.alone
        self.prompt_logprobs_due += state.prompt_logprobs_due
        self.traced += state.traced

    def end(self, rid: str) -> RequestState | None:
        """Forget a request (finished, dropped or failed here): its record, or None if it had none."""
        state = self.live.pop(rid, None)
        if state is not None:
            self.alone -= state.alone
            self.prompt_logprobs_due -= state.prompt_logprobs_due
            self.traced -= state.traced
        return state

    def prompt_logprobs_sent(self, state: RequestState) -> None:
        state.prompt_logprobs_due = False
        self.prompt_logprobs_due -= 1

    def any_traced(self, reqs: list[Req]) -> bool:
        """Whether a step of these (live) requests needs the algorithm's scores."""
        return self.traced > 0 and any(self.live[r.rid].traced for r in reqs)

    def abort(self, rid: str, now: float) -> None:
        self.aborted[rid] = now

    def forget_old_aborts(self, now: float) -> None:
        for rid in [r for r, t in self.aborted.items() if now - t > ABORT_MEMORY_S]:
            del self.aborted[rid]

    def check_integrity(self, reqs: Mapping[str, Req]) -> None:
        """Every live request of the engine has exactly one record and no record outlives its request;
        a request is at a peer (PENDING, or running its look-ahead row) exactly while its record says
        so; only a traced request holds a trace; the counts match the flags."""
        assert self.live.keys() == reqs.keys(), (f"records {sorted(self.live)} but live requests "
                                                 f"{sorted(reqs)}")
        for rid, state in self.live.items():
            assert state.req is reqs[rid], f"{rid}: the record of another request of that id"
            pending = state.req.at_peer
            assert pending == state.at_peer, f"{rid}: at a peer {pending}, {state}"
            assert state.traced or state.incoming is None, f"{rid}: a trace on an untraced request, {state}"
        live = self.live.values()
        assert self.alone == sum(s.alone for s in live), "alone count drifted"
        assert self.prompt_logprobs_due == sum(s.prompt_logprobs_due for s in live), \
            "prompt_logprobs_due count drifted"
        assert self.traced == sum(s.traced for s in live), "traced count drifted"

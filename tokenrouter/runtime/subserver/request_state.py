"""What a subserver keeps of each live request beside the engine's Req: the hand-off protocol's state
(docs/DESIGN.md section 3), one small record per request, and the recently aborted request ids."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenrouter.engine.req import Req

ABORT_MEMORY_S = 300.0  # how long an aborted rid is remembered, to drop hand-offs still in flight


@dataclass
class RequestState:
    """One live request on this model."""

    known: dict[str, int] = field(default_factory=dict)  # peer -> how many of its tokens that peer holds
    handoffs: int = 0  # its hand-offs so far (every model's, as last seen here)
    at_peer: bool = False  # handed to a peer and not back (PENDING here, or first running its look-ahead row)
    prompt_logprobs_due: bool = False  # the entry still awaits its prompt logprobs from this model
    alone: bool = False  # this model writes it alone (routing.model): never routed
    drafted: int = 0  # its last tokens, this model's drafts for the next hand-off to verify (Route.draft)
    drafter: str | None = None  # the peer whose drafts this model's next step verifies (Req.drafts)

    def end_pending(self, req: Req | None, now: float) -> float:
        """It is back (or gone; req, before the engine resumes or drops it): the seconds it was
        PENDING, 0 if it was not. They run from when the engine made it PENDING, not from the
        hand-off: a look-ahead row may have run here in between."""
        at_peer, self.at_peer = self.at_peer, False
        return req.pending_seconds(now) if at_peer and req is not None else 0.0


class RequestStates:
    """The live requests' states (exactly the engine's live requests, between messages and steps),
    and the aborted rids remembered for ABORT_MEMORY_S. The subserver's loop thread only."""

    def __init__(self) -> None:
        self.live: dict[str, RequestState] = {}
        self.aborted: dict[str, float] = {}  # rid -> when its Abort arrived (monotonic)
        self.alone = 0  # live requests this model writes alone (a step with none skips the per-row pass)
        self.prompt_logprobs_due = 0  # live requests whose prompt logprobs are due (likewise)

    def start(self, rid: str, state: RequestState) -> None:
        assert rid not in self.live, f"request {rid} started twice"
        self.live[rid] = state
        self.alone += state.alone
        self.prompt_logprobs_due += state.prompt_logprobs_due

    def end(self, rid: str) -> RequestState | None:
        """Forget a request (finished, dropped or failed here): its state, or None if it had none."""
        state = self.live.pop(rid, None)
        if state is not None:
            self.alone -= state.alone
            self.prompt_logprobs_due -= state.prompt_logprobs_due
        return state

    def prompt_logprobs_sent(self, state: RequestState) -> None:
        state.prompt_logprobs_due = False
        self.prompt_logprobs_due -= 1

    def abort(self, rid: str, now: float) -> None:
        self.aborted[rid] = now

    def forget_old_aborts(self, now: float) -> None:
        for rid in [r for r, t in self.aborted.items() if now - t > ABORT_MEMORY_S]:
            del self.aborted[rid]

    def check_integrity(self, reqs: Mapping[str, Req]) -> None:
        """Every live request of the engine has exactly one state and no state outlives its request;
        a request is at a peer (PENDING, or running its look-ahead row) exactly while its state says
        so; the counts match the flags."""
        assert self.live.keys() == reqs.keys(), (f"states {sorted(self.live)} but live requests "
                                                 f"{sorted(reqs)}")
        for rid, state in self.live.items():
            pending = reqs[rid].at_peer
            assert pending == state.at_peer, f"{rid}: at a peer {pending}, {state}"
        assert self.alone == sum(s.alone for s in self.live.values()), "alone count drifted"
        assert self.prompt_logprobs_due == sum(s.prompt_logprobs_due for s in self.live.values()), \
            "prompt_logprobs_due count drifted"

"""Per-token attribution on one subserver, for the requests that asked for it (`routing.trace`).

Each token such a request commits here carries a Trace (runtime/messages.py): the hand-offs since
its previous token and the router's score at its position. A hand-off carries the same to the peer,
which puts it on the next token it commits: the path so far and, when this model handed the position
away without keeping its token, the score that did it. Only traced requests are tracked; with none,
the subserver never asks the algorithm for scores.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenrouter.engine.req import Req
from tokenrouter.routing.algorithm import Route, Scores
from tokenrouter.runtime.messages import Trace


class Attribution:
    def __init__(self, model: str) -> None:
        self.model = model
        self.traced: set[str] = set()  # rids of the traced requests on this model
        self.unscored: set[str] = set()  # traced rids no routing decision is taken for (routing.model)
        self.incoming: dict[str, Trace] = {}  # rid -> what the hand-off that brought it here carried
        self.outgoing: dict[str, Trace] = {}  # rid -> what its hand-off from this step will carry

    def start(self, rid: str, scored: bool = True) -> None:
        self.traced.add(rid)
        if not scored:
            self.unscored.add(rid)

    def forget(self, rid: str) -> None:
        self.traced.discard(rid)
        self.unscored.discard(rid)
        self.incoming.pop(rid, None)
        self.outgoing.pop(rid, None)

    def wants(self, reqs: Iterable[Req]) -> bool:
        """Whether a step of these requests needs the algorithm's scores."""
        return any(r.rid in self.traced for r in reqs)

    def received(self, rid: str, trace: Trace | None) -> None:
        if trace is not None and rid in self.traced:
            self.incoming[rid] = trace

    def token(self, rid: str, scores: Scores | None, row: int) -> Trace | None:
        """The trace of the token this model just committed for `rid` (row `row` of the step)."""
        if rid not in self.traced:
            return None
        came = self.incoming.pop(rid, None)
        if came is not None and came.score is not None:  # the position was handed here: that score
            return Trace(came.path, came.score, came.threshold)
        return Trace(came.path if came is not None else [], *self._score(rid, scores, row))

    def handing(self, rid: str, route: Route, scores: Scores | None, row: int) -> None:
        """`rid` goes to route.dest after this step; record what its hand-off tells the peer."""
        if rid not in self.traced or route.dest is None:
            return
        if route.keep:  # this model's token is committed (its trace already sent): the path starts here
            self.outgoing[rid] = Trace([self.model, route.dest])
            return
        came = self.incoming.pop(rid, None)
        path = (came.path if came is not None else [self.model]) + [route.dest]
        if came is not None and came.score is not None:  # handed on again: the first score stands
            self.outgoing[rid] = Trace(path, came.score, came.threshold)
        else:
            self.outgoing[rid] = Trace(path, *self._score(rid, scores, row))

    def sent(self, rid: str) -> Trace | None:
        return self.outgoing.pop(rid, None)

    def _score(self, rid: str, scores: Scores | None, row: int) -> tuple[float | None, float | None]:
        if scores is None or rid in self.unscored:
            return None, None
        return scores.score[row], scores.threshold[row]

"""Time per output token (TPOT) over a measurement window, from the times the entry hands each token
out: what load adaptation holds to its target.

A request's TPOT in a window is vLLM's per-request TPOT restricted to the window: the gaps between
its successive tokens that ended in the window, averaged (its first token's wait, the TTFT, is no
gap). A request that streamed wholly inside the window gets exactly vLLM's figure; a long one counts
in every window it streams through, so an overload shows in the window it happens in, not when the
requests it slows finally end. Each window's figure is the p99 over its requests (nearest rank). The
window also counts the tokens each model wrote, for the large model's share. Its last part (from
`recent_from`, set by the caller as the window opens) is measured apart as well: a load that fell
late in a window shows there a window early.

No clock of its own: callers pass the time, so the tests run on a synthetic one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Stream:
    last: float  # when its latest token came
    gap_sum: float = 0.0  # seconds between its tokens, this window
    gaps: int = 0
    recent_sum: float = 0.0  # of those, the gaps that ended in the window's last part
    recent_gaps: int = 0
    recent_streaming: float = 0.0  # seconds of its gaps that lie in the last part

    def reset(self) -> None:
        self.gap_sum = self.recent_sum = self.recent_streaming = 0.0
        self.gaps = self.recent_gaps = 0


@dataclass(frozen=True)
class WindowFigures:
    """One closed window: the p99 TPOT of its requests (None: no request had two tokens in it), how
    many requests it measured, each model's share of the tokens written in it, and the seconds its
    requests spent streaming in it, summed (their gaps: over the window's length, the load); and the
    p99 and streaming seconds of its last `recent_s` seconds alone (0: none measured)."""

    p99_s: float | None
    requests: int
    shares: dict[str, float] = field(default_factory=dict)
    streaming_s: float = 0.0
    recent_s: float = 0.0
    recent_p99_s: float | None = None
    recent_streaming_s: float = 0.0


def p99(values: list[float]) -> float:
    """The 99th percentile by nearest rank: an observed value, the largest one below 100 samples."""
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


class TpotWindow:
    def __init__(self, recent_from: float = math.inf) -> None:
        self.live: dict[str, _Stream] = {}
        self.ended: list[_Stream] = []  # requests that ended in this window, with their gaps in it
        self.tokens: dict[str, int] = {}  # tokens per writing model, this window
        self.recent_from = recent_from  # where this window's last part begins

    def token(self, rid: str, model: str, now: float) -> None:
        stream = self.live.get(rid)
        if stream is None:
            self.live[rid] = _Stream(now)
        else:
            gap = now - stream.last
            stream.gap_sum += gap
            stream.gaps += 1
            if now > self.recent_from:
                stream.recent_sum += gap
                stream.recent_gaps += 1
                stream.recent_streaming += min(gap, now - self.recent_from)
            stream.last = now
        self.tokens[model] = self.tokens.get(model, 0) + 1

    def finish(self, rid: str) -> None:
        stream = self.live.pop(rid, None)
        if stream is not None and stream.gaps:
            self.ended.append(stream)

    def close(self, now: float, next_recent_from: float = math.inf) -> WindowFigures:
        """The window's figures at `now`; the next window starts empty, its last part from
        `next_recent_from` (live requests keep their last token's time, so the gap across the boundary
        counts in the window it ends in)."""
        streams = [s for s in (*self.live.values(), *self.ended) if s.gaps]
        recent = [s for s in streams if s.recent_gaps]
        total = sum(self.tokens.values())
        figures = WindowFigures(p99([s.gap_sum / s.gaps for s in streams]) if streams else None, len(streams),
                                {m: n / total for m, n in sorted(self.tokens.items())},
                                sum(s.gap_sum for s in streams), max(0.0, now - self.recent_from),
                                p99([s.recent_sum / s.recent_gaps for s in recent]) if recent else None,
                                sum(s.recent_streaming for s in recent))
        for s in self.live.values():
            s.reset()
        self.ended = []
        self.tokens = {}
        self.recent_from = next_recent_from
        return figures

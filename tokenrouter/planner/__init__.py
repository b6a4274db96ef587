"""`tokenrouter plan`: the delayed-batching throughput model (docs/DESIGN.md section 5).

See `tokenrouter.planner.chain` for the model, exactly, and what it does not cover.

The names below are loaded on first use (PEP 562): the chain needs scipy (0.8 s to import), and every
subserver process imports this package for the knob's range (planner/knob_controller.py) alone.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "chain": ("FullChain", "PlanRow", "Solution", "best_thresholds", "full_chain", "gaps_to_p", "plan", "solve",
              "stationary_distribution", "throughput", "throughput_curve", "zero_wait_bound"),
    "gaps": ("GapFit", "fit_runs"),
    "latency": ("Constant", "LatencyModel", "Linear", "Table", "as_latency", "parse_latency"),
    "overheads": ("Overheads",),
    "slo": ("SloChoice", "slo_threshold"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenrouter.planner' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tokenrouter.planner.{module}"), name)

"""When a subserver launches a step: eagerly, or once B requests are ready (delayed batching).

Why thresholds cannot deadlock. Take a routed group of K models and n live requests. Between
steps, every live request is in exactly one of three places: ready on one model (RUNNING there, or
queued in its scheduler), inside a hand-off message on its way, or running in a step being executed.
Messages arrive and steps end without anyone else launching, so consider a moment with none of
either: then sum_m ready_m = n. Model m launches when ready_m >= min(B_m(n), n). If no model could
launch, ready_m <= B_m(n) - 1 for all m, so n = sum_m ready_m <= sum_m (B_m(n) - 1). Thresholds are
therefore accepted only when sum_m (B_m(n) - 1) <= n - 1 for every n (`check_deadlock_free`): then
some model always has enough ready requests to launch, and every request keeps moving. Eager
models (B = 1) add nothing to the sum, so a single delayed model may use any B <= n, as the
throughput model assumes (the small model runs eagerly, the large one waits for B).

`n` is the group's count of live requests, which the entry broadcasts; a stale count only delays a
launch until the update arrives (it is never needed for a message to arrive).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Mapping


class LaunchPolicy(ABC):
    """Decides whether a step launches now.

    Called with the number of requests ready on this model and the number of live requests this
    scheduler knows of (ready, PENDING at a peer, or waiting). In a routed group the subserver sets
    `group_active`, the group-wide live count, which then takes precedence.
    """

    group_active: int | None = None

    @abstractmethod
    def should_launch(self, num_ready: int, num_active: int) -> bool: ...


class EagerLaunch(LaunchPolicy):
    """Launch whenever anything is ready (B = 1)."""

    def should_launch(self, num_ready: int, num_active: int) -> bool:
        return num_ready > 0


class Thresholds:
    """B as a function of the live count n: a table {n: B}. n between keys takes the nearest lower
    key, n below every key launches eagerly (B = 1), and B never exceeds n."""

    def __init__(self, table: Mapping[int, int] | int) -> None:
        items = {1: table} if isinstance(table, int) else {int(k): int(v) for k, v in table.items()}
        if not items or any(n < 1 or b < 1 for n, b in items.items()):
            raise ValueError(f"thresholds need n >= 1 and B >= 1, got {dict(items)}")
        self._keys = sorted(items)
        self._values = [items[k] for k in self._keys]

    def __call__(self, n: int) -> int:
        if n < 1:
            return 1
        i = bisect.bisect_right(self._keys, n) - 1
        if i < 0:
            return 1  # below the table: launch eagerly
        return max(1, min(self._values[i], n))

    def as_dict(self) -> dict[int, int]:
        return dict(zip(self._keys, self._values))


class ThresholdLaunch(LaunchPolicy):
    """Launch when num_ready >= B(n), n the live requests of the group (or of this scheduler alone)."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds

    def should_launch(self, num_ready: int, num_active: int) -> bool:
        n = self.group_active if self.group_active is not None else num_active
        return num_ready > 0 and num_ready >= self.thresholds(max(n, num_ready))


def check_deadlock_free(per_model: Mapping[str, Thresholds], n_max: int) -> None:
    """Raise ValueError unless sum_m (B_m(n) - 1) <= n - 1 for every n in 1..n_max."""
    for n in range(1, n_max + 1):
        slack = sum(t(n) - 1 for t in per_model.values())
        if slack > n - 1:
            detail = ", ".join(f"{m}: B={t(n)}" for m, t in per_model.items())
            raise ValueError(f"launch thresholds can deadlock at {n} live requests ({detail}): "
                             f"the sum of (B - 1) over models must be at most {n - 1}")

"""The endurance governor: moves theta_E online so SSD writes track a DWPD budget.

Paper §5.2 shows that the theta_E meeting a write budget depends on the workload, the model and
the load, which change while a cache runs. The governor closes the loop: every ``interval_s``
seconds (of the caller's clock: wall time for an engine, the logical clock for a replay) it

* updates the recent write rate, an exponential average of completed SSD write bytes per second
  over ``window_s``;
* computes the rate it should aim for: the budget rate plus whatever the cache is behind (or
  minus what it is ahead of) the budget accrued since the first update, paid back over one
  ``window_s`` (so early unspent budget, e.g. while DRAM is still filling and nothing is evicted,
  is spent later, and an overshoot is paid back);
* raises theta_E by one when the recent rate exceeds that aim by more than ``deadband``, lowers it
  by one when it is more than ``deadband`` below, within ``[theta_min, theta_max]``.

Deterministic: the same ``update`` calls give the same thresholds. theta_E only moves the
eviction branch of admission (Eq. 1); writes through the reuse branch (theta_R) and writes already
in flight are not its to stop, so a budget below what they write is not reachable (the governor
then sits at ``theta_max``).
"""

from __future__ import annotations

import math

from saria.config import WriteBudget

__all__ = ["EnduranceGovernor"]


class EnduranceGovernor:
    """Holds SSD writes at ``budget_bytes_per_s`` by adjusting theta_E (see the module docstring).

    ``history``: ``(time, theta_E)`` at the first update and at every change, for reports.
    """

    __slots__ = ("budget", "theta_E", "theta_min", "theta_max", "interval_s", "window_s", "deadband",
                 "rate", "history", "_start", "_last_time", "_last_bytes")

    def __init__(self, budget_bytes_per_s: float, theta_E: int, *, theta_min: int = 1, theta_max: int = 16,
                 interval_s: float = 60.0, window_s: float = 1800.0, deadband: float = 0.1) -> None:
        if not (isinstance(budget_bytes_per_s, (int, float)) and math.isfinite(budget_bytes_per_s)
                and budget_bytes_per_s > 0):
            raise ValueError(f"the write budget must be a positive number of bytes/s, got {budget_bytes_per_s!r}")
        if not 1 <= theta_min <= theta_max:
            raise ValueError(f"need 1 <= theta_min <= theta_max, got {theta_min}, {theta_max}")
        if not (interval_s > 0 and window_s > 0 and 0 <= deadband < 1):
            raise ValueError(f"need interval_s > 0, window_s > 0, 0 <= deadband < 1; got {interval_s}, "
                             f"{window_s}, {deadband}")
        self.budget = float(budget_bytes_per_s)
        self.theta_E = min(max(int(theta_E), theta_min), theta_max)
        self.theta_min = theta_min
        self.theta_max = theta_max
        self.interval_s = interval_s
        self.window_s = window_s
        self.deadband = deadband
        self.rate = 0.0  # recent write rate, bytes/s
        self.history: list[tuple[float, int]] = []
        self._start: float | None = None
        self._last_time = 0.0
        self._last_bytes = 0

    @classmethod
    def from_config(cls, budget: WriteBudget, budget_bytes_per_s: float, theta_E: int) -> EnduranceGovernor:
        return cls(budget_bytes_per_s, theta_E, theta_min=budget.theta_min, theta_max=budget.theta_max,
                   interval_s=budget.interval_s, window_s=budget.window_s)

    def update(self, now: float, written_bytes: int) -> int:
        """Take the cumulative completed SSD write bytes at time ``now`` (seconds, never running
        backwards); returns theta_E to use from now on. Cheap between steps."""
        if self._start is None:
            self._start = self._last_time = now
            self._last_bytes = written_bytes
            self.history.append((now, self.theta_E))
            return self.theta_E
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return self.theta_E
        # Exponential average over window_s, exact for any step length.
        weight = 1.0 - math.exp(-elapsed / self.window_s)
        self.rate += weight * ((written_bytes - self._last_bytes) / elapsed - self.rate)
        self._last_time, self._last_bytes = now, written_bytes
        behind = self.budget * (now - self._start) - written_bytes  # > 0: under budget so far
        aim = max(0.0, self.budget + behind / self.window_s)
        theta = self.theta_E
        if self.rate > aim * (1.0 + self.deadband) and theta < self.theta_max:
            theta += 1
        elif self.rate < aim * (1.0 - self.deadband) and theta > self.theta_min:
            theta -= 1
        if theta != self.theta_E:
            self.theta_E = theta
            self.history.append((now, theta))
        return theta

"""The endurance governor: moves theta_E online so SSD writes track a DWPD budget.

Paper §5.2 shows that the theta_E meeting a write budget depends on the workload, the model and
the load, which change while a cache runs. The governor closes the loop on a fractional theta_E
(admission then interpolates between integer thresholds chunk by chunk, see
``saria.control.admission``). Every ``interval_s`` seconds (of the caller's clock: wall time for
an engine, the logical clock for a replay) it

* updates the recent write rate: completed SSD write bytes per second, averaged exponentially over
  ``window_s``;
* computes the rate to aim for: the budget rate, corrected by what the cache is behind (or ahead
  of) the budget accrued since the first update, paid back over ``payback_s``; the correction is
  bounded to ``max_correction`` of the budget, so an early unspent budget (DRAM still filling,
  nothing evicted) is spent later without writing everything, and an overshoot is paid back
  without shutting admission off;
* scales theta_E by ``(rate / aim) ** (gain * interval / window_s)`` (writes fall roughly as
  1 / theta_E; the exponent keeps the correction as slow as the average it reads), at most by
  ``max_step`` either way, within ``[theta_min, theta_max]``; inside the ``deadband`` it holds.

Until the first byte is written (nothing evicted yet) it holds its starting theta_E.
Deterministic: the same ``update`` calls give the same thresholds.

Limits (measured with ``saria replay``, see the README): theta_E moves only the eviction branch of
admission (Eq. 1), so writes by the reuse branch (theta_R) are not its to stop, and a budget below
them is out of reach, as is one above what theta_E = 1 writes; a workload that winds down at the
end of a replay leaves budget it cannot spend.
"""

from __future__ import annotations

import math

from saria.config import WriteBudget

__all__ = ["EnduranceGovernor"]

MAX_RATIO = 1e3  # the write-rate error is read within [1e-3, 1e3] of the aim
MAX_GAIN = 100.0  # MAX_RATIO ** MAX_GAIN stays a finite float


class EnduranceGovernor:
    """Holds SSD writes at ``budget_bytes_per_s`` by adjusting a fractional theta_E (see the module
    docstring). ``rate``: the recent write rate; ``history``: ``(time, theta_E)`` at the first update
    and at every change."""

    __slots__ = ("budget", "theta_E", "theta_min", "theta_max", "interval_s", "window_s", "payback_s", "deadband",
                 "max_correction", "gain", "max_step", "rate", "history", "_start", "_last_time", "_last_bytes",
                 "_measured")

    def __init__(self, budget_bytes_per_s: float, theta_E: float, *, theta_min: float = 1.0,
                 theta_max: float = 16.0, interval_s: float = 900.0, window_s: float = 10_800.0,
                 payback_s: float = 10_800.0,
                 deadband: float = 0.05, max_correction: float = 0.5, gain: float = 2.0,
                 max_step: float = 1.5) -> None:
        if not (isinstance(budget_bytes_per_s, (int, float)) and math.isfinite(budget_bytes_per_s)
                and budget_bytes_per_s > 0):
            raise ValueError(f"the write budget must be a positive number of bytes/s, got {budget_bytes_per_s!r}")
        if not 1 <= theta_min <= theta_max < math.inf:
            raise ValueError(f"need 1 <= theta_min <= theta_max < inf, got {theta_min}, {theta_max}")
        if not (interval_s > 0 and window_s > 0 and payback_s > 0 and 0 <= deadband < 1
                and 0 <= max_correction < 1 and 0 < gain <= MAX_GAIN and max_step > 1):
            raise ValueError(f"need interval_s, window_s, payback_s > 0, 0 <= deadband < 1, 0 <= max_correction < 1, "
                             f"0 < gain <= {MAX_GAIN}, max_step > 1; got {interval_s}, {window_s}, {payback_s}, "
                             f"{deadband}, {max_correction}, {gain}, {max_step}")
        self.budget = float(budget_bytes_per_s)
        self.theta_E = float(min(max(theta_E, theta_min), theta_max))
        self.theta_min = float(theta_min)
        self.theta_max = float(theta_max)
        self.interval_s = interval_s
        self.window_s = window_s
        self.payback_s = payback_s
        self.deadband = deadband
        self.max_correction = max_correction
        self.gain = gain
        self.max_step = max_step
        self.rate = 0.0
        self.history: list[tuple[float, float]] = []
        self._start: float | None = None  # the first update: the budget accrues from there
        self._last_time = 0.0
        self._last_bytes = 0
        self._measured = False

    @classmethod
    def from_config(cls, budget: WriteBudget, budget_bytes_per_s: float, theta_E: float) -> EnduranceGovernor:
        return cls(budget_bytes_per_s, theta_E, theta_min=budget.theta_min, theta_max=budget.theta_max,
                   interval_s=budget.interval_s, window_s=budget.window_s, payback_s=budget.payback_s)

    def aim(self, now: float, written_bytes: int) -> float:
        """The write rate to aim for at ``now`` having written ``written_bytes`` in all."""
        if self._start is None:
            return self.budget
        behind = self.budget * (now - self._start) - written_bytes  # > 0: under budget so far
        low, high = self.budget * (1.0 - self.max_correction), self.budget * (1.0 + self.max_correction)
        return min(max(self.budget + behind / self.payback_s, low), high)

    def update(self, now: float, written_bytes: int) -> float:
        """Take the cumulative completed SSD write bytes at time ``now`` (seconds, never running
        backwards); returns theta_E to use from now on. Cheap between steps."""
        if self._start is None:
            self._start = self._last_time = now
            self._last_bytes = written_bytes
            self.history.append((now, self.theta_E))
        if written_bytes == 0:  # nothing evicted and written yet: nothing to judge
            self._last_time = now
            return self.theta_E
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return self.theta_E
        recent = (written_bytes - self._last_bytes) / elapsed
        if not self._measured:  # the first interval with writes: the average starts there
            self._measured = True
            self.rate = recent
        else:  # exponential average over window_s, exact for any step length
            self.rate += (1.0 - math.exp(-elapsed / self.window_s)) * (recent - self.rate)
        self._last_time, self._last_bytes = now, written_bytes
        aim = self.aim(now, written_bytes)
        ratio = self.rate / aim if aim > 0 else MAX_RATIO  # aim underflows only for budgets of ~1e-300 B/s
        if abs(ratio - 1.0) <= self.deadband:
            return self.theta_E
        # Correct the fraction ``gain`` of the (log) error per window_s: as slow as the rate it reads.
        # The error is read within [1/MAX_RATIO, MAX_RATIO]: beyond, the step is max_step anyway, and
        # a ratio of 1e300 (a budget of 1e-300 DWPD) must not overflow the power.
        factor = min(max(ratio, 1.0 / MAX_RATIO), MAX_RATIO) ** (self.gain * min(1.0, elapsed / self.window_s))
        factor = min(max(factor, 1.0 / self.max_step), self.max_step)
        theta = min(max(self.theta_E * factor, self.theta_min), self.theta_max)
        if theta != self.theta_E:
            self.theta_E = theta
            self.history.append((now, theta))
        return theta

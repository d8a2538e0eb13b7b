"""The endurance governor: moves theta_E (and theta_R with it) online so SSD writes track a DWPD budget.

Paper §5.2 shows that the theta_E meeting a write budget depends on the workload, the model and
the load, which change while a cache runs. The governor closes the loop on a fractional theta_E
(admission then interpolates between integer thresholds chunk by chunk, see
``saria.control.admission``); a policy's theta_R, when set, moves by the same factor
(``theta_R = theta_R0 * theta_E / theta_E0``, at least 1), so reuse-branch writes are governed too
and a budget below what the reuse branch alone writes is held. Every ``interval_s`` seconds (of the
caller's clock: wall time for an engine, the logical clock for a replay) it

* updates the recent write rate: completed SSD write bytes per second, averaged exponentially over
  ``window_s``;
* computes the rate to aim for: the budget rate, corrected by what the cache is behind (or ahead
  of) the budget accrued since the first update, paid back over ``payback_s``; the correction is
  bounded to ``-max_correction`` of the budget when ahead (an overshoot is paid back without
  shutting admission off) and to ``+max_catchup`` when behind (an unspent budget, DRAM still
  filling or a lull, is spent while there is something to write: a workload that winds down
  leaves little time to spend it later);
* scales theta_E by ``(rate / aim) ** (gain * interval / window_s)`` (writes fall roughly as
  1 / theta_E; the exponent keeps the correction as slow as the average it reads), with the faster
  ``gain_down`` when lowering it (spending is cheap to undo; tightening costs hits), at most by
  ``max_step`` either way, within ``[theta_min, theta_max]``; inside the ``deadband`` it holds.
  It also holds when the last interval alone is already on the other side of the aim (the
  average lags a step that worked), and, for ``window_s / 3`` after a raise, when the average has
  not fallen since that raise: near prefill saturation a higher theta_E costs hits, the
  recomputation queues and stretches sessions into more evictions, so writes stop falling with
  theta_E, and raising it further only loses hits (the responsiveness check).

Until the first byte is written (nothing evicted yet) it holds its starting theta_E.
Deterministic: the same ``update`` calls give the same thresholds.

Limits (measured with ``saria replay``, see the README, Evidence item 5): a budget above what
theta_E = 1 (and the scaled theta_R) writes is out of reach, as is one below what
``theta_max`` writes; the governor cannot know the future, so a workload that winds down still
leaves some budget unspent (0.90 of it on the paper-scale ``synth``), and near prefill saturation
it trades a few points of CHAR against a fixed threshold that happens to meet the budget.
"""

from __future__ import annotations

import math

from saria.config import WriteBudget

__all__ = ["EnduranceGovernor"]

MAX_RATIO = 1e3  # the write-rate error is read within [1e-3, 1e3] of the aim
MAX_GAIN = 100.0  # MAX_RATIO ** MAX_GAIN stays a finite float
MAX_CATCHUP = 100.0  # the most the aim may exceed the budget by, as a multiple of it


class EnduranceGovernor:
    """Holds SSD writes at ``budget_bytes_per_s`` by adjusting a fractional theta_E, and theta_R with
    it (see the module docstring). ``rate``: the recent write rate; ``history``: ``(time, theta_E)``
    at the first update and at every change."""

    __slots__ = ("budget", "theta_E", "theta_R", "theta_min", "theta_max", "interval_s", "window_s", "payback_s",
                 "deadband", "max_correction", "max_catchup", "gain", "gain_down", "max_step", "rate", "history",
                 "_theta_E0", "_theta_R0", "_start", "_last_time", "_last_bytes", "_measured", "_raise_rate",
                 "_raise_time")

    def __init__(self, budget_bytes_per_s: float, theta_E: float, *, theta_R: float | None = None,
                 theta_min: float = 1.0, theta_max: float = 16.0, interval_s: float = 900.0,
                 window_s: float = 10_800.0, payback_s: float = 10_800.0, deadband: float = 0.05,
                 max_correction: float = 0.5, max_catchup: float = 1.0, gain: float = 1.5, gain_down: float = 4.0,
                 max_step: float = 1.5) -> None:
        if not (isinstance(budget_bytes_per_s, (int, float)) and math.isfinite(budget_bytes_per_s)
                and budget_bytes_per_s > 0):
            raise ValueError(f"the write budget must be a positive number of bytes/s, got {budget_bytes_per_s!r}")
        if not 1 <= theta_min <= theta_max < math.inf:
            raise ValueError(f"need 1 <= theta_min <= theta_max < inf, got {theta_min}, {theta_max}")
        if theta_R is not None and not 1 <= theta_R < math.inf:
            raise ValueError(f"need 1 <= theta_R < inf (or None), got {theta_R}")
        if not (interval_s > 0 and window_s > 0 and payback_s > 0 and 0 <= deadband < 1
                and 0 <= max_correction < 1 and 0 <= max_catchup <= MAX_CATCHUP and 0 < gain <= MAX_GAIN
                and 0 < gain_down <= MAX_GAIN and max_step > 1):
            raise ValueError(f"need interval_s, window_s, payback_s > 0, 0 <= deadband < 1, 0 <= max_correction < 1, "
                             f"0 <= max_catchup <= {MAX_CATCHUP}, 0 < gain, gain_down <= {MAX_GAIN}, max_step > 1; "
                             f"got {interval_s}, {window_s}, {payback_s}, {deadband}, {max_correction}, {max_catchup}, "
                             f"{gain}, {gain_down}, {max_step}")
        self.budget = float(budget_bytes_per_s)
        self.theta_E = float(min(max(theta_E, theta_min), theta_max))
        self.theta_min = float(theta_min)
        self.theta_max = float(theta_max)
        self._theta_E0 = self.theta_E
        self._theta_R0 = None if theta_R is None else float(theta_R)
        self.theta_R = self._scaled_R()
        self.interval_s = interval_s
        self.window_s = window_s
        self.payback_s = payback_s
        self.deadband = deadband
        self.max_correction = max_correction
        self.max_catchup = max_catchup
        self.gain = gain
        self.gain_down = gain_down
        self.max_step = max_step
        self.rate = 0.0
        self.history: list[tuple[float, float]] = []
        self._start: float | None = None  # the first update: the budget accrues from there
        self._last_time = 0.0
        self._last_bytes = 0
        self._measured = False
        self._raise_rate = math.inf  # the average rate when theta_E last rose (inf: no raise to judge)
        self._raise_time = -math.inf

    @classmethod
    def from_config(cls, budget: WriteBudget, budget_bytes_per_s: float, theta_E: float,
                    theta_R: float | None = None) -> EnduranceGovernor:
        return cls(budget_bytes_per_s, theta_E, theta_R=theta_R, theta_min=budget.theta_min,
                   theta_max=budget.theta_max, interval_s=budget.interval_s, window_s=budget.window_s,
                   payback_s=budget.payback_s)

    def _scaled_R(self) -> float:
        """theta_R moved by the factor theta_E moved (inf for a disabled reuse branch), at least 1."""
        if self._theta_R0 is None:
            return math.inf
        return max(1.0, self._theta_R0 * (self.theta_E / self._theta_E0))

    def aim(self, now: float, written_bytes: int) -> float:
        """The write rate to aim for at ``now`` having written ``written_bytes`` in all."""
        if self._start is None:
            return self.budget
        behind = self.budget * (now - self._start) - written_bytes  # > 0: under budget so far
        low, high = self.budget * (1.0 - self.max_correction), self.budget * (1.0 + self.max_catchup)
        return min(max(self.budget + behind / self.payback_s, low), high)

    def update(self, now: float, written_bytes: int) -> float:
        """Take the cumulative completed SSD write bytes at time ``now`` (seconds, never running
        backwards); returns theta_E to use from now on (``theta_R`` follows it). Cheap between steps."""
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
        if ratio > 1.0:
            if recent <= aim:  # the last interval is under the aim already: the average lags, wait
                return self.theta_E
            if self.rate >= self._raise_rate and now - self._raise_time < self.window_s / 3:
                return self.theta_E  # the last raise did not lower the rate: another would not either
            gain = self.gain
        else:
            if recent >= aim:  # the last interval is over the aim already
                return self.theta_E
            gain = self.gain_down  # spending what is left is cheap to undo: faster
        # Correct the fraction ``gain`` of the (log) error per window_s: as slow as the rate it reads.
        # The error is read within [1/MAX_RATIO, MAX_RATIO]: beyond, the step is max_step anyway, and
        # a ratio of 1e300 (a budget of 1e-300 DWPD) must not overflow the power.
        factor = min(max(ratio, 1.0 / MAX_RATIO), MAX_RATIO) ** (gain * min(1.0, elapsed / self.window_s))
        factor = min(max(factor, 1.0 / self.max_step), self.max_step)
        theta = min(max(self.theta_E * factor, self.theta_min), self.theta_max)
        if theta != self.theta_E:
            if theta > self.theta_E:
                self._raise_rate, self._raise_time = self.rate, now
            self.theta_E = theta
            self.theta_R = self._scaled_R()
            self.history.append((now, theta))
        return theta

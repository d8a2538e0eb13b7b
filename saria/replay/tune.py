"""``saria tune``: the admission thresholds that meet an SSD write budget with the best CHAR.

For each theta_R candidate (``None``: reuse branch off) the search walks a ladder of theta_E
values from the most writing (1) to the least (eviction branch off), and binary-searches the
first rung whose replay stays within the budget (``write_budget_ratio <= 1``). That rung has the
best coverage of the rungs that fit, because raising theta_E only takes writes (and hits) away;
the search relies on that monotonicity rather than replaying every rung (each probe is shown, so
a violation is visible). The searches for different theta_R run side by side, one round of
probes at a time, in parallel processes. Of the feasible candidates the best ``objective`` wins
(ties: the other CHAR, then fewer writes). With both branches off nothing is written, so a
feasible answer always exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from saria.replay.experiment import Experiment, Point
from saria.replay.policies import PolicySpec, parse_policy

__all__ = ["DEFAULT_THETA_E", "DEFAULT_THETA_R", "TuneResult", "tune"]

DEFAULT_THETA_E = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, None)
DEFAULT_THETA_R = (None, 4, 8, 16, 32)
OBJECTIVES = ("char_mean", "char_p25_bad")


@dataclass
class TuneResult:
    """Every probe (rows: ``theta_E``, ``theta_R``, ``feasible`` and the result record), and the
    best feasible row (``best``) with the policy spec that replays it."""

    rows: list[dict]
    best: dict
    spec: str


def _spec(base: PolicySpec, theta_E, theta_R) -> PolicySpec:
    overrides = dict(base.overrides)
    overrides.update(theta_E=theta_E, theta_R=theta_R)
    text = base.preset + ":" + ",".join(f"{k}={'none' if v is None else v}" for k, v in overrides.items())
    return parse_policy(text)


def tune(experiment: Experiment, base: PolicySpec, *, theta_E: tuple = DEFAULT_THETA_E,
         theta_R: tuple = DEFAULT_THETA_R, objective: str = "char_mean") -> TuneResult:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if base.write_budget:
        raise ValueError("tune searches fixed thresholds; leave write_budget=auto out of its policy")
    ladder = list(theta_E)
    if not ladder or not theta_R:
        raise ValueError("tune needs at least one theta_E and one theta_R value")
    if ladder[-1] is not None:
        ladder.append(None)  # branch off: the end of the ladder writes least
    # Per theta_R, the first feasible rung lies in [lo, hi]: every rung below lo was over budget,
    # and rung hi fits or is the last one (probed before the search ends).
    bounds = {r: (0, len(ladder) - 1) for r in theta_R}
    probed: dict[tuple, dict] = {}
    while True:
        probes = []
        for r, (lo, hi) in bounds.items():
            if lo < hi:
                probes.append((r, (lo + hi) // 2))
            elif lo == hi and (r, lo) not in probed:
                probes.append((r, lo))
        if not probes:
            break
        points = [Point(f"E{_v(ladder[i])} R{_v(r)}", _spec(base, ladder[i], r)) for r, i in probes]
        results, _ = experiment.run(points, desc="tune", references=False)
        for (r, i), result in zip(probes, results):
            probed[(r, i)] = result
            lo, hi = bounds[r]
            bounds[r] = (lo, i) if result["write_budget_ratio"] <= 1.0 else (i + 1, hi)  # lo > hi: none fits
    rows = []
    for (r, i), result in sorted(probed.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1])):
        rows.append({"theta_E": _v(ladder[i]), "theta_R": _v(r), "feasible": result["write_budget_ratio"] <= 1.0,
                     **result})
    feasible = [row for row in rows if row["feasible"]]
    if not feasible:
        raise ValueError("no probed setting meets the write budget (reuse-branch writes alone exceed it?); "
                         "add theta_R none to the candidates")
    other = "char_p25_bad" if objective == "char_mean" else "char_mean"
    best = max(feasible, key=lambda row: (_score(row[objective]), _score(row[other]), -row["ssd_write_bytes"]))
    spec = f"{base.preset}:" + ",".join(
        [f"{k}={'none' if v is None else v}" for k, v in base.overrides if k not in ("theta_E", "theta_R")]
        + [f"theta_E={best['theta_E']}", f"theta_R={best['theta_R']}"])
    return TuneResult(rows, best, spec)


def _v(value) -> str:
    return "none" if value is None else str(value)


def _order(value) -> float:
    return float("inf") if value is None else value


def _score(value) -> float:
    return float("-inf") if value is None or value != value else value

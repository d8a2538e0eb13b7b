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

A policy with the ``learned`` rule (``saria:admission=eq1&learned+deferred``) keeps its theta_E and
searches ``learned_tau`` instead, on the ladder :data:`DEFAULT_TAU` from the most writing (0.02)
to the least (0.98): with either join a higher tau admits fewer chunks. The answer then need not
exist (Eq. 1's own writes under ``|``), which is said.
"""

from __future__ import annotations

from dataclasses import dataclass

from saria.config import Policy, admission_rules
from saria.replay.experiment import Experiment, Point
from saria.replay.policies import PolicySpec, parse_policy

__all__ = ["DEFAULT_TAU", "DEFAULT_THETA_E", "DEFAULT_THETA_R", "TuneResult", "tune"]

DEFAULT_THETA_E = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, None)
DEFAULT_TAU = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
DEFAULT_THETA_R = (None, 4, 8, 16, 32)
OBJECTIVES = ("char_mean", "char_p25_bad")


@dataclass
class TuneResult:
    """Every probe (rows: ``theta_E``, ``theta_R``, ``feasible`` and the result record), and the
    best feasible row (``best``) with the policy spec that replays it."""

    rows: list[dict]
    best: dict
    spec: str


def _spec(base: PolicySpec, theta_E, theta_R, key: str = "theta_E") -> PolicySpec:
    overrides = dict(base.overrides)
    overrides.update({key: theta_E, "theta_R": theta_R})
    text = base.preset + ":" + ",".join(f"{k}={'none' if v is None else v}" for k, v in overrides.items())
    return parse_policy(text)


def tune(experiment: Experiment, base: PolicySpec, *, theta_E: tuple = DEFAULT_THETA_E,
         theta_R: tuple = DEFAULT_THETA_R, objective: str = "char_mean") -> TuneResult:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if base.write_budget:
        raise ValueError("tune searches fixed thresholds; leave write_budget=auto out of its policy")
    learned = "learned" in admission_rules(Policy.preset(base.preset, **dict(base.overrides)).admission)
    key = "learned_tau" if learned else "theta_E"
    if learned:
        if theta_E is not DEFAULT_THETA_E:
            raise ValueError("a policy with the learned rule tunes learned_tau (--theta-e does not apply: set theta_E "
                             "in the policy)")
        ladder = list(DEFAULT_TAU)
    else:
        ladder = list(theta_E)
    if not ladder or not theta_R:
        raise ValueError("tune needs at least one theta_E and one theta_R value")
    if ladder[-1] is not None and not learned:
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
        points = [Point(f"{'tau' if learned else 'E'}{_v(ladder[i])} R{_v(r)}", _spec(base, ladder[i], r, key))
                  for r, i in probes]
        results, _ = experiment.run(points, desc="tune", references=False)
        for (r, i), result in zip(probes, results):
            probed[(r, i)] = result
            lo, hi = bounds[r]
            bounds[r] = (lo, i) if result["write_budget_ratio"] <= 1.0 else (i + 1, hi)  # lo > hi: none fits
    rows = []
    for (r, i), result in sorted(probed.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1])):
        theta = dict(base.overrides).get("theta_E", Policy.preset(base.preset).theta_E) if learned else ladder[i]
        row = {"theta_E": _v(theta), "theta_R": _v(r)}
        if learned:
            row["learned_tau"] = ladder[i]
        rows.append({**row, "feasible": result["write_budget_ratio"] <= 1.0, **result})
    feasible = [row for row in rows if row["feasible"]]
    if not feasible:
        if learned:
            raise ValueError(f"no learned_tau up to {ladder[-1]} meets the write budget (with eq1|learned, Eq. 1's "
                             f"own writes alone may exceed it: try eq1&learned, or a higher theta_E)")
        raise ValueError("no probed setting meets the write budget (reuse-branch writes alone exceed it?); "
                         "add theta_R none to the candidates")
    other = "char_p25_bad" if objective == "char_mean" else "char_mean"
    best = max(feasible, key=lambda row: (_score(row[objective]), _score(row[other]), -row["ssd_write_bytes"]))
    spec = f"{base.preset}:" + ",".join(
        [f"{k}={'none' if v is None else v}" for k, v in base.overrides if k not in ("theta_E", "theta_R", key)]
        + [f"theta_E={best['theta_E']}", f"theta_R={best['theta_R']}"]
        + ([f"learned_tau={best['learned_tau']}"] if learned else []))
    return TuneResult(rows, best, spec)


def _v(value) -> str:
    return "none" if value is None else str(value)


def _order(value) -> float:
    return float("inf") if value is None else value


def _score(value) -> float:
    return float("-inf") if value is None or value != value else value

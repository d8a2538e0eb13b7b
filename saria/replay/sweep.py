"""Threshold sweeps (paper Figures 10, 11, 13): replay a policy over a grid of theta_E, theta_R, r
and session-start windows, plus reference policies, and report the write / coverage / latency trade-off.

The grid is the product of the given value lists (a list left empty keeps the policy's value, or
the experiment's window). In the rows and the plot, the first swept dimension with several values
names each point ("E2", "R8", "r0.4", "w4h") and the other swept values name its series.
Reference policies (by default ``full-duplicate``) are series of their own, replayed in every
swept window.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from saria.replay.experiment import Experiment, Point
from saria.replay.policies import PolicySpec, parse_policy

__all__ = ["SweepGrid", "run_sweep"]

# (grid field, label prefix); the last is the session-start window, not a policy setting.
DIMENSIONS = (("theta_E", "E"), ("theta_R", "R"), ("r", "r"), ("window_hours", "w"))
_KEEP = object()  # a dimension that is not swept


def _name(key: str, prefix: str, value) -> str:
    if key == "window_hours":
        return f"w{value:g}h"
    if value is None:
        return f"{prefix}-off" if key != "r" else "r-auto"
    return f"{prefix}{value:g}"


def _cell(value) -> str:
    """A swept value in the CSV: empty when not swept, ``none`` for a disabled branch / auto r."""
    if value is _KEEP:
        return ""
    return "none" if value is None else f"{value:g}"


@dataclass(frozen=True)
class SweepGrid:
    """Value lists per dimension. ``None`` in theta_E / theta_R disables that admission branch;
    in r it means r* (automatic)."""

    theta_E: tuple = ()
    theta_R: tuple = ()
    r: tuple = ()
    window_hours: tuple = ()

    def points(self, base: PolicySpec) -> list[tuple[Point, dict]]:
        """Every grid point as a replay and its row fields (series, point, swept values)."""
        lists = [tuple(getattr(self, key)) or (_KEEP,) for key, _ in DIMENSIONS]
        varying = [i for i, values in enumerate(lists) if len(values) > 1]
        point_dim = varying[0] if varying else None
        out = []
        for combo in itertools.product(*lists):
            overrides = dict(base.overrides)
            names, others = [], []
            for i, ((key, prefix), value) in enumerate(zip(DIMENSIONS, combo)):
                if value is _KEEP:
                    continue
                if key != "window_hours":
                    overrides[key] = value
                names.append(_name(key, prefix, value))
                if i != point_dim:
                    others.append(names[-1])
            label = " ".join([base.label] + names)
            spec = parse_policy(_spec_text(base.preset, overrides, base.write_budget))
            spec = PolicySpec(label, spec.preset, spec.overrides, spec.write_budget)
            window = None if combo[3] is _KEEP else combo[3]
            row = {"series": " ".join([base.label] + others),
                   "point": _name(*DIMENSIONS[point_dim], combo[point_dim]) if point_dim is not None else base.label,
                   **{key: _cell(value) for (key, _), value in zip(DIMENSIONS, combo)}}
            out.append((Point(label, spec, window), row))
        return out


def _spec_text(preset: str, overrides: dict, write_budget: bool | None) -> str:
    items = [f"{k}={'none' if v is None else v}" for k, v in overrides.items()]
    if write_budget is not None:
        items.append(f"write_budget={'auto' if write_budget else 'off'}")
    return preset + (":" + ",".join(items) if items else "")


def run_sweep(experiment: Experiment, base: PolicySpec, grid: SweepGrid, references: list[PolicySpec]) -> list[dict]:
    """Replay the grid and the references (in every swept window); one row per replay: series,
    point, swept values, then the result record (``saria replay --json``'s)."""
    planned = grid.points(base)
    windows = list(grid.window_hours) or [None]
    for ref in references:
        for window in windows:
            label = ref.label if window is None else f"{ref.label} w{window:g}h"
            planned.append((Point(label, ref, window),
                            {"series": f"{ref.label} (reference)", "point": ref.label if window is None
                             else f"w{window:g}h", "theta_E": "", "theta_R": "", "r": "",
                             "window_hours": _cell(_KEEP if window is None else window)}))
    results, _ = experiment.run([point for point, _ in planned], desc="sweep")
    return [{**row, **result} for (_, row), result in zip(planned, results)]

"""Training the ``learned`` admission rule offline: labels from replays, a model, a held-out split.

* :func:`collect` replays one trace under one policy with the oracle's labeler on
  (:mod:`saria.replay.labels`) and returns its labelled evictions;
* :func:`fit` trains a :class:`~saria.control.learned.TreeModel` on the deciding evictions of
  several such replays (the oracle's labels, or Baleen-style episodes within a write budget);
* :func:`time_half` cuts a trace in two by recorded time (the first half trains, the second is
  held out), whole sessions on the side where they start.

``bench/bench_learned.py`` trains the shipped model and writes the held-out table with these.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from saria.control.learned import TreeModel, choose_tau, train_model
from saria.replay.experiment import Experiment
from saria.replay.labels import EvictionLabels, episode_labels
from saria.replay.policies import BaseSettings, build_config, parse_policy
from saria.replay.replay import ReplaySettings, replay
from saria.replay.traces import Trace

__all__ = ["LABEL_KINDS", "collect", "fit", "time_half"]

LABEL_KINDS = ("oracle", "episodes")


def time_half(trace: Trace, half: int) -> Trace:
    """The requests of ``trace`` whose session (a request without one is its own) starts in the
    first (``half`` 0) or second (1) half of the recorded time span."""
    if half not in (0, 1):
        raise ValueError(f"half must be 0 or 1, got {half!r}")
    requests = trace.requests
    if not requests:
        return trace
    first, last = requests[0].arrival_s, requests[-1].arrival_s
    middle = first + (last - first) / 2.0
    starts: dict = {}
    for r in requests:
        if r.session is not None:
            starts.setdefault(r.session, r.arrival_s)
    kept = tuple(r for r in requests
                 if ((starts[r.session] if r.session is not None else r.arrival_s) >= middle) == bool(half))
    return replace(trace, requests=kept, name=f"{trace.name} ({'second' if half else 'first'} half)")


def collect(trace: Trace, name: str, base: BaseSettings, *, policy: str = "saria", arrivals: str = "rewindow",
            settings: ReplaySettings = ReplaySettings(), seed: int = 0) -> EvictionLabels:
    """Replay ``trace`` under ``policy`` with the oracle's labeler; its labelled evictions."""
    exp = Experiment(trace, name, base, settings, arrivals=arrivals, seed=seed, workers=1, progress=False)
    config = build_config(parse_policy(policy), base)
    run = replay(policy, exp.trace, exp.chunks, exp.schedule(None), config, settings, labels=True)
    return run.labels


def fit(sets: Sequence[EvictionLabels], *, kind: str = "oracle", budget_fraction: float = 0.5,
        note: str = "", **params) -> TreeModel:
    """A model of the deciding evictions of ``sets``: ``kind`` ``oracle`` labels each as the
    oracle would; ``episodes`` admits per set the best reuses per byte until ``budget_fraction``
    of the bytes the oracle's positives would write. Each set weighs the same in training
    (weights 1 / its deciding evictions), so a long trace does not drown a short one. The model
    carries thresholds :func:`~saria.control.learned.choose_tau` picks on the same labels, ones
    that hold on every set: for AND the lowest any set needs, for OR the highest."""
    if kind not in LABEL_KINDS:
        raise ValueError(f"label kind must be one of {LABEL_KINDS}, got {kind!r}")
    rows: list = []
    labels: list = []
    weights: list = []
    parts: list[tuple[int, int]] = []  # each set's rows
    for labelled in sets:
        if kind == "episodes":
            budget = budget_fraction * labelled.ssd_kv_bytes * sum(
                1 for y, d in zip(labelled.labels, labelled.decides) if y and d)
            chosen = episode_labels(labelled, budget)
        else:
            chosen = labelled.labels
        keep = [i for i, d in enumerate(labelled.decides) if d]
        if not keep:
            continue
        parts.append((len(rows), len(rows) + len(keep)))
        rows += [labelled.rows[i] for i in keep]
        labels += [chosen[i] for i in keep]
        weights += [1.0 / len(keep)] * len(keep)
    scale = len(weights) / max(sum(weights), 1e-12)
    weights = [w * scale for w in weights]
    model = train_model(rows, labels, weights=weights, note=note, **params)
    # Thresholds that hold on every training replay: AND keeps the recall on each (the lowest tau
    # any needs), OR the precision on each (the highest).
    taus = [choose_tau(model, rows[a:b], labels[a:b]) for a, b in parts if any(labels[a:b])]
    model.data["tau"] = dict(taus[0], **{"and": min(t["and"] for t in taus), "or": max(t["or"] for t in taus)}) \
        if taus else choose_tau(model, rows, labels, weights)
    return model

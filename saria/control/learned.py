"""The ``learned`` admission rule: a gradient-boosted tree model of the oracle's labels, joined to
Eq. 1 (``eq1&learned``: both must admit; ``eq1|learned``: either).

Three parts, all torch-free and (but for training) free of LightGBM:

* :class:`~saria.control.features.FeatureTracker` (its own module) keeps, per chunk, what Eq. 1 does not (the previous eviction's time and
  ``R_b`` then, two decayed reference counts, the gap between its last two references, how many
  sessions it passed between) and turns a chunk at a DRAM eviction into :data:`FEATURES`, every
  one known online at that moment (nothing about the future).
* :class:`TreeModel` is a trained model as plain data (``learned_model.json`` beside this module
  ships one): its trees (``[feature, threshold, left, right]`` nodes, float leaves, LightGBM's
  ``x <= threshold`` goes left), the features it expects (:data:`FEATURE_VERSION`) and the range
  each feature had in training. It is compiled once into one Python function of nested
  comparisons, so scoring an eviction costs a few microseconds and needs no LightGBM.
* :class:`LearnedRule` decides: admit when the model's probability passes ``Policy.learned_tau``
  (compared as a margin, ``log(tau / (1 - tau))``). While more than :data:`DRIFT_LIMIT` of recent
  scored evictions (an exponential average over about 256) have a feature off its training
  range (by more than the range's width), the rule steps aside and Eq. 1 decides alone (counted in ``Counters.learned_fallbacks``).
  With ``Policy.learned_retrain_s`` it also labels its own evictions online (a chunk referenced
  again within the SSD's retention at its eviction is a positive, one whose horizon passed a
  negative: the oracle's label, known once its horizon has passed), keeps the latest
  :data:`LABEL_WINDOW` labels and retrains every ``learned_retrain_s`` seconds of the control
  plane's clock (:func:`train_model`, LightGBM; the ``learn`` extra).

A model's probability is of the oracle's label (:mod:`saria.replay.labels`): a later request
references the chunk within the SSD's current retention.
"""

from __future__ import annotations

import json
import math
from collections import deque
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

from saria.control.features import FEATURE_VERSION, FEATURES, PENDING, FeatureTracker

__all__ = ["DRIFT_LIMIT", "FEATURES", "FEATURE_VERSION", "FeatureTracker", "LABEL_WINDOW", "LearnedRule",
           "MODEL_FORMAT", "TreeModel", "choose_tau", "lightgbm_missing", "shipped_model", "train_model"]

MODEL_FORMAT = "saria-learned-admission"
DRIFT_LIMIT = 0.5  # share of recent scored evictions off the training range above which Eq. 1 decides alone
_DRIFT_WEIGHT = 1.0 / 256
LABEL_WINDOW = 50_000  # online retraining keeps this many latest labels
MIN_TRAIN_ROWS = 200


def lightgbm_missing() -> str | None:
    """None when LightGBM imports, else the one line that says how to get it."""
    try:
        import lightgbm  # noqa: F401
    except ImportError:
        return ("the learned admission rule trains with LightGBM, which is not installed: "
                "pip install 'saria[learn]' (lightgbm==4.7.0)")
    return None



class TreeModel:
    """A trained model as plain data (see the module docstring), compiled for scoring."""

    def __init__(self, data: dict) -> None:
        if not isinstance(data, dict) or data.get("format") != MODEL_FORMAT:
            raise ValueError(f"not a saria learned-admission model (format {MODEL_FORMAT!r})")
        if data.get("feature_version") != FEATURE_VERSION or list(data.get("features", ())) != list(FEATURES):
            raise ValueError(f"the model expects features version {data.get('feature_version')!r} "
                             f"({data.get('features')!r}); this saria computes version {FEATURE_VERSION} "
                             f"({list(FEATURES)}): retrain it")
        trees = data.get("trees")
        ranges = data.get("ranges")
        if not isinstance(trees, list) or not trees or not isinstance(ranges, list) or len(ranges) != len(FEATURES):
            raise ValueError("a learned-admission model needs a non-empty list of trees and one [lo, hi] range "
                             "per feature")
        self.data = data
        self.trees = trees
        # Off the training range: beyond its [lo, hi] by more than its width (a count twice the
        # largest seen in training still reads as the largest; a wholly new regime does not).
        self.lo = [2.0 * float(lo) - float(hi) for lo, hi in ranges]
        self.hi = [2.0 * float(hi) - float(lo) for lo, hi in ranges]
        self.margin = _compile(trees, float(data.get("base", 0.0)))
        self.off_range = _compile_range(self.lo, self.hi)

    @classmethod
    def load(cls, path: str | Path) -> TreeModel:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"learned admission model {str(path)!r}: {exc}") from None
        try:
            return cls(data)
        except ValueError as exc:
            raise ValueError(f"learned admission model {str(path)!r}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.data, separators=(",", ":")) + "\n")

    def decider(self, threshold: float) -> Callable[[Sequence[float]], bool]:
        """``margin(features) >= threshold``, compiled to stop at the first tree that settles it."""
        return _compile(self.trees, float(self.data.get("base", 0.0)), threshold)

    def tau(self, join: str) -> float:
        """The threshold this model was shipped with for ``join`` (``"and"`` / ``"or"``; chosen on
        its training labels, see :func:`choose_tau`), 0.5 where it carries none."""
        tau = self.data.get("tau", {}).get(join, 0.5)
        return float(tau) if isinstance(tau, (int, float)) and 0.0 < tau < 1.0 else 0.5

    def probability(self, features: Sequence[float]) -> float:
        return 1.0 / (1.0 + math.exp(-self.margin(features)))

    def off_range_slow(self, features: Sequence[float]) -> bool:
        """Whether any feature lies off the range it had in training ``[lo, hi]`` by more than
        ``hi - lo`` (a feature that was constant in training: off any other value). ``off_range``
        is the same test compiled."""
        for x, lo, hi in zip(features, self.lo, self.hi):
            if x < lo or x > hi:
                return True
        return False


def _leaves(node) -> list[float]:
    return [float(node)] if not isinstance(node, list) else _leaves(node[2]) + _leaves(node[3])


def _compile(trees: list, base: float, threshold: float | None = None) -> Callable[[Sequence[float]], float]:
    """One Python function: the sum of every tree's leaf for ``features``, plus ``base``; with a
    ``threshold``, whether that sum reaches it, returning as soon as the trees left cannot change
    the answer (their largest and smallest leaves, summed, with 1e-9 to spare)."""
    name = "margin" if threshold is None else "decide"
    lines = [f"def {name}(f):", f"    {', '.join(f'f{i}' for i in range(len(FEATURES)))}, = f",
             f"    s = {base!r}"]
    if threshold is not None:
        highs = [max(_leaves(t)) for t in trees]
        lows = [min(_leaves(t)) for t in trees]

    def emit(node, indent: str) -> None:
        if not isinstance(node, list):
            lines.append(f"{indent}s += {float(node)!r}")
            return
        feature, threshold, left, right = node
        if not (isinstance(feature, int) and 0 <= feature < len(FEATURES)):
            raise ValueError(f"a tree splits on feature {feature!r}, not one of the {len(FEATURES)}")
        lines.append(f"{indent}if f{feature} <= {float(threshold)!r}:")
        emit(left, indent + "    ")
        lines.append(f"{indent}else:")
        emit(right, indent + "    ")

    for k, tree in enumerate(trees):
        emit(tree, "    ")
        if threshold is not None and k + 1 < len(trees):
            most, least = sum(highs[k + 1:]), sum(lows[k + 1:])
            lines.append(f"    if s < {threshold - most - 1e-9!r}:")
            lines.append("        return False")
            lines.append(f"    if s >= {threshold - least + 1e-9!r}:")
            lines.append("        return True")
    lines.append("    return s" if threshold is None else f"    return s >= {threshold!r}")
    namespace: dict = {}
    exec(compile("\n".join(lines), "<saria learned model>", "exec"), namespace)  # noqa: S102 (our own numbers)
    return namespace[name]


def _compile_range(lo: list[float], hi: list[float]) -> Callable[[Sequence[float]], bool]:
    """One Python function: whether any of ``features`` lies outside ``[lo, hi]``."""
    names = ", ".join(f"f{i}" for i in range(len(FEATURES)))
    tests = " or ".join(f"not ({a!r} <= f{i} <= {b!r})" for i, (a, b) in enumerate(zip(lo, hi)))
    namespace: dict = {}
    exec(compile(f"def off_range(f):\n    {names}, = f\n    return {tests}\n", "<saria learned range>", "exec"),
         namespace)  # noqa: S102 (our own numbers)
    return namespace["off_range"]


def shipped_model() -> TreeModel:
    """The model shipped with saria (``saria/control/learned_model.json``)."""
    text = resources.files("saria.control").joinpath("learned_model.json").read_text()
    return TreeModel(json.loads(text))


def _tree_of(node: dict):
    if "leaf_value" in node:
        return float(node["leaf_value"])
    if node.get("decision_type", "<=") != "<=":
        raise ValueError(f"unexpected LightGBM split {node.get('decision_type')!r}")
    return [int(node["split_feature"]), float(node["threshold"]), _tree_of(node["left_child"]),
            _tree_of(node["right_child"])]


def train_model(rows: Sequence[Sequence[float]], labels: Sequence[int], *, rounds: int = 40, leaves: int = 15,
                min_leaf: int = 50, weights: Sequence[float] | None = None, note: str = "") -> TreeModel:
    """A LightGBM binary classifier of ``labels`` on ``rows`` (:data:`FEATURES`), one thread,
    deterministic, as a :class:`TreeModel`. Needs LightGBM (the ``learn`` extra)."""
    missing = lightgbm_missing()
    if missing:
        raise RuntimeError(missing)
    import lightgbm
    import numpy as np

    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or len(y) != len(x):
        raise ValueError(f"train_model needs rows of {len(FEATURES)} features and one label each, got "
                         f"{x.shape} and {len(y)}")
    if len(y) < 2 or y.min() == y.max():
        raise ValueError("train_model needs both labels among its rows")
    params = {"objective": "binary", "num_leaves": leaves, "learning_rate": 0.1, "min_data_in_leaf": min_leaf,
              "num_threads": 1, "deterministic": True, "force_row_wise": True, "seed": 0, "verbose": -1,
              "use_missing": False, "feature_fraction": 1.0, "bagging_fraction": 1.0}
    dataset = lightgbm.Dataset(x, y, weight=None if weights is None else np.asarray(weights, dtype=np.float64),
                               feature_name=list(FEATURES), free_raw_data=True)
    booster = lightgbm.train(params, dataset, num_boost_round=rounds)
    dump = booster.dump_model()
    trees = [_tree_of(info["tree_structure"]) for info in dump["tree_info"]]
    lo = np.quantile(x, 0.0, axis=0)
    hi = np.quantile(x, 1.0, axis=0)
    return TreeModel({"format": MODEL_FORMAT, "feature_version": FEATURE_VERSION, "features": list(FEATURES),
                      "base": 0.0, "trees": trees, "ranges": [[float(a), float(b)] for a, b in zip(lo, hi)],
                      "rows": int(len(y)), "positives": int(y.sum()), "note": note,
                      "importance": {name: int(v) for name, v in
                                     zip(FEATURES, booster.feature_importance("gain").round().astype(int))}})


def choose_tau(model: TreeModel, rows: Sequence[Sequence[float]], labels: Sequence[int],
               weights: Sequence[float] | None = None, *, theta_E: float = 2, theta_R: float = 8,
               recall: float = 0.98, precision: float = 0.5) -> dict:
    """Thresholds for each join from training labels alone (no replay, nothing held out): for
    ``and``, the highest tau (0.02-0.98) that keeps ``recall`` of the positives' weight among the
    evictions Eq. 1 admits (``evictions >= theta_E or reuses >= theta_R``); for ``or``, the lowest
    tau at which the evictions Eq. 1 rejects and the model admits are positives at least
    ``precision`` of the time (0.98 where none is)."""
    weights = [1.0] * len(labels) if weights is None else weights
    grid = [i / 100.0 for i in range(2, 99)]
    probs = [model.probability(r) for r in rows]
    eq1 = [r[0] >= theta_E or r[1] >= theta_R for r in rows]
    positive = sum(w for p, y, w, e in zip(probs, labels, weights, eq1) if e and y)
    tau_and = grid[0]
    for tau in reversed(grid):
        kept = sum(w for p, y, w, e in zip(probs, labels, weights, eq1) if e and y and p >= tau)
        if positive == 0 or kept >= recall * positive:
            tau_and = tau
            break
    tau_or = grid[-1]
    for tau in grid:
        admitted = [(y, w) for p, y, w, e in zip(probs, labels, weights, eq1) if not e and p >= tau]
        total = sum(w for _, w in admitted)
        if total > 0 and sum(w for y, w in admitted if y) >= precision * total:
            tau_or = tau
            break
    return {"and": tau_and, "or": tau_or, "recall": recall, "precision": precision}


class LearnedRule:
    """The learned half of ``eq1&learned`` / ``eq1|learned`` (see the module docstring)."""

    __slots__ = ("model", "tau", "threshold", "tracker", "counters", "drift", "retrain_s", "next_retrain",
                 "labels", "queue", "horizon_cap", "retrains", "decide")

    def __init__(self, model: TreeModel, tau: float, tracker: FeatureTracker, counters, *,
                 retrain_s: float | None = None, horizon_cap: float = 3600.0) -> None:
        if not 0.0 < tau < 1.0:
            raise ValueError(f"learned_tau must be a probability > 0 and < 1, got {tau!r}")
        if retrain_s is not None:
            missing = lightgbm_missing()
            if missing:
                raise ValueError(missing)
        self.model = model
        self.tau = tau
        self.threshold = math.log(tau / (1.0 - tau))
        self.decide = model.decider(self.threshold)
        self.tracker = tracker
        self.counters = counters
        self.drift = 0.0
        self.retrain_s = retrain_s
        self.next_retrain = math.nan  # set at the first eviction
        self.labels: deque = deque(maxlen=LABEL_WINDOW)
        self.queue: deque = deque()  # (t_evict, horizon, learn list, pending entry): labels not settled yet
        self.horizon_cap = horizon_cap
        self.retrains = 0
        if retrain_s is not None:
            tracker.rule = self

    def admits(self, node, now: float, extra_evictions: int = 0) -> bool | None:
        """The model's verdict on ``node`` evicted at ``now`` (with ``extra_evictions`` more), or
        None while the features drift off the training range (Eq. 1 then decides alone)."""
        last = self.tracker.last
        if (extra_evictions == 0 and last is not None and last[0] is node and last[1] == node.E_b
                and last[2] is not None):
            features = last[2]
        else:
            features = self.tracker.features(node, now, extra_evictions)
        model = self.model
        off = model.off_range(features)
        self.drift += _DRIFT_WEIGHT * ((1.0 if off else 0.0) - self.drift)
        counters = self.counters
        counters.learned_scored += 1
        if self.drift > DRIFT_LIMIT:
            counters.learned_fallbacks += 1
            return None
        if self.decide(features):
            counters.learned_admitted += 1
            return True
        return False

    # ------------------------------------------------------------------------- online retraining
    def pending(self, node, learn: list, features: list[float], now: float) -> None:
        """An eviction whose label the traffic will settle: positive if the chunk is referenced
        within the SSD's retention now (capped at ``horizon_cap``), negative once that passes."""
        if learn[PENDING] is not None:  # evicted again unreferenced (a prewarmed copy): settle as it stands
            self.settle(learn, now)
        horizon = min(self.tracker.ssd_retention(), self.horizon_cap)
        entry = (now, horizon, features)
        learn[PENDING] = entry
        self.queue.append((now + horizon, learn, entry))
        self._expire(now)
        if self.next_retrain != self.next_retrain:
            self.next_retrain = now + self.retrain_s
        elif now >= self.next_retrain:
            self.next_retrain = now + self.retrain_s
            self.retrain()

    def settle(self, learn: list, now: float) -> None:
        """The chunk of ``learn`` was referenced (or evicted again) at ``now``: its pending eviction's label."""
        t, horizon, features = learn[PENDING]
        learn[PENDING] = None
        self.labels.append((features, 1 if now - t <= horizon else 0))

    def _expire(self, now: float) -> None:
        queue = self.queue
        while queue and queue[0][0] < now:
            _, learn, entry = queue.popleft()
            if learn[PENDING] is entry:
                learn[PENDING] = None
                self.labels.append((entry[2], 0))

    def retrain(self) -> bool:
        """Train a new model on the settled labels (at least :data:`MIN_TRAIN_ROWS`, both kinds);
        whether it did."""
        labels = self.labels
        positives = sum(label for _, label in labels)
        if len(labels) < MIN_TRAIN_ROWS or positives == 0 or positives == len(labels):
            return False
        self.model = train_model([f for f, _ in labels], [label for _, label in labels],
                                 note=f"online, {len(labels)} labels")
        self.decide = self.model.decider(self.threshold)
        self.drift = 0.0
        self.retrains += 1
        self.counters.learned_retrains += 1
        return True

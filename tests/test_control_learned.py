"""The learned admission rule (issue 35): its policy grammar, the features a control plane computes at
an eviction against a slow reference that keeps every chunk's whole history, the compiled model
against a plain tree walk, the online labels, and the refusal without LightGBM."""

from __future__ import annotations

import builtins
import math
import random

import pytest

from saria.config import ADMISSION_RULES, Policy, admission_rules, learned_join
from saria.control import ControlPlane
from saria.control import learned as learned_mod
from saria.control.learned import (FEATURES, FEATURE_VERSION, MODEL_FORMAT, LearnedRule, TreeModel, choose_tau,
                                   lightgbm_missing, shipped_model)
from saria.replay.policies import parse_policy

from control_cases import config, drain

GiB = 2.0**30


# ------------------------------------------------------------------------------------------ grammar
def test_learned_joins_eq1_by_and_or_or():
    assert "learned" in ADMISSION_RULES
    assert admission_rules("eq1&learned") == {"eq1", "learned"}
    assert admission_rules(" eq1 | learned + deferred") == {"eq1", "learned", "deferred"}
    assert learned_join("eq1&learned+deferred") == "and"
    assert learned_join("eq1|learned") == "or"
    assert learned_join("eq1+deferred") is None
    for bad, words in (("learned", "joined to eq1 by &"), ("eq1+learned", "joined to eq1 by &"),
                       ("eq1&session", "only eq1&learned"), ("eq1&learned+eq1|learned", "joined once"),
                       ("eq1&learned+eq1", "joined once"), ("eq1&learned+oracle", "stands alone")):
        with pytest.raises(ValueError, match=words):
            admission_rules(bad)


@pytest.mark.parametrize("tau", [0, 1, 1.5, -0.2, float("nan"), "high", True])
def test_a_bad_tau_is_refused_naming_it(tau):
    with pytest.raises(ValueError, match="learned_tau"):
        Policy(admission="eq1&learned", learned_tau=tau)


def test_policy_specs_carry_the_learned_rule():
    spec = parse_policy("saria:admission=eq1&learned+deferred,learned_tau=0.3")
    assert dict(spec.overrides) == {"admission": "eq1&learned+deferred", "learned_tau": 0.3}
    assert parse_policy("saria:admission=eq1|learned").label == "saria:admission=eq1|learned"
    with pytest.raises(ValueError, match="learned_tau"):
        parse_policy("saria:admission=eq1&learned,learned_tau=1")
    with pytest.raises(ValueError, match="joined to eq1"):
        parse_policy("saria:admission=eq1+learned")
    with pytest.raises(ValueError, match="learned admission model"):
        ControlPlane(config(admission="eq1&learned", learned_model="/nonexistent/model.json"))


# ---------------------------------------------------------------------- features vs a slow reference
class SlowReference:
    """Every chunk's whole history (reference times, evictions) and the sessions' tip rule, kept
    the plain way; :meth:`features` recomputes :data:`FEATURES` from it (``parent_copy`` aside:
    that is tier state, checked on its own below)."""

    def __init__(self, chunk_tokens: int, ssd_kv_bytes: int) -> None:
        self.times: dict = {}  # key -> every commit time that referenced it (the first created it)
        self.evictions: dict = {}  # key -> [(time, R_b then)]
        self.evicted_flag: dict = {}
        self.owner: dict = {}  # key -> session id
        self.sharers: dict = {}
        self.depth: dict = {}
        self.sessions: list[dict] = []
        self.population = math.nan
        self.recompute = chunk_tokens / 6500.0 / (ssd_kv_bytes / GiB)

    def commit(self, keys: list, now: float) -> None:
        known = [k for k in keys if k in self.times]
        session = None
        came_back = False
        for key in reversed(known):
            if self.evicted_flag.pop(key, False):
                came_back = True
            sid = self.owner.get(key)
            if session is None and sid is not None and self.sessions[sid]["tip"] == key:
                session = sid
        if session is None:
            self.sessions.append({"tip": keys[-1], "turns": 1, "last_end": now, "gap": math.nan, "comebacks": 0})
            session = len(self.sessions) - 1
        else:
            s = self.sessions[session]
            gap = now - s["last_end"]
            s["gap"] = gap if math.isnan(s["gap"]) else s["gap"] + 0.5 * (gap - s["gap"])
            self.population = gap if math.isnan(self.population) else self.population + 0.02 * (gap - self.population)
            s["turns"] += 1
            s["tip"] = keys[-1]
            s["last_end"] = now
            s["comebacks"] += came_back
        for depth, key in enumerate(keys):
            self.times.setdefault(key, []).append(now) if key in self.times else self.times.__setitem__(key, [now])
            self.depth[key] = depth
            if key in self.owner and self.owner[key] != session:
                self.sharers[key] = self.sharers.get(key, 0) + 1
            self.owner[key] = session

    def features(self, key, now: float, retention: float) -> list[float]:
        times = self.times[key]
        R_b = len(times) - 1
        evictions = self.evictions.get(key, [])
        E_b = len(evictions) + 1  # this one
        previous, reuses_then = evictions[-1] if evictions else (None, 0)
        idle = now - times[-1]
        gap = times[-1] - times[-2] if len(times) > 1 else None
        finite = 0 < retention < math.inf
        s = self.sessions[self.owner[key]]
        usual = s["gap"] if not math.isnan(s["gap"]) else self.population
        depth = self.depth[key]
        return [E_b, R_b, -1.0 if previous is None else math.log2(1 + now - previous), R_b - reuses_then,
                sum(2.0 ** (-(now - t) / 300.0) for t in times), sum(2.0 ** (-(now - t) / 3600.0) for t in times),
                math.log2(1 + idle), -1.0 if gap is None else gap / max(idle, 1e-3),
                -1.0 if gap is None else (gap / retention if finite else 0.0), idle / retention if finite else 0.0,
                s["turns"], -1.0 if math.isnan(usual) else (now - s["last_end"]) / max(usual, 1e-3), s["comebacks"],
                depth, None, self.sharers.get(key, 0), (depth + 1) * self.recompute]

    def evicted(self, key, now: float) -> None:
        self.evictions.setdefault(key, []).append((now, len(self.times[key]) - 1))
        self.evicted_flag[key] = True


def _random_requests(seed: int, n: int = 90) -> list[tuple[float, list]]:
    """Agent-like sessions under two shared system prompts, each turn its previous prompt plus 1-3
    chunks, some sessions branching off another's prefix, arrivals 0-40 s apart."""
    rng = random.Random(seed)
    prompts = [[f"sys{p}:{i}" for i in range(1 + p)] for p in range(2)]
    contexts: list[list] = []
    now = 0.0
    out = []
    for i in range(n):
        if not contexts or rng.random() < 0.25:
            base = list(rng.choice(prompts)) if rng.random() < 0.7 else []
            other = rng.choice(contexts) if contexts else []
            if other and rng.random() < 0.3:  # a branch of another session's prefix
                base = other[:rng.randint(1, len(other))]
            contexts.append(base)
        ctx = rng.randrange(len(contexts))
        contexts[ctx] = contexts[ctx] + [f"r{i}:{j}" for j in range(rng.randint(1, 3))]
        now += rng.uniform(0.0, 40.0)
        out.append((now, list(contexts[ctx])))
    return out


@pytest.mark.parametrize("seed,dram,ssd", [(0, 6, 40), (1, 5, 8), (2, 8, 12), (3, 4, 6), (4, 10, 200)])
def test_features_match_a_slow_reference(seed, dram, ssd):
    cfg = config("saria", dram_chunks=dram, ssd_chunks=ssd, metadata_window_s=1e6)
    ref = SlowReference(cfg.chunk.chunk_tokens, cfg.ssd_kv_bytes)
    seen = []

    def observer(node, features, now, retention):
        assert len(features) == len(FEATURES)
        expected = ref.features(node.key, now, retention)
        for name, got, want in zip(FEATURES, features, expected):
            if want is None:
                parent = node.parent
                assert got == (1 if parent is None or parent.dram or parent.ssd else 0)
                continue
            assert got == pytest.approx(want, rel=1e-9, abs=1e-9), (name, node.key, now)
        ref.evicted(node.key, now)
        seen.append(retention)

    cp = ControlPlane(cfg, observer=observer)
    for now, keys in _random_requests(seed):
        ref.commit(keys, now)
        plan = cp.plan(keys, now)
        drain(cp, cp.commit_prefill(keys, now, plan=plan), now)
    assert seen, "no eviction: the case tests nothing"
    if ssd <= 12:
        assert any(r < math.inf for r in seen), "the SSD never evicted: the retention ratios went untested"
    assert not cp.audit()


def test_the_learned_rule_scores_what_the_observer_sees():
    """The rule's own features at an eviction are the observer's (one computation, two readers);
    without prewrite and promotion, evictions are all it scores."""
    cfg = config("saria", dram_chunks=5, ssd_chunks=30, admission="eq1|learned+deferred", learned_tau=0.5,
                 prewrite=False, r=0.0)
    scored = []
    cp = ControlPlane(cfg, observer=lambda node, features, now, retention: scored.append(list(features)))
    rule = cp._admission.learned
    margins = []
    real = rule.decide
    rule.decide = lambda f: margins.append(list(f)) or real(f)
    for now, keys in _random_requests(7, 60):
        drain(cp, cp.commit_prefill(keys, now, plan=cp.plan(keys, now)), now)
    assert margins and all(m in scored for m in margins)
    counters = cp.counters()
    assert counters.learned_scored >= len(margins) > 0


# ------------------------------------------------------------------------------------------ the model
def _walk(tree, f):
    while isinstance(tree, list):
        feature, threshold, left, right = tree
        tree = left if f[feature] <= threshold else right
    return tree


def _random_model(rng: random.Random) -> dict:
    def grow(depth):
        if depth == 0 or rng.random() < 0.2:
            return rng.uniform(-1, 1)
        return [rng.randrange(len(FEATURES)), rng.uniform(-2, 5), grow(depth - 1), grow(depth - 1)]

    return {"format": MODEL_FORMAT, "feature_version": FEATURE_VERSION, "features": list(FEATURES), "base": 0.25,
            "trees": [grow(5) for _ in range(12)], "ranges": [[0.0, rng.uniform(0.5, 4)] for _ in FEATURES]}


def test_compiled_model_matches_a_tree_walk():
    rng = random.Random(3)
    for _ in range(5):
        data = _random_model(rng)
        model = TreeModel(data)
        deciders = {threshold: model.decider(threshold) for threshold in (-2.0, 0.0, 0.7, 3.0)}
        for _ in range(300):
            f = [rng.uniform(-6, 10) for _ in FEATURES]
            assert model.margin(f) == pytest.approx(0.25 + sum(_walk(t, f) for t in data["trees"]), abs=1e-12)
            assert model.off_range(f) == model.off_range_slow(f)
            for threshold, decide in deciders.items():
                assert decide(f) == (model.margin(f) >= threshold)
            lo = [2 * a - b for a, b in data["ranges"]]
            hi = [2 * b - a for a, b in data["ranges"]]
            assert model.off_range(f) == any(not (a <= x <= b) for x, a, b in zip(f, lo, hi))


def test_choose_tau_keeps_the_recall_and_the_precision_it_is_asked_for():
    """A one-feature model whose probability is the feature ``hits_in_dram`` / 10: the thresholds
    are read off the labels exactly."""
    n = len(FEATURES)
    # score(x) = logit(x / 10) as a sum of stumps is awkward; a lookup of a few values is enough
    values = [1, 3, 5, 7, 9]
    logit = [math.log(v / 10 / (1 - v / 10)) for v in values]
    tree: object = logit[-1]
    for v, m in reversed(list(zip(values[:-1], logit[:-1]))):
        tree = [3, v + 0.5, m, tree]
    model = TreeModel({"format": MODEL_FORMAT, "feature_version": FEATURE_VERSION, "features": list(FEATURES),
                       "trees": [tree], "ranges": [[0.0, 10.0]] * n})
    row = lambda evictions, x: [evictions, 0, 0, x] + [0.0] * (n - 4)  # noqa: E731
    # Eq. 1 admits (evictions 2): positives at p 0.9, 0.7, 0.3 (weights 1, 1, 8); a negative at 0.1
    rows = [row(2, 9), row(2, 7), row(2, 3), row(2, 1)]
    labels, weights = [1, 1, 1, 0], [1.0, 1.0, 8.0, 1.0]
    # Eq. 1 rejects (evictions 1): p 0.9 positive, 0.7 negative, 0.5 positive, 0.3 negative x3
    rows += [row(1, 9), row(1, 7), row(1, 5), row(1, 3)]
    labels += [1, 0, 1, 0]
    weights += [1.0, 1.0, 1.0, 3.0]
    taus = choose_tau(model, rows, labels, weights, recall=0.98, precision=0.5)
    assert 0.29 < taus["and"] <= 0.3  # keeping the weight-8 positive at 0.3
    assert 0.69 <= choose_tau(model, rows, labels, weights, recall=0.15)["and"] <= 0.7  # 2 of 10 kept
    assert 0.89 <= choose_tau(model, rows, labels, weights, recall=0.1)["and"] <= 0.9  # 1 of 10 will do
    assert choose_tau(model, rows, labels, weights, theta_E=3)["and"] == 0.98  # Eq. 1 admits none: reject all
    assert 0.3 < taus["or"] <= 0.31  # above 0.3: 2 of 3 positive; at 0.3: 2 of 6 weight
    assert 0.69 <= choose_tau(model, rows, labels, weights, precision=0.9)["or"] <= 0.71  # only the 0.9 one


def test_a_model_for_other_features_is_refused():
    data = _random_model(random.Random(1))
    with pytest.raises(ValueError, match="features version"):
        TreeModel({**data, "feature_version": FEATURE_VERSION + 1})
    with pytest.raises(ValueError, match="features version"):
        TreeModel({**data, "features": list(FEATURES)[:-1]})
    with pytest.raises(ValueError, match="not a saria"):
        TreeModel({**data, "format": "xgboost"})
    with pytest.raises(ValueError, match="feature"):
        TreeModel({**data, "trees": [[len(FEATURES), 0.0, 1.0, -1.0]]})


def test_the_shipped_model_loads_and_knows_its_features():
    model = shipped_model()
    assert model.data["features"] == list(FEATURES) and model.data["feature_version"] == FEATURE_VERSION
    assert len(model.trees) >= 1 and 0 < model.data["positives"] < model.data["rows"]


def test_drift_off_the_training_range_hands_the_decision_to_eq1():
    """Features far off the model's range: after a while every decision is Eq. 1's, counted."""
    data = _random_model(random.Random(5))
    data["trees"] = [1e6]  # a model that admits everything
    from saria.control.counters import Counters

    class Tracker:
        last = None

        def __init__(self, f):
            self.f = f

        def features(self, node, now, extra=0):
            return self.f

    counters = Counters()
    inside = [0.5] * len(FEATURES)
    outside = [100.0] * len(FEATURES)
    rule = LearnedRule(TreeModel(data), 0.5, Tracker(inside), counters)
    assert all(rule.admits(object(), 0.0) is True for _ in range(50))
    rule.tracker = Tracker(outside)
    verdicts = [rule.admits(object(), 0.0) for _ in range(400)]
    assert verdicts[0] is True and verdicts[-1] is None  # the average crossed DRIFT_LIMIT
    assert counters.learned_fallbacks == verdicts.count(None) > 0
    rule.tracker = Tracker(inside)
    verdicts = [rule.admits(object(), 0.0) for _ in range(400)]
    assert verdicts[-1] is True  # back in range: the model decides again


# ------------------------------------------------------------------------------------- online labels
class _Fake:
    def __init__(self):
        self.learn = None


def test_online_labels_settle_on_reference_or_when_the_horizon_passes(monkeypatch):
    monkeypatch.setattr(learned_mod, "lightgbm_missing", lambda: None)
    retention = [100.0]

    class Tracker:
        rule = None
        ssd_retention = staticmethod(lambda: retention[0])

    from saria.control.counters import Counters

    rule = LearnedRule(TreeModel(_random_model(random.Random(2))), 0.5, Tracker(), Counters(), retrain_s=1e9)
    a, b, c = ([-math.inf, 0, 1.0, 1.0, 0.0, -1.0, None] for _ in range(3))
    rule.pending(_Fake(), a, [1.0], 10.0)   # referenced at 60: within 100 s
    rule.pending(_Fake(), b, [2.0], 20.0)   # referenced at 130: too late
    retention[0] = math.inf                 # capped at horizon_cap (3600 s)
    rule.pending(_Fake(), c, [3.0], 30.0)   # never referenced: negative once 3630 passes
    rule.settle(a, 60.0)
    rule.settle(b, 130.0)
    assert list(rule.labels) == [([1.0], 1), ([2.0], 0)]
    rule._expire(3000.0)
    assert len(rule.labels) == 2
    rule._expire(3700.0)
    assert list(rule.labels)[-1] == ([3.0], 0) and c[6] is None


def test_without_lightgbm_training_is_refused_in_one_line(monkeypatch):
    real_import = builtins.__import__

    def no_lightgbm(name, *args, **kwargs):
        if name == "lightgbm" or name.startswith("lightgbm."):
            raise ImportError("No module named 'lightgbm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lightgbm)
    line = lightgbm_missing()
    assert line and "\n" not in line and "saria[learn]" in line
    with pytest.raises(ValueError) as info:
        ControlPlane(config(admission="eq1&learned", learned_retrain_s=600.0))
    assert str(info.value) == line
    with pytest.raises(RuntimeError, match="saria\\[learn\\]"):
        learned_mod.train_model([[0.0] * len(FEATURES)] * 4, [0, 1, 0, 1])
    # scoring the shipped model needs no LightGBM: the rule runs
    cp = ControlPlane(config(admission="eq1&learned"))
    for now, keys in _random_requests(1, 30):
        drain(cp, cp.commit_prefill(keys, now, plan=cp.plan(keys, now)), now)
    assert not cp.audit()


def _admit_all(tmp_path) -> str:
    path = tmp_path / "admit-all.json"
    TreeModel({"format": MODEL_FORMAT, "feature_version": FEATURE_VERSION, "features": list(FEATURES), "trees": [9.0],
               "ranges": [[-1e9, 1e9]] * len(FEATURES)}).save(path)
    return str(path)


def test_and_with_deferred_prewrites_nothing_before_dram_first_evicts(tmp_path):
    """A chunk reused 8 times is a prewrite candidate under Eq. 1 (R_b >= theta_R) even while
    everything fits; eq1&learned+deferred waits for the first eviction, as the reuse branch does,
    and then prewrites what Eq. 1 and the model both admit."""
    model = _admit_all(tmp_path)
    runs = {}
    for admission in ("eq1+deferred", "eq1&learned+deferred", "eq1|learned+deferred", "eq1+deferred+prefix",
                      "eq1|learned+deferred+prefix", "eq1&learned+deferred+prefix"):
        cp = ControlPlane(config("saria", dram_chunks=8, ssd_chunks=40, admission=admission, learned_model=model))
        writes = []
        for i in range(10):
            writes += [o for o in drain(cp, cp.commit_prefill(["a:0", "a:1"], float(i), plan=cp.plan(["a:0", "a:1"],
                                                                                                      float(i))), i)
                       if type(o).__name__ == "WriteOrder"]
        before = len(writes)
        for i in range(10, 20):  # other contexts: DRAM evicts
            keys = [f"b{i}:{j}" for j in range(4)]
            writes += [o for o in drain(cp, cp.commit_prefill(keys, float(i), plan=cp.plan(keys, float(i))), i)
                       if type(o).__name__ == "WriteOrder"]
        runs[admission] = (before, len(writes), cp.counters())
    assert runs["eq1+deferred"][0] > 0  # Eq. 1's prewrite of the popular chunks
    assert runs["eq1|learned+deferred"][0] == runs["eq1+deferred"][0]  # OR: prewrite is Eq. 1's
    assert runs["eq1&learned+deferred"][0] == 0
    assert runs["eq1|learned+deferred+prefix"][0] == runs["eq1+deferred+prefix"][0] > 0  # with other rules too
    assert runs["eq1&learned+deferred+prefix"][0] == 0
    assert runs["eq1&learned+deferred"][2].dram_evictions > 0 and runs["eq1&learned+deferred"][1] > 0

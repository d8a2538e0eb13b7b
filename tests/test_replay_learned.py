"""The learned admission rule in a replay (issue 35): the labeler against the oracle rule, Baleen-style
episodes, and the train/score loop on a synthetic trace whose answer is known."""

from __future__ import annotations

import math
import random

import pytest

from saria.control.learned import FEATURE_VERSION, FEATURES, MODEL_FORMAT, TreeModel
from saria.replay.experiment import Experiment, Point, open_trace
from saria.replay.labels import EvictionLabels, episode_labels
from saria.replay.learn import collect, fit, time_half
from saria.replay.policies import BaseSettings, build_config, parse_policy
from saria.replay.replay import ReplaySettings, replay
from saria.replay.traces import Request, Trace

pytest.importorskip("lightgbm", reason="the train/score tests need LightGBM (pip install 'saria[learn]'; "
                                       "make test installs it with the test extra)")

DEPTH, TURNS = FEATURES.index("depth"), FEATURES.index("turns")


# ------------------------------------------------------------------------------- labeler vs oracle
@pytest.mark.parametrize("ssd_tokens", [10_000_000, 400_000])
def test_labels_are_the_oracles_decisions(ssd_tokens):
    """Under the oracle policy (no prewrite: every write is an eviction's), the evictions the labeler
    calls positive among those where admission decides are exactly the ones the oracle wrote."""
    trace = open_trace("synth:sessions=20,seed=4")
    base = BaseSettings(dram_tokens=100_000, ssd_tokens=ssd_tokens)
    exp = Experiment(trace, "synth", base, ReplaySettings(), arrivals="rewindow", workers=1, progress=False)
    config = build_config(parse_policy("oracle:prewrite=false"), base)
    run = replay("oracle", exp.trace, exp.chunks, exp.schedule(None), config, exp.settings, labels=True)
    labels, counters = run.labels, run.counters
    assert len(labels) == counters.dram_evictions > 0
    positives = sum(1 for y, d in zip(labels.labels, labels.decides) if y and d)
    assert counters.writes_skipped == 0
    assert positives == counters.admissions_eviction == counters.admissions > 0
    if ssd_tokens < 1_000_000:
        assert counters.ssd_evictions > 0  # the retention horizon was finite
    # a positive label has reuses within the horizon; a negative none
    assert all((r > 0) == bool(y) for r, y in zip(labels.reuses, labels.labels))


def test_labels_do_not_change_the_replay():
    trace = open_trace("synth:sessions=12,seed=2")
    base = BaseSettings(dram_tokens=100_000, ssd_tokens=1_000_000)
    exp = Experiment(trace, "synth", base, ReplaySettings(), arrivals="rewindow", workers=1, progress=False)
    config = build_config(parse_policy("saria"), base)
    plain = replay("saria", exp.trace, exp.chunks, exp.schedule(None), config, exp.settings)
    labelled = replay("saria", exp.trace, exp.chunks, exp.schedule(None), config, exp.settings, labels=True)
    assert plain.counters == labelled.counters and plain.ttft_s == labelled.ttft_s
    assert plain.labels is None and len(labelled.labels) == plain.counters.dram_evictions


def test_episodes_take_the_most_reuses_per_byte_up_to_the_budget():
    labels = EvictionLabels(future=None, ssd_kv_bytes=10)
    # (reuses, decides, time)
    for reuses, decides, t in ((3, True, 0.0), (0, True, 1.0), (5, True, 2.0), (5, False, 3.0), (1, True, 4.0),
                               (3, True, 5.0)):
        labels.rows.append([0.0] * len(FEATURES))
        labels.labels.append(1 if reuses else 0)
        labels.reuses.append(reuses)
        labels.decides.append(decides)
        labels.times.append(t)
        labels.keys.append(t)
    assert episode_labels(labels, 0) == [0] * 6
    assert episode_labels(labels, 10) == [0, 0, 1, 0, 0, 0]
    assert episode_labels(labels, 25) == [1, 0, 1, 0, 0, 0]  # ties: the earlier
    assert episode_labels(labels, 1e9) == [1, 0, 1, 0, 1, 1]  # never one with no SSD decision or no reuse
    with pytest.raises(ValueError, match="budget"):
        episode_labels(labels, -1)


# ------------------------------------------------------------------------ a trace whose answer is known
def known_trace(seed: int) -> Trace:
    """Returning agent sessions and one-shot requests. Every returning session starts with a shared
    two-chunk system prompt, then its own context (depth 2 and on), and comes back 4 times, 400 s
    apart; one-shot requests (their own two chunks, depth 0 and 1) arrive every ~2 s and never
    return. With a small DRAM the returners' chunks are evicted between turns. The oracle's answer:
    a returner's own chunk evicted before its session's last turn is reused (label 1); a one-shot
    chunk, or one evicted after the last turn, never is (0) - depth and turns tell them apart."""
    rng = random.Random(seed)
    ids = iter(range(10**9))
    system = [next(ids), next(ids)]
    requests = []
    t = 0.0
    for s in range(12):
        start = rng.uniform(0, 600)
        context = system + [next(ids) for _ in range(rng.randint(4, 6))]
        for turn in range(4):
            if turn:
                context = context + [next(ids) for _ in range(rng.randint(1, 2))]
            requests.append(Request(start + 400.0 * turn, len(context) * 512, 16, tuple(context), f"agent{s}"))
    while t < 1900:
        t += rng.uniform(1.0, 3.0)
        blocks = (next(ids), next(ids))
        requests.append(Request(t, 1024, 16, blocks, None))
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(f"known{seed}", tuple(requests), 512, "mooncake")


BASE = BaseSettings(dram_tokens=20 * 512, ssd_tokens=100_000 * 512)
FAST = ReplaySettings(inflight=8, prefill_tps=1e7)


def _answer(row) -> int:
    return int(row[DEPTH] >= 2 and row[TURNS] < 4)


def test_the_model_learns_the_known_answer_and_the_rule_uses_it(tmp_path):
    training = collect(known_trace(0), "known0", BASE, arrivals="recorded", settings=FAST)
    rows, labels = training.deciding()
    assert sum(labels) > 20 and len(labels) - sum(labels) > 20
    # the oracle's labels are the known answer (but for the shared prompt, which is never evicted here)
    assert sum(y == _answer(r) for r, y in zip(rows, labels)) / len(labels) > 0.99
    model = fit([training], note="known")
    held_out = collect(known_trace(1), "known1", BASE, arrivals="recorded", settings=FAST)
    rows, labels = held_out.deciding()
    predicted = [int(model.probability(r) >= 0.5) for r in rows]
    assert sum(p == y for p, y in zip(predicted, labels)) / len(labels) > 0.97
    assert all(model.probability(r) < 0.5 for r in rows if r[DEPTH] < 2)  # one-shots: never

    path = tmp_path / "model.json"
    model.save(path)
    exp = Experiment(known_trace(1), "known1", BASE, FAST, arrivals="recorded", workers=1, progress=False)
    points = [Point(label, parse_policy(spec)) for label, spec in (
        ("eq1", "saria"), ("and", f"saria:admission=eq1&learned+deferred,learned_tau=0.5,learned_model={path}"),
        ("or", f"saria:admission=eq1|learned+deferred,learned_tau=0.5,learned_model={path}"), ("oracle", "oracle"))]
    results, runs = exp.run(points, references=False)
    by = {r["policy"]: r for r in results}
    counters = {run.name: run.counters for run in runs}
    # Eq. 1 writes a returner's chunk only at its second eviction, so it misses the first comeback;
    # the learned rule writes it at the first (OR), and never writes a one-shot chunk
    assert by["or"]["char_mean"] > by["eq1"]["char_mean"] + 0.05
    assert by["or"]["char_mean"] >= by["oracle"]["char_mean"] - 0.02
    assert by["or"]["useful_write_fraction"] > 0.9
    assert by["or"]["ssd_write_bytes"] <= 1.1 * by["oracle"]["ssd_write_bytes"]
    # AND writes only what Eq. 1 would, less what the model rejects (after the last turn)
    assert by["and"]["ssd_write_bytes"] < by["eq1"]["ssd_write_bytes"]
    assert by["and"]["char_mean"] >= by["eq1"]["char_mean"] - 1e-9
    for name in ("and", "or"):  # a few off-range scores (a third eviction, beyond training's), no more
        assert counters[name].learned_fallbacks <= 0.05 * counters[name].learned_scored
    assert counters["or"].learned_admitted > 0


def test_online_retraining_learns_from_its_own_evictions(tmp_path):
    """With learned_retrain_s the rule labels its own evictions as the traffic settles them (a
    negative once 600 s pass: the metadata window caps the horizon of a never-evicting SSD) and
    retrains: starting from a model that admits everything here, it learns to reject one-shot
    chunks and writes far less, keeping the first comebacks Eq. 1 misses."""
    start = tmp_path / "admit-all.json"
    TreeModel({"format": MODEL_FORMAT, "feature_version": FEATURE_VERSION, "features": list(FEATURES), "trees": [5.0],
               "ranges": [[-1e9, 1e9]] * len(FEATURES)}).save(start)
    exp = Experiment(known_trace(2), "known2", BASE, FAST, arrivals="recorded", workers=1, progress=False)
    specs = ("saria", f"saria:admission=eq1|learned+deferred,metadata_window_s=600,learned_model={start}",
             f"saria:admission=eq1|learned+deferred,metadata_window_s=600,learned_retrain_s=300,learned_model={start}")
    results, runs = exp.run([Point(s, parse_policy(s)) for s in specs], references=False)
    eq1, fixed, online = results
    assert runs[1].counters.learned_admitted == runs[1].counters.learned_scored  # the model it starts from
    assert runs[2].counters.learned_retrains >= 2
    assert online["ssd_write_bytes"] < 0.7 * fixed["ssd_write_bytes"]
    assert online["char_mean"] > eq1["char_mean"] + 0.05


def test_time_half_splits_whole_sessions():
    trace = known_trace(3)
    first, second = time_half(trace, 0), time_half(trace, 1)
    assert len(first.requests) + len(second.requests) == len(trace.requests)
    sessions = {r.session for r in first.requests if r.session} & {r.session for r in second.requests if r.session}
    assert not sessions
    middle = (trace.requests[0].arrival_s + trace.requests[-1].arrival_s) / 2
    assert all(r.arrival_s < middle for r in first.requests if r.session is None)
    with pytest.raises(ValueError, match="half"):
        time_half(trace, 2)
    assert not math.isnan(middle)


def test_tune_searches_learned_tau_for_a_write_budget(tmp_path):
    from dataclasses import replace

    from saria.config import WriteBudget
    from saria.replay.tune import DEFAULT_TAU, tune

    base = BaseSettings(dram_tokens=100_000, ssd_tokens=1_000_000)
    path = tmp_path / "model.json"
    fit([collect(open_trace(f"synth:sessions=12,seed={seed}"), "synth", base) for seed in (4, 5)]).save(path)
    spec = parse_policy(f"saria:admission=eq1&learned+deferred,learned_model={path}")
    probe = Experiment(open_trace("synth:sessions=8,seed=3"), "synth", base, ReplaySettings(), arrivals="rewindow",
                       workers=1, progress=False)
    most, least = (probe.run([Point("p", parse_policy(f"{spec.label},learned_tau={t}"))], references=False)[0][0]
                   for t in (DEFAULT_TAU[0], DEFAULT_TAU[-1]))
    assert least["ssd_write_bytes"] < most["ssd_write_bytes"]
    # a budget between the two ends: 1 DWPD of a drive sized so (the default drive is the SSD cache)
    default_budget = most["ssd_write_bytes"] / most["write_budget_ratio"]
    capacity = int(probe.config_for(spec).ssd_bytes * (least["ssd_write_bytes"] + most["ssd_write_bytes"]) / 2
                   / default_budget)
    base = replace(base, write_budget=WriteBudget(dwpd=1.0, capacity_bytes=capacity))
    exp = Experiment(open_trace("synth:sessions=8,seed=3"), "synth", base, ReplaySettings(), arrivals="rewindow",
                     workers=1, progress=False)
    result = tune(exp, spec, theta_R=(8,))
    taus = [row["learned_tau"] for row in result.rows]
    assert set(taus) <= set(DEFAULT_TAU) and all(row["theta_E"] == "2" for row in result.rows)
    writes = {row["learned_tau"]: row["ssd_write_bytes"] for row in result.rows}
    assert [writes[t] for t in sorted(writes)] == sorted(writes.values(), reverse=True)  # higher tau, fewer writes
    best = result.best
    assert best["feasible"] and all(not row["feasible"] for row in result.rows if row["learned_tau"] < best["learned_tau"])
    assert result.spec.endswith(f"theta_E=2,theta_R=8,learned_tau={best['learned_tau']}")
    parse_policy(result.spec)
    with pytest.raises(ValueError, match="tunes learned_tau"):
        tune(exp, spec, theta_E=(1, 2))


def test_saria_replay_runs_both_joins_from_the_command_line(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "replay", "synth:sessions=6,seed=2",
                           "--dram-tokens", "100000", "--ssd-tokens", "1000000", "--jobs", "1", "--no-progress",
                           "--policy", "saria", "--policy", "saria:admission=eq1&learned+deferred",
                           "--policy", "saria:admission=eq1|learned", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = [r["policy"] for r in json.loads(out.read_text())["results"]]
    assert names == ["saria", "saria:admission=eq1&learned+deferred", "saria:admission=eq1|learned"]
    bad = subprocess.run([sys.executable, "-m", "saria.commands.cli", "replay", "synth:sessions=2", "--policy",
                          "saria:admission=eq1&learned,learned_tau=2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "learned_tau" in bad.stderr and "Traceback" not in bad.stderr

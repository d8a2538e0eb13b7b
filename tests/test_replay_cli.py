"""`saria replay`, `sweep`, `tune` and `synth`, run as a user runs them: outputs, determinism,
and clear errors for bad input."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from saria.replay.metrics import RESULT_KEYS
from saria.replay.traces import load_trace

ROOT = Path(__file__).resolve().parent.parent
SMALL = "synth:sessions=24,prompt_tokens=6000,first_prompt_tokens=2000,seed=5"
CACHE = ["--dram-tokens", "20000", "--ssd-tokens", "200000", "--window-hours", "1", "--no-progress"]


def saria(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "saria.commands.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_replay_prints_the_table_and_writes_json_and_csv(tmp_path):
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    proc = saria("replay", SMALL, *CACHE, "--policy", "saria", "--policy", "full-duplicate:r=0.5",
                 "--policy", "dram-only", "--json", out, "--csv", table)
    assert proc.returncode == 0, proc.stderr
    assert "CHAR P25 bad" in proc.stdout and "full-duplicate:r=0.5" in proc.stdout
    doc = json.loads(out.read_text())
    assert list(doc) == ["trace", "config", "results"] and doc["trace"] == SMALL
    assert [r["policy"] for r in doc["results"]] == ["saria", "full-duplicate:r=0.5", "dram-only"]
    for record in doc["results"]:
        assert tuple(record) == RESULT_KEYS
        assert isinstance(record["ssd_write_bytes"], int) and isinstance(record["char_mean"], float)
    saria_, fd, dram = doc["results"]
    assert dram["ssd_write_bytes"] == 0 and dram["ssd_hit_tokens"] == 0
    assert fd["ssd_write_bytes"] > saria_["ssd_write_bytes"] > 0
    assert fd["char_mean"] >= saria_["char_mean"] >= dram["char_mean"]
    config = doc["config"]
    assert config["arrivals"]["mode"] == "rewindow" and config["arrivals"]["window_hours"] == 1.0
    assert config["policies"]["full-duplicate:r=0.5"]["policy"]["r"] == 0.5
    rows = list(csv.DictReader(table.open()))
    assert [r["policy"] for r in rows] == ["saria", "full-duplicate:r=0.5", "dram-only"]
    assert tuple(rows[0]) == RESULT_KEYS


def test_same_seed_same_json_whatever_the_process_count(tmp_path):
    paths = [tmp_path / f"{i}.json" for i in range(3)]
    for path, extra in zip(paths, (["--jobs", "1"], ["--jobs", "2"], ["--jobs", "2", "--seed", "9"])):
        proc = saria("replay", SMALL, *CACHE, "--policy", "saria", "--policy", "lmcache-plus", "--json", path, *extra)
        assert proc.returncode == 0, proc.stderr
    assert paths[0].read_bytes() == paths[1].read_bytes()
    other = json.loads(paths[2].read_text())
    assert other["results"] != json.loads(paths[0].read_text())["results"]  # other session starts


def test_write_budget_auto_reports_the_governor(tmp_path):
    out = tmp_path / "g.json"
    proc = saria("replay", SMALL, *CACHE, "--policy", "saria", "--policy", "full-duplicate", "--write-budget",
                 "auto", "--ssd-capacity", "2GB", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "governor saria:" in proc.stdout
    policies = json.loads(out.read_text())["config"]["policies"]
    assert policies["saria"]["governor"] and not policies["full-duplicate"]["governor"]
    assert policies["saria"]["governor_theta_E"]["changes"] > 0
    assert policies["saria"]["write_budget_bytes"] == pytest.approx(2e9 * policies["saria"]["budget_seconds"] / 86400)


def test_mooncake_file_with_recorded_arrivals(tmp_path):
    trace = tmp_path / "m.jsonl"
    lines = [{"timestamp": 1000 * i, "input_length": 64 * (3 + i), "output_length": 1, "hash_ids": list(range(3 + i))}
             for i in range(12)]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "m.json"
    proc = saria("replay", trace, "--chunk-tokens", "128", "--dram-tokens", "5000", "--policy", "saria",
                 "--no-progress", "--json", out)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["arrivals"]["mode"] == "recorded" and doc["config"]["trace"]["block_tokens"] == 64
    assert doc["results"][0]["hit_ratio"] > 0.5  # every request extends the previous one


@pytest.mark.parametrize("args, message", [
    pytest.param(["replay", "missing.jsonl"], "trace file not found", id="missing-file"),
    pytest.param(["replay", SMALL, "--policy", "sarai"], "unknown policy 'sarai'", id="unknown-policy"),
    pytest.param(["replay", SMALL, "--policy", "saria:theta_X=2"], "unknown setting 'theta_X'", id="bad-override"),
    pytest.param(["replay", SMALL, "--policy", "saria:theta_E=0"], "Policy.theta_E must be from 1 to 1,000,000",
                 id="bad-value"),
    pytest.param(["replay", SMALL, "--chunk-tokens", "700"], "not a multiple of the trace's 512-token blocks",
                 id="chunk-not-multiple"),
    pytest.param(["replay", SMALL, "--policy", "dram-only", "--write-budget", "auto"],
                 "none of the policies has eviction-based admission", id="nothing-to-govern"),
    pytest.param(["replay", "synth:sesions=3"], "bad synthetic trace setting", id="bad-synth"),
    pytest.param(["replay", SMALL, "--arrivals", "recorded", "--truncate-hours", "-1"],
                 "must be from 0.001 to 2160, got -1", id="bad-truncation"),
    pytest.param(["tune", SMALL], "the following arguments are required: --dwpd, --ssd-capacity",
                 id="tune-needs-a-budget"),
    pytest.param(["sweep", SMALL], "nothing to sweep", id="empty-sweep"),
    pytest.param(["replay", SMALL, "--ssd-capacity", "lots"], "not a size", id="bad-size"),
])
def test_bad_input_is_a_clear_error(args, message):
    proc = saria(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_malformed_lines_are_named(tmp_path):
    trace = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1]})
    trace.write_text("\n".join([good, good.replace("[1]", "[1, 2]"), "{oops", good]) + "\n")
    proc = saria("replay", trace, "--block-tokens", "64", "--chunk-tokens", "64")
    assert proc.returncode == 2 and f"{trace}:2:" in proc.stderr and f"{trace}:3:" in proc.stderr
    proc = saria("replay", trace, "--block-tokens", "64", "--chunk-tokens", "64", "--skip-bad-lines", "--no-progress",
                 "--policy", "saria")
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {trace}:2:" in proc.stderr and "2 requests" in proc.stdout


def test_sweep_writes_rows_for_the_grid_and_references(tmp_path):
    table = tmp_path / "s.csv"
    proc = saria("sweep", SMALL, *CACHE, "--policy", "saria:theta_R=none", "--theta-e", "1,3", "--windows", "0.5,2",
                 "--csv", table)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 2 * 2 + 2  # the grid, and full-duplicate in each window
    grid = [r for r in rows if "reference" not in r["series"]]
    assert {(r["point"], r["window_hours"]) for r in grid} == {("E1", "0.5"), ("E3", "0.5"), ("E1", "2"), ("E3", "2")}
    for window in ("0.5", "2"):
        e1, e3 = (next(r for r in grid if r["point"] == p and r["window_hours"] == window) for p in ("E1", "E3"))
        assert int(e1["ssd_write_bytes"]) > int(e3["ssd_write_bytes"])
    assert set(RESULT_KEYS) <= set(rows[0])


def test_tune_finds_thresholds_within_the_budget(tmp_path):
    out = tmp_path / "t.json"
    proc = saria("tune", SMALL, *CACHE, "--dwpd", "1", "--ssd-capacity", "20GB", "--theta-e", "1,2,3",
                 "--theta-r", "none,8", "--json", out)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    best = doc["best"]
    assert best["write_budget_ratio"] <= 1.0 and best["feasible"]
    feasible = [p for p in doc["probes"] if p["feasible"]]
    assert best["char_mean"] == max(p["char_mean"] for p in feasible)
    assert f"use: --policy {doc['spec']}" in proc.stdout
    assert doc["spec"] == f"saria:theta_E={best['theta_E']},theta_R={best['theta_R']}"


def test_plot_draws_or_says_why_not(tmp_path):
    png = tmp_path / "p.png"
    proc = saria("replay", SMALL, *CACHE, "--policy", "saria", "--plot", png)
    assert proc.returncode == 0, proc.stderr
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in proc.stderr and "saria[plot]" in proc.stderr and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synth_writes_a_trace_that_loads_back(tmp_path):
    out = tmp_path / "s.jsonl"
    proc = saria("synth", out, "--sessions", "5", "--seed", "3", "--prompt-tokens", "5000",
                 "--first-prompt-tokens", "1000")
    assert proc.returncode == 0, proc.stderr
    trace = load_trace(out)
    assert trace.block_tokens == 512 and trace.has_sessions
    assert len({r.session for r in trace.requests}) == 5


def test_help_explains_the_commands():
    proc = saria("replay", "--help")
    assert proc.returncode == 0
    for flag in ("--policy", "--dram-tokens", "--ssd-tokens", "--chunk-tokens", "--block-tokens", "--json", "--csv",
                 "--plot", "--arrivals", "--window-hours", "--inflight", "--prefill-tps", "--b-gpu", "--b-disk",
                 "--drives", "--b-dram", "--dwpd", "--ssd-capacity", "--write-budget", "--model", "--loading"):
        assert flag in proc.stdout
    assert "qwen3.5-9b" in proc.stdout and "lmcache-plus" in proc.stdout


def test_replay_never_imports_torch():
    code = ("import sys, saria.commands.cli, saria.replay, saria.replay.cli; saria.commands.cli.build_parser(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy') "
            "or m.startswith(('saria.kernels', 'saria.dataplane', 'saria.harness.paged_caches'))); print(bad); "
            "sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("jobs", [1, 2], ids=["in-process", "worker-processes"])
def test_an_internal_error_says_it_is_a_bug_and_names_the_request_and_policy(monkeypatch, capsys, jobs):
    """A control-plane exception mid-replay is a bug, not bad input: one line naming the policy and
    the request and saying so, then the traceback; exit status 1 (bad input is 2)."""
    from saria.commands.cli import main
    from saria.control import ControlPlane

    real = ControlPlane.commit_prefill
    calls = [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 7:
            raise KeyError("injected")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ControlPlane, "commit_prefill", failing)
    policies = ["--policy", "saria"] + (["--policy", "dram-only"] if jobs > 1 else [])
    rc = main(["replay", SMALL, *CACHE, *policies, "--jobs", str(jobs)])
    err = capsys.readouterr().err
    first, rest = err.split("\n", 1)
    assert rc == 1
    assert first.startswith("saria replay: internal error in the control plane at request ")
    assert "(policy 'saria')" in first or "(policy 'dram-only')" in first
    assert "KeyError: 'injected'" in first and "This is a bug in saria" in first
    assert "Traceback" in rest and "injected" in rest

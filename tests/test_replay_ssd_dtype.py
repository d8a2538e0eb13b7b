"""``--ssd-dtype`` on ``saria replay`` / ``saria sweep`` and ``bench/bench_ssd_dtype.py``: auto is
today's replay exactly, fp8 writes and reads ~0.516x the SSD bytes at the same SSD capacity in
bytes and loses no hits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from saria.replay.experiment import Experiment, Point, open_trace
from saria.replay.policies import BaseSettings, parse_policy
from saria.replay.replay import ReplaySettings

ROOT = Path(__file__).resolve().parent.parent
SMALL = "synth:sessions=24,prompt_tokens=6000,first_prompt_tokens=2000,seed=5"
CACHE = ["--dram-tokens", "20000", "--ssd-tokens", "200000", "--window-hours", "1", "--no-progress"]
POLICIES = ["--policy", "saria", "--policy", "full-duplicate", "--policy", "lmcache-plus",
            "--policy", "saria:prewarm=true", "--policy", "saria:theta_R=none,write_budget=auto"]


def saria(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "saria.commands.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_auto_replays_exactly_as_without_the_option(tmp_path):
    paths = [tmp_path / "without.json", tmp_path / "auto.json"]
    for path, extra in zip(paths, ([], ["--ssd-dtype", "auto"])):
        proc = saria("replay", SMALL, *CACHE, *POLICIES, "--json", path, *extra)
        assert proc.returncode == 0, proc.stderr
    without, auto = (json.loads(p.read_text()) for p in paths)
    assert auto["results"] == without["results"]
    assert auto["config"]["ssd_dtype"] == "auto" and auto["config"]["ssd_kv_bytes"] == 512 * 147456


def _replay(dtype: str, policies=("saria", "full-duplicate", "saria:prewarm=true")) -> dict[str, dict]:
    base = BaseSettings(dram_tokens=20_000, ssd_tokens=200_000, ssd_dtype=dtype)
    exp = Experiment(open_trace(SMALL), SMALL, base, ReplaySettings(), arrivals="rewindow", window_hours=1.0,
                     workers=1, progress=False)
    results, runs = exp.run([Point(p, parse_policy(p)) for p in policies], references=False)
    assert all(run.config.ssd_dtype == dtype for run in runs)
    return {r["policy"]: r for r in results}


def test_fp8_writes_and_reads_the_fp8_bytes_and_keeps_the_hits():
    auto, fp8 = _replay("auto"), _replay("fp8")
    for name in auto:
        a, f = auto[name], fp8[name]
        assert 0 < f["ssd_write_bytes"] <= (1 - 0.45) * a["ssd_write_bytes"], name
        assert f["dram_hit_tokens"] + f["ssd_hit_tokens"] >= a["dram_hit_tokens"] + a["ssd_hit_tokens"], name
        assert f["char_mean"] >= a["char_mean"], name
        per_hit = [r["ssd_read_bytes"] / r["ssd_hit_tokens"] for r in (a, f)]
        assert per_hit[1] <= (1 - 0.45) * per_hit[0], name  # every SSD hit reloads the fp8 bytes
        assert f["normalized_writes"] < a["normalized_writes"]  # of the same capacity in bytes


def test_replay_and_sweep_take_the_option_and_say_so(tmp_path):
    out = tmp_path / "fp8.json"
    proc = saria("replay", SMALL, *CACHE, "--policy", "saria", "--ssd-dtype", "fp8", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "kv objects stored as fp8" in proc.stdout
    config = json.loads(out.read_text())["config"]
    assert config["ssd_dtype"] == "fp8" and config["ssd_bytes"] == 200_000 * 147456
    assert config["ssd_chunks"] == config["ssd_bytes"] // config["ssd_kv_bytes"] == 757  # auto: 390
    proc = saria("sweep", SMALL, *CACHE, "--theta-e", "2,3", "--ssd-dtype", "fp8", "--reference", "none",
                 "--json", tmp_path / "s.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "s.json").read_text())["config"]["ssd_dtype"] == "fp8"


@pytest.mark.parametrize("value", ["fp16", "FP8", ""])
def test_a_bad_ssd_dtype_is_a_usage_error(value):
    proc = saria("replay", SMALL, *CACHE, "--ssd-dtype", value)
    assert proc.returncode == 2 and "--ssd-dtype" in proc.stderr and "invalid choice" in proc.stderr


def test_help_explains_the_option():
    proc = saria("replay", "--help")
    assert "--ssd-dtype" in proc.stdout and "fp8" in proc.stdout and "e4m3" in proc.stdout


def test_bench_quick_table(tmp_path):
    out = tmp_path / "fp8.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ssd_dtype.py"), "--quick", "--jobs", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| synth:sessions=60 | one tenth |" in proc.stdout
    [row] = json.loads(out.read_text())
    assert row["verdict"]["ok"] and row["verdict"]["write_cut"] >= 0.45
    assert row["results"]["fp8"]["ssd_chunks"] > 1.9 * row["results"]["auto"]["ssd_chunks"]

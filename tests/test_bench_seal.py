"""``bench/bench_seal.py --quick`` runs end to end: AES-256-GCM rates, the SSD-only reload sealed
against unsealed through the transfer engine (every page compared with its source), the cluster get
sealed against Mooncake's own on a real master and storage node; each target printed MET or MISSED
with its number, everything in the JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_cases import MISSING as MOONCAKE_MISSING

ROOT = Path(__file__).resolve().parent.parent
TARGET_LINE = re.compile(r"^target (.+) >= (0\.\d+): (\d+\.\d{3}) -> (MET|MISSED)$", re.M)


def run(tmp_path, *args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "bench_seal.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_quick_bench(tmp_path):
    out = tmp_path / "seal.json"
    proc = run(tmp_path, "--quick", "--ssd-dir", str(tmp_path), "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    a = result["aead"]
    assert all(a[f"{op}_{t}t_GBps"] > 0.05 for op in ("seal", "open") for t in (1, 2)), a
    assert a["checksum_GBps"] > 0 and 0 <= a["gil_released"]
    assert a["part_key_us"] > 0 and a["part_gcm_us"] > 0 and a["seal_fixed_key_GBps"] > 0
    assert a["per_part_key_ratio"] > 0  # the share is computed before rounding to us: equal to 1e-9
    assert a["part_key_share"] == pytest.approx(a["part_key_us"] / a["part_gcm_us"], rel=1e-9)
    s = result["ssd"]
    assert s["plain_GBps"] > 0 and s["sealed_GBps"] > 0 and len(s["round_ratios"]) == 2
    assert s["sealed_counters"]["auth_failures"] == 0
    targets = {m[0]: (float(m[1]), float(m[2]), m[3]) for m in TARGET_LINE.findall(proc.stdout)}
    expected = {"SSD-only reload sealed / unsealed"}
    if MOONCAKE_MISSING is None:  # the cluster row is measured wherever the cluster tests run
        expected.add("cluster get sealed / Mooncake batch get")
        c = result["cluster"]["sealed"]
        assert c["sealed"] and c["get"]["ratio"] > 0 and c["counters"]
    else:
        assert "not measured" in proc.stdout
    assert set(targets) == expected, proc.stdout
    for t in result["targets"]:  # the lines and the JSON agree
        goal, value, verdict = targets[t["name"]]
        assert goal == t["target"] and abs(value - t["value"]) < 1e-3 and verdict == ("MET" if t["met"] else "MISSED")
        assert t["met"] == (t["value"] >= t["target"])
    assert not list(tmp_path.glob("saria-bench-seal-*")), "the bench left its SSD files behind"


def test_help_and_bad_arguments(tmp_path):
    proc = run(tmp_path, "--help")
    assert proc.returncode == 0 and "MET|MISSED" in proc.stdout and "--quick" in proc.stdout
    proc = run(tmp_path, "--chunks", "0")
    assert proc.returncode == 2 and "--chunks" in proc.stderr

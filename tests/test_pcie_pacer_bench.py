"""``bench/bench_pacer.py`` runs end to end (here on CPU tensors, small): it reports a verdict per
pace target, says why NVML figures are missing where there is no NVML, and ends with its JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_pacer.py"
CUDA = torch.cuda.is_available()


def run(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it on CPU
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


@pytest.mark.skipif(CUDA, reason="the small CPU run (a GPU runs the full bench from bench/gpu_check.sh)")
def test_pacer_bench_on_cpu():
    proc = run("--tokens", "512", "--seconds", "0.2", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    summary = json.loads(lines[-1])
    assert summary["device"] == "cpu" and summary["verified"] is True
    assert summary["tokens"] == 512 and summary["reload_bytes"] == 36 * 512 * 2 * 8 * 128 * 2
    assert summary["nvml"]["available"] is False and "NVML" in summary["nvml"]["reason"]
    assert "NVML unavailable" in proc.stdout and "host-timed figures only" in proc.stdout
    unpaced = summary["unpaced_gbps"]
    assert unpaced > 0 and summary["calibration"] == {"host_gbps": unpaced}
    targets = summary["targets"]
    assert [t["fraction"] for t in targets] == [0.25, 0.5, 0.75]
    verdicts = {}
    for line in lines:
        m = re.fullmatch(r"target pacer (\d+)%: delivered/target = (\d+\.\d\d) -> (MET|MISSED)", line)
        if m:
            verdicts[int(m[1])] = (float(m[2]), m[3])
    assert sorted(verdicts) == [25, 50, 75]
    assert not any("NVML:" in line and line.startswith("target") for line in lines)
    for t in targets:
        assert t["target_gbps"] == pytest.approx(t["fraction"] * unpaced, rel=1e-2, abs=2e-3)
        assert t["pace_gbps"] == pytest.approx(t["target_gbps"], abs=2e-3)
        assert t["delivered_gbps"] > 0 and t["seconds"] >= 0.2 * 0.9 and t["reloads"] >= 1
        assert t["paced_slices"] >= t["reloads"] * 18  # a 75.5 MB object is 18 host slots, each paced
        assert t["ratio"] == pytest.approx(t["delivered_gbps"] / t["target_gbps"], rel=2e-3)
        assert t["met"] is (abs(t["ratio"] - 1) <= 0.10)
        ratio, verdict = verdicts[round(t["fraction"] * 100)]
        assert ratio == pytest.approx(t["ratio"], abs=0.006) and (verdict == "MET") is t["met"]
        assert t["ratio"] < 1.10, "the pacer never lets DRAM run faster than B_pace"
        assert "nvml_rx_gbps" not in t
    assert summary["all_met"] is all(t["met"] for t in targets)


def test_pacer_bench_help_and_bad_arguments():
    proc = run("--help")
    assert proc.returncode == 0 and "NVML" in proc.stdout and "target pacer 25%" in proc.stdout
    proc = run("--fractions", "0.5,1.5")
    assert proc.returncode == 2 and "--fractions must each be in (0, 1)" in proc.stderr
    proc = run("--tokens", "100")
    assert proc.returncode == 2 and "--tokens must be a positive multiple of 512" in proc.stderr

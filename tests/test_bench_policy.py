"""``bench/bench_policy.py --quick`` runs end to end: every policy replayed, the oracle beside them,
the verdicts against the paper's E2R8 computed from the same records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_policy_table(tmp_path):
    out = tmp_path / "policy.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_policy.py"), "--quick", "--jobs", "2",
                           "--json", str(out), "--plot-dir", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "oracle" in proc.stdout and "E2R8 (paper)" in proc.stdout
    [row] = json.loads(out.read_text())
    results, verdicts = row["results"], row["verdicts"]
    assert set(results) == {"DRAM-only", "FD", "E2R8 (paper)", "E3R8", "oracle", "saria", "saria+session"}
    paper, fd = results["E2R8 (paper)"], results["FD"]
    assert results["DRAM-only"]["ssd_write_bytes"] == 0 and fd["retention"] == 1.0
    assert verdicts["E2R8 (paper)"]["dominates"] and verdicts["saria"]["dominates"]  # saria is >= E2R8
    assert results["oracle"]["useful_write_fraction"] > paper["useful_write_fraction"]
    assert list((tmp_path / "plots").glob("*.png"))


def test_quick_policy_table_with_an_fp8_ssd(tmp_path):
    """``--ssd-dtype fp8``: the same SSD bytes hold more chunks in FP8: every policy writes at most
    0.516x the bytes of its bf16 run per chunk written, and none hits less."""
    runs = {}
    for dtype in ("auto", "fp8"):
        out = tmp_path / f"{dtype}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_policy.py"), "--quick", "--jobs", "2",
                               "--ssd-dtype", dtype, "--json", str(out)],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [row] = json.loads(out.read_text())
        runs[dtype] = row["results"]
    assert runs["auto"]["FD"]["ssd_write_bytes"] > 0 and runs["auto"]["saria"]["ssd_write_bytes"] > 0
    for label, bf16 in runs["auto"].items():
        fp8 = runs["fp8"][label]
        assert fp8["char_mean"] >= bf16["char_mean"] - 1e-12, label
        assert fp8["ssd_write_bytes"] <= 0.516 * bf16["ssd_write_bytes"] + 1, label

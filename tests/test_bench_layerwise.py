"""``bench/bench_layerwise.py --host --quick`` runs end to end on this machine (CI's smoke run): the
per-layer host cost of layer-wise reloads through the transfer engine, every reloaded page compared
with its source, the target printed MET or MISSED with its number, p50 and p99 in the JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_LINE = re.compile(r"^target host_us_per_layer_p50 <= 20: (\d+\.\d) -> (MET|MISSED)$", re.M)


def run(tmp_path, script, *args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_quick_host_cost(tmp_path):
    out = tmp_path / "layerwise.json"
    proc = run(tmp_path, "bench_layerwise.py", "--host", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    p50, p99 = result["host_us_per_layer_p50"], result["host_us_per_layer_p99"]
    assert 0 < p50 <= p99, result
    host = result["host"]
    assert host["pages_ok"] and host["steps"] == 5 and host["layers"] == 8
    assert 0 < host["save_us_per_layer_p50"] <= host["save_us_per_layer_p99"]
    assert re.search(r"^target save_us_per_layer_p50 <= 20: \d+\.\d -> (MET|MISSED)$", proc.stdout, re.M)
    (value, verdict), = TARGET_LINE.findall(proc.stdout)
    assert abs(float(value) - p50) < 0.1 and verdict == ("MET" if p50 <= 20 else "MISSED")
    assert "benefit" not in result  # the GPU part needs CUDA


def test_help_and_bad_arguments(tmp_path):
    for script in ("bench_layerwise.py", "bench_layerwise_ttft.py"):
        proc = run(tmp_path, script, "--help")
        assert proc.returncode == 0 and "layer" in proc.stdout, proc.stderr
    proc = run(tmp_path, "bench_layerwise.py", "--steps", "0")
    assert proc.returncode == 2 and "--steps must be >= 1" in proc.stderr
    proc = run(tmp_path, "bench_layerwise_ttft.py", "--rounds", "0")
    assert proc.returncode == 2 and "--rounds must be >= 1" in proc.stderr

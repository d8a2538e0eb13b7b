"""``bench/bench_host.py`` (issue 42) runs end to end on this machine: the per-layer and public-op
parts of its ``--quick`` run (the connector parts take longer: run ``bench/bench_host.py --quick``
itself), every target printed MET or MISSED with the JSON's number; and the one line of
``bench/layerwise_decision.py`` that decides CUDA's ``layerwise`` default from a benefit table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from layerwise_decision import decide  # noqa: E402


def run(tmp_path, script, *args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_quick_layer_and_op_host_cost(tmp_path):
    out = tmp_path / "host.json"
    proc = run(tmp_path, "bench_host.py", "--quick", "--only", "layer", "--only", "op", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert 0 < result["layer_us_p50"] <= result["layer_us_p99"] and result["layer_objects"] == 8
    assert result["op_tensors"] == 36 and 0 < result["table_verify_us"]
    for key, target in (("layer_us_p50", 10), ("layer_us_p99", 30), ("op_host_us", 20)):
        (value, verdict), = re.findall(rf"^target {key} <= {target}: (\d+\.\d) -> (MET|MISSED)$", proc.stdout, re.M)
        assert abs(float(value) - result[key]) < 0.1 and verdict == ("MET" if result[key] <= target else "MISSED")
    assert "worker_step_us_p50" not in result


def row(p, n, seq, lw, ok=True):
    return {"P": p, "N": n, "sequential_s": seq, "layerwise_s": lw, "ideal_s": lw * 0.95, "compute_s": 1.0,
            "forward_beside_copies_s": 1.02, "pages_ok": ok}


@pytest.mark.parametrize("rows, on", [
    ([row(2048, 256, 1.0, 0.8), row(8192, 1024, 1.0, 0.7), row(32768, 4096, 1.0, 1.02)], True),
    ([row(2048, 256, 1.0, 0.8), row(8192, 1024, 1.0, 0.7), row(32768, 4096, 1.0, 1.05)], False),  # 5% slower once
    # no gain at the median
    ([row(2048, 256, 1.0, 1.01), row(8192, 1024, 1.0, 1.0), row(32768, 4096, 1.0, 0.9)], False),
    ([row(2048, 256, 1.0, 0.8), row(8192, 1024, 1.0, 0.7, ok=False)], False),  # wrong pages
])
def test_the_layerwise_default_is_decided_from_the_table(rows, on):
    decided, why = decide({"benefit": rows})
    assert decided is on and "layerwise/sequential" in why
    assert decide({"host": {}}) == (None, "no benefit table (bench_layerwise ran without CUDA, or with --host): "
                                          "nothing decided")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_the_cuda_race_refuses_in_one_line_without_cuda(tmp_path):
    proc = run(tmp_path, "gpu_race.py")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["gpu_race: needs CUDA (no CUDA device here); nothing run"]

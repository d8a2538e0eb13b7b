"""The reduced control-plane soak (``bench/control_soak.py --quick``) as part of the tests: every
policy preset over synth sessions (dense and hybrid) and the small shared traces, at tiny, medium
and larger-than-the-working-set capacities, with the audit on, a few minutes on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from saria.config import POLICY_PRESETS

SESSION_RULES = "saria:admission=eq1+session+prefix+cost,prefill_tps=6500,session_p=0.4"  # bench/control_soak.py
ROOT = Path(__file__).resolve().parent.parent


def test_quick_soak_runs_every_replay_without_an_exception_or_audit_failure(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "control_soak.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert records and all(r["ok"] for r in records)
    presets = {r["policy"] for r in records}
    assert presets == set(POLICY_PRESETS) | {SESSION_RULES}
    assert {r["capacity"] for r in records} == {"tiny", "medium", "large"}
    assert {r["model"] for r in records} == {"qwen3-8b", "qwen3-next-80b-a3b"}
    # The short window outlives few requests: metadata is reclaimed, many times over.
    assert sum(r["nodes_reclaimed"] for r in records if r["window_s"]) > 100_000
    assert "summary: " in proc.stdout and " 0 failed" in proc.stdout

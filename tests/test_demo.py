"""`saria demo` end to end, as `make demo` runs it (fewer turns): its verdict on the reloaded KV
bytes and on the outputs, its exit status and its JSON; then once more with vLLM on its AVX2
kernels (``tests/isa``: as an AVX2-only CPU runs it; docs/numerics.md). Long tests (two engine
starts each; ``SARIA_LONG_TESTS=1``): the engine tests of ``make test`` cover the same runner,
audit and comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def audit(checked, mismatched, unverified=0):
    return {"audit": {"stored_pages": checked, "checked_pages": checked, "mismatched_pages": mismatched,
                      "unverified_pages": unverified}}


@pytest.mark.parametrize("worker, hit, ok, line", [
    ({}, 64, False, "not audited"),
    (audit(0, 0), 64, False, "64 tokens were reused but no reloaded page was checked"),
    (audit(0, 0), 0, True, "nothing was reloaded"),
    (audit(4, 1), 64, False, "1 of 4 reloaded pages DIFFER"),
    (audit(4, 0, 2), 64, True, "each of the 4 pages saria reloaded is bit-for-bit the page vLLM computed"),
])
def test_the_byte_verdict_passes_only_on_checked_identical_pages(worker, hit, ok, line):
    from saria.commands.demo import audit_verdict

    got, text = audit_verdict(worker, hit)
    assert got is ok and line in text


def run_demo(tmp_path: Path, turns: int, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "demo.json"
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the demo's kernels: torch's
    environ.update(env)
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "demo", "--turns", str(turns), "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=environ)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def check_verdict(proc: subprocess.CompletedProcess, result: dict) -> None:
    assert result["kv_bytes_identical"] is True and result["outputs_ok"] is True and result["tokens_identical"]
    audit = result["audit"]
    assert audit["mismatched_pages"] == 0 and audit["checked_pages"] * 32 == result["hit_tokens"] > 0
    assert result["differing_turns"] == [] and result["max_logprob_diff"] == 0
    assert all(rank["missing"] == rank["unmatched"] == rank["ambiguous"] == 0 for rank in result["reference"])
    assert "is bit-for-bit the page vLLM computed" in proc.stdout
    assert "verdict: PASS" in proc.stdout and result["verdict"] in proc.stdout


@pytest.mark.long
def test_the_demo_reloads_from_dram_and_ssd_and_passes_its_verdict(tmp_path):
    proc, result = run_demo(tmp_path, 7)
    check_verdict(proc, result)
    assert result["requests"] == 7 and result["dram_hit_tokens"] > 0 and result["ssd_hit_tokens"] > 0
    assert 0 < result["ssd_write_bytes"] < result["full_duplicate_write_bytes"]


AVX2 = {"SARIA_EMULATE_ISA": "avx2", "PYTHONPATH": str(ROOT / "tests" / "isa"), "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.long
def test_the_demo_passes_with_vllms_avx2_kernels(tmp_path):
    probe = ("import torch; from vllm.v1.attention.backends.cpu_attn import _get_attn_isa; "
             "print(_get_attn_isa(torch.bfloat16, 32), torch.cpu._is_avx512_supported(), "
             "torch.backends.cpu.get_cpu_capability())")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env=dict(env, **AVX2)).stdout.split()
    assert seen[-3:] == ["vec", "False", "AVX2"], seen  # vLLM's attention and torch as on an AVX2-only CPU
    proc, result = run_demo(tmp_path, 7, **AVX2)
    check_verdict(proc, result)

"""The `saria` command: doctor, demo, help and bad arguments, run as a user runs them."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def saria(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "saria.commands.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_lists_commands():
    proc = saria("--help")
    assert proc.returncode == 0
    assert all(c in proc.stdout for c in ("doctor", "demo", "roundtrip", "serve", "cluster"))


def test_doctor_json_reports_backends():
    proc = saria("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    cuda = report["torch"]["cuda_available"]
    assert report["kernel_backend"]["device"] == ("cuda" if cuda else "cpu")
    assert report["kernel_backend"]["backend"] in ("triton", "torch")
    assert report["storage_backend"] in ("kvikio", "posix")
    if not cuda:
        assert report["storage_backend"] == "posix"
        assert report["nvml"]["available"] is False and "NVML" in report["nvml"]["reason"]
    assert report["pinned_memory"]["mem_total_bytes"] > 0


def test_doctor_text():
    proc = saria("doctor")
    assert proc.returncode == 0, proc.stderr
    for row in ("torch", "triton", "kernel backend", "NVML", "kvikio", "storage backend", "pinned memory"):
        assert row in proc.stdout


def test_kernel_round_trip(tmp_path):
    out = tmp_path / "roundtrip.json"
    proc = saria("roundtrip", "--chunk-tokens", "64", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "roundtrip: OK" in proc.stdout
    result = json.loads(out.read_text())
    assert result["ok"] and result["backends_agree"]
    assert result["chunk_bytes"] == 36 * 4 * 16 * 2 * 8 * 128 * 2  # 36 layers x 4 pages of 16 tokens
    sums = {tuple(b["checksums"]) for b in result["backends"].values()}
    assert len(sums) == 1  # both backends, same checksums


@pytest.mark.parametrize("args, message", [
    (["roundtrip", "--chunk-tokens", "100"], "multiple of the 16-token page"),
    (["roundtrip", "--chunks", "0"], "argument --chunks: must be from 1 to 4,096, got 0"),
    (["demo", "--turns", "1"], "argument --turns: must be from 2 to 1,000, got 1"),
])
def test_bad_arguments(args, message):
    proc = saria(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _kv_config(proc) -> dict:
    return json.loads(proc.stdout.strip().split(" '", 1)[1].rstrip("'"))["kv_connector_extra_config"]


def test_serve_takes_a_key_file_and_says_the_cluster_tier_needs_one(tmp_path):
    """--secret-file becomes the connector's secret_file (an absolute path; the file is loaded first:
    it must be usable); a cluster tier without a key is refused in one line unless --cluster-insecure."""
    from saria.seal import new_key_file

    key = tmp_path / "saria.key"
    new_key_file(key)
    proc = saria("serve", "m", "--secret-file", str(key), "--cluster", "h:1", "--print-command")
    assert proc.returncode == 0, proc.stderr
    assert _kv_config(proc) == {"secret_file": str(key), "cluster": "h:1"}
    proc = saria("serve", "m", "--cluster", "h:1", "--cluster-insecure", "--print-command")
    assert proc.returncode == 0 and _kv_config(proc) == {"cluster": "h:1", "cluster_insecure": True}
    for args, message in [(["--cluster", "h:1"], "the cluster tier needs a key: give secret_file"),
                          (["--cluster", "h:1", "--saria-option", "cluster_timeout_s=2"], "the cluster tier needs a key"),
                          (["--cluster-insecure"], "--cluster-insecure needs --cluster HOST:PORT"),
                          (["--cluster", "h:1", "--cluster-insecure", "--secret-file", str(key)],
                           "cluster_insecure with secret_file"),
                          (["--secret-file", str(tmp_path / "none")], "does not exist (make one with: saria keys new"),
                          (["--secret-file", ""], "--secret-file must not be empty"),
                          (["--saria-option", "secret_file=3"], "secret_file must be the path of a saria key file")]:
        proc = saria("serve", "m", *args, "--print-command")
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, (args, proc.stderr)


def test_bench_kernels_runs_and_writes_csv(tmp_path):
    out = tmp_path / "k.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_kernels.py"), "--min-seconds", "0",
                           "--csv", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    impls = {r["impl"] for r in rows}
    assert {"torch d2d copy (bound)", "torch baseline"} <= impls
    assert {r["table"] for r in rows} >= {"qwen3-8b"}
    smoke = [r for r in rows if "interpreter" in r["impl"] or r["device"] == "cuda"]
    assert smoke and all("False" not in r["note"] for r in smoke)


def test_bench_ingress_runs_all_modes_and_verifies(tmp_path):
    # As the benchmark runs on a CPU: the torch kernels, not Triton's interpreter (which conftest
    # sets for the kernel tests; it made this test 10x slower, 70 s, on 144 MiB of chunks).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ingress.py"), "--tokens", "1024", "--json",
                           "--ssd-dir", str(tmp_path), "--png", str(tmp_path / "t.png"), "--csv", str(tmp_path / "t.csv")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["verified"] is True and summary["tokens"] == 1024
    assert {"serial_s", "overlap_s", "coordinated_s", "dram_only_gbps", "copy_gbps"} <= set(summary)
    assert all(summary[k] > 0 for k in ("serial_s", "overlap_s", "coordinated_s", "dram_only_gbps", "copy_gbps"))
    modes = {row["mode"] for row in csv.DictReader((tmp_path / "t.csv").open())}
    assert modes == {"serial", "overlap", "coordinated"}

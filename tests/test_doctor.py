"""``saria doctor``'s storage report is the SSD store's own backend decision: on this machine the
two agree, and the doctor says why it is what it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from saria.commands import doctor
from saria.dataplane import SSDStore
from saria.dataplane.ssd.kvikio_status import choose_backend, kvikio_status

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


def test_doctor_and_the_store_agree(tmp_path):
    (tmp_path / "nvme0").mkdir()
    report = doctor.collect(ssd_path=str(tmp_path))
    storage = report["storage"]
    with SSDStore([tmp_path / "nvme0"], 4096 + 4 * (4096 + (1 << 20)), 1 << 20, backend="auto") as store:
        assert store.backend_name == storage["name"]
    assert report["storage_backend"] == storage["backend"] == storage["name"].split(" ")[0]
    assert report["kvikio"]["usable"] is (storage["backend"] == "kvikio" or "open_probe" in storage)
    expected = choose_backend("auto", kvikio_status())
    if "open_probe" not in storage:
        assert storage["description"] == expected.description and storage["mode"] == expected.mode
    assert storage["gds_active"] is (storage["mode"] == "gds")


@pytest.mark.skipif(CUDA, reason="checks the machine without CUDA")
def test_doctor_here_says_posix_and_why(tmp_path):
    report = doctor.collect(ssd_path=str(tmp_path))
    kv, storage = report["kvikio"], report["storage"]
    assert report["storage_backend"] == "posix" and storage["name"] == "posix" and storage["mode"] is None
    assert not kv["usable"] and not kv["gds_active"] and kv["mode"] is None and not kv["cuda"]
    assert "no CUDA device" in kv["reason"] and "no CUDA device" in storage["description"]
    if not kv["installed"]:
        assert "not installed" in kv["reason"]
        assert storage["description"] == "posix (pread/pwrite on a thread pool; kvikio not installed, no CUDA device)"
    text = doctor.render(report)
    [line] = [row for row in text.splitlines() if row.startswith("storage backend")]
    assert line.split(None, 2)[2] == storage["description"]
    [line] = [row for row in text.splitlines() if row.startswith("kvikio")]
    assert kv["reason"] in line


def test_doctor_cli_json_and_text_carry_the_storage_decision(tmp_path):
    run = [sys.executable, "-m", "saria.commands.cli", "doctor", "--ssd-path", str(tmp_path)]
    proc = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    storage = report["storage"]
    assert set(storage) >= {"backend", "mode", "name", "description", "reason", "gds_active"}
    assert report["storage_backend"] == storage["backend"]
    assert set(report["kvikio"]) >= {"installed", "version", "cuda", "usable", "reason", "compat_mode",
                                     "compat_preferred", "gds_available", "gds_active", "mode"}
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"storage backend  {storage['description']}" in proc.stdout

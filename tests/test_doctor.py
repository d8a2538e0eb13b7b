"""``saria doctor``'s storage report is the SSD store's own backend decision: on this machine the
two agree, and the doctor says why it is what it is. With ``--cluster HOST:PORT`` it checks a
Mooncake master: a real one (a master and a storage node on free ports) is usable; a dead one is
unreachable at once; a port that is no master is given up on at the check's deadline."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster_cases import SKIP_REASON, mooncake_available, start_cluster
from saria.commands import doctor
from saria.dataplane import SSDStore
from saria.dataplane.cluster.local import free_ports
from saria.dataplane.cluster.probe import check_client, check_port
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


# --- the cluster section (saria doctor --cluster HOST:PORT) --------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory, node_bytes=16 << 20)  # skips without Mooncake
    yield c
    c.stop()


def test_doctor_finds_a_running_cluster_usable(cluster):
    full = doctor.collect(cluster=cluster.master)
    report = full["cluster"]
    assert report["ok"] and report["master"] == cluster.master, report
    assert report["mooncake"]["importable"] and report["mooncake"]["mooncake_master"]
    assert report["port"] == {"ok": True, "reason": "accepts TCP connections"}
    assert report["client"]["ok"] and "answered a batch_is_exist probe" in report["client"]["reason"]
    text = doctor.render(full)
    assert re.search(rf"^cluster master +{cluster.master}: accepts TCP connections$", text, re.MULTILINE), text
    assert re.search(rf"^cluster +usable: saria serve --cluster {cluster.master}$", text, re.MULTILINE), text


def test_doctor_cli_reports_the_cluster_in_text_and_json(cluster):
    run = [sys.executable, "-m", "saria.commands.cli", "doctor", "--cluster", cluster.master]
    proc = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["cluster"]  # nothing but JSON on stdout: Mooncake's log lines stay apart
    assert report["ok"] and report["client"]["ok"], report
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"^cluster client +a Mooncake client set up in ", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(rf"^mooncake +{re.escape(report['mooncake']['version'])} ", proc.stdout, re.MULTILINE)


def test_doctor_says_a_dead_master_is_unreachable_at_once():
    master = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    t0 = time.monotonic()
    full = doctor.collect(cluster=master)
    report = full["cluster"]
    assert time.monotonic() - t0 < 5  # the whole doctor, no client tried
    assert not report["ok"] and not report["port"]["ok"] and not report["client"]["ok"]
    assert report["port"]["reason"].startswith("connection refused: nothing listens on that port")
    assert report["client"]["reason"] == "not tried: the master's port does not accept connections"
    assert re.search(r"^cluster +not usable \(see above\)$", doctor.render(full), re.MULTILINE)


@pytest.mark.skipif(not mooncake_available(), reason=SKIP_REASON)
def test_a_port_that_is_no_master_is_given_up_on_in_time():
    """A port that accepts connections and never answers (Mooncake's setup then waits 30 s, holding
    the GIL): the client check runs in a child process, killed at its deadline."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        held = []
        accepting = threading.Thread(target=lambda: held.append(server.accept()), daemon=True)
        accepting.start()
        master = f"127.0.0.1:{server.getsockname()[1]}"
        assert check_port(master)["ok"]
        t0 = time.monotonic()
        client = check_client(master, timeout_s=3)
        assert time.monotonic() - t0 < 5
    assert not client["ok"] and client["reason"].startswith("no answer within 3 s"), client


def test_doctor_without_mooncake_says_what_to_install():
    code = ("import sys; sys.modules['mooncake'] = None; from saria.commands.cli import main; "
            f"sys.exit(main(['doctor', '--json', '--cluster', '127.0.0.1:{free_ports(1)[0]}']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["cluster"]
    assert not report["ok"] and not report["mooncake"]["importable"]
    assert report["mooncake"]["install"] == "pip install 'saria[cluster]' and apt-get install -y libibverbs1"
    assert report["client"]["reason"] == "not tried: Mooncake is not importable"


@pytest.mark.parametrize("value, message", [("10.0.0.1", "must be HOST:PORT"), ("h:70000", "port must be from 1"),
                                            ("", "must be HOST:PORT")])
def test_doctor_refuses_a_bad_cluster_address(value, message):
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "doctor", "--cluster", value],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "saria doctor: error: argument --cluster: " in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr

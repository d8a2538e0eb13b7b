"""The SSD store's payload backend choice: what kvikio would do here (a pure decision from observed
facts), the backend it gives, and the store falling back to POSIX, with a log line, when kvikio
cannot run."""

from __future__ import annotations

import enum
import logging
import os

import pytest
import torch

from saria.dataplane.ssd.kvikio_status import (KvikioStatus, _compat_name, choose_backend, decide_kvikio, kvikio_facts,
                                           kvikio_status)
from saria.dataplane.ssd.backends import PosixPayloadIO, open_payload_io
from saria.dataplane.ssd.files import DriveFile, IoOps
from saria.dataplane.ssd.counters import SSDCounters
from saria.dataplane.ssd.errors import StoreConfigError

CUDA = torch.cuda.is_available()
try:
    import kvikio  # noqa: F401

    KVIKIO = True
except Exception:
    KVIKIO = False

# What the H200 VM showed (kvikio-cu13 26.10: compat mode AUTO, compat preferred, no GDS).
H200 = dict(installed=True, cuda=True, version="26.10.0", compat_mode="AUTO", compat_preferred=True)


# ------------------------------------------------------------------ the decision, from plain facts

@pytest.mark.parametrize("facts, usable, mode, name, words", [
    pytest.param(H200, True, "compat", "kvikio (compat mode)", ["AUTO chose compat", "no GPUDirect"], id="h200-auto"),
    pytest.param(dict(H200, compat_mode="ON"), True, "compat", "kvikio (compat mode)", ["ON was asked for"],
                 id="compat-on"),
    pytest.param(dict(H200, compat_preferred=False, gds_available=True), True, "gds", "kvikio (GDS)",
                 ["GDS available", "GPUDirect Storage"], id="gds"),
    pytest.param(dict(H200, compat_mode="OFF", compat_preferred=False, gds_available=True), True, "gds",
                 "kvikio (GDS)", ["compat mode OFF"], id="gds-off"),
    pytest.param(dict(H200, compat_preferred=False, gds_available=False), True, "compat", "kvikio (compat mode)",
                 ["no nvidia-fs", "no GPUDirect"], id="cufile-without-nvidia-fs"),
    pytest.param(dict(H200, compat_preferred=False, gds_available=None,
                      errors={"is_gds_available": "RuntimeError: cuFile isn't available"}),
                 True, "compat", "kvikio (compat mode)", ["unknown", "cuFile isn't available"], id="gds-unknown"),
    pytest.param(dict(installed=False, cuda=False), False, None, None, ["not installed", "no CUDA device"],
                 id="cpu-machine"),
    pytest.param(dict(installed=False, cuda=True), False, None, None, ["not installed", "saria[gds]"],
                 id="not-installed"),
    pytest.param(dict(installed=True, cuda=False, version="26.10.0"), False, None, None, ["no CUDA device"],
                 id="no-cuda"),
    pytest.param(dict(installed=True, cuda=True, version="26.10.0",
                      import_error="ImportError: libcuda.so.1: cannot open shared object file"),
                 False, None, None, ["import failed", "libcuda.so.1"], id="broken-import"),
    pytest.param(dict(installed=True, cuda=True, version="26.10.0", compat_mode=None, compat_preferred=None,
                      errors={"compat_mode": "AttributeError: module 'kvikio.defaults' has no attribute "
                                             "'compat_mode'"}),
                 False, None, None, ["cannot tell", "has no attribute 'compat_mode'"], id="query-failed"),
])
def test_decision_from_facts(facts, usable, mode, name, words):
    status = decide_kvikio(**facts)
    assert status.usable is usable and status.mode == mode and status.name == name
    assert status.gds_active is (mode == "gds")
    for w in words:
        assert w in status.reason, status.reason
    if usable:
        assert status.description.startswith(name.split(" (")[0] + " (")
        assert ("GPUDirect" in status.description) is (mode == "compat")  # "no GPUDirect" in compat mode
    else:
        assert status.description is None


def test_gds_is_never_claimed_in_compat_mode_even_with_gds_available():
    status = decide_kvikio(**dict(H200, compat_mode="ON", gds_available=True))
    assert status.mode == "compat" and not status.gds_active


def test_descriptions_tell_whose_posix_path():
    kvikio_compat = decide_kvikio(**H200)
    assert kvikio_compat.description == "kvikio (compat mode: kvikio's POSIX reads, no GPUDirect)"
    cufile_compat = decide_kvikio(**dict(H200, compat_preferred=False, gds_available=False))
    assert "cuFile" in cufile_compat.description and "no GPUDirect" in cufile_compat.description
    assert decide_kvikio(**dict(H200, compat_preferred=False, gds_available=True)).description == "kvikio (GDS)"


class CompatMode(enum.IntEnum):  # the shape of kvikio.CompatMode (its str() is the number on Python >= 3.11)
    OFF = 0
    ON = 1
    AUTO = 2


@pytest.mark.parametrize("value, name", [(CompatMode.AUTO, "AUTO"), (CompatMode.OFF, "OFF"), (2, "AUTO"),
                                         (1, "ON"), (True, "ON"), (False, "OFF")])
def test_compat_mode_names(value, name):
    assert _compat_name(value) == name


# ------------------------------------------------------------------ the backend it gives

def test_choose_backend():
    usable = decide_kvikio(**H200)
    auto = choose_backend("auto", usable)
    assert (auto.backend, auto.mode, auto.name) == ("kvikio", "compat", "kvikio (compat mode)")
    assert auto.description == usable.description and not auto.as_dict()["gds_active"]
    assert choose_backend("kvikio", usable).backend == "kvikio"
    assert choose_backend("posix", usable).name == "posix"
    gds = choose_backend("auto", decide_kvikio(**dict(H200, compat_preferred=False, gds_available=True)))
    assert gds.as_dict()["gds_active"] and gds.name == "kvikio (GDS)"

    cpu = choose_backend("auto", decide_kvikio(installed=False, cuda=False))
    assert cpu.backend == "posix" and cpu.name == "posix"
    assert cpu.description == "posix (pread/pwrite on a thread pool; kvikio not installed, no CUDA device)"
    with pytest.raises(StoreConfigError, match="kvikio.*needs CUDA"):
        choose_backend("kvikio", decide_kvikio(installed=False, cuda=False))
    with pytest.raises(StoreConfigError, match="not installed"):
        choose_backend("kvikio", decide_kvikio(installed=False, cuda=True))
    broken = decide_kvikio(installed=True, cuda=True, import_error="ImportError: boom")
    assert choose_backend("auto", broken).description.endswith("kvikio import failed)")
    with pytest.raises(StoreConfigError, match="not usable here.*import failed: ImportError: boom"):
        choose_backend("kvikio", broken)
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend("gds", usable)


# ------------------------------------------------------------------ this machine

def test_status_of_this_machine_never_raises_and_matches_its_facts():
    facts = kvikio_facts()
    status = kvikio_status()
    assert isinstance(status, KvikioStatus) and status == decide_kvikio(**facts)
    assert status.cuda is CUDA
    if not CUDA:
        assert not status.usable and "no CUDA device" in status.reason
        assert "compat_mode" not in facts  # kvikio is not imported without CUDA
    if not KVIKIO and not status.installed:
        assert "not installed" in status.reason


def drive_files(tmp_path, n=2):
    files = []
    for i in range(n):
        path = tmp_path / f"drive{i}.bin"
        path.write_bytes(b"\0" * 8192)
        files.append(DriveFile(path, os.open(path, os.O_RDWR), False, IoOps(), SSDCounters()))
    return files


@pytest.mark.skipif(CUDA, reason="checks the machine without CUDA")
def test_open_payload_io_here_is_posix_and_says_why(tmp_path, caplog):
    files = drive_files(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="saria.dataplane.ssd"):
            io = open_payload_io("auto", files, 4096, SSDCounters())
        assert isinstance(io, PosixPayloadIO) and io.name == "posix"
        [record] = [r for r in caplog.records if "SSD store uses POSIX" in r.getMessage()]
        assert "no CUDA device" in record.getMessage() and record.levelno == logging.INFO
        with pytest.raises(StoreConfigError, match="kvikio.*needs CUDA"):
            open_payload_io("kvikio", files, 4096, SSDCounters())
    finally:
        for f in files:
            f.close()


@pytest.mark.skipif(KVIKIO, reason="needs a machine where kvikio cannot be imported")
def test_a_kvikio_that_cannot_open_falls_back_to_posix_with_a_warning(tmp_path, caplog):
    """Decided usable (the H200's facts) but the import fails on opening the files here: ``auto``
    falls back to POSIX with one warning saying why; ``kvikio`` is a StoreConfigError."""
    files = drive_files(tmp_path)
    status = decide_kvikio(**H200)
    try:
        with caplog.at_level(logging.INFO, logger="saria.dataplane.ssd"):
            io = open_payload_io("auto", files, 4096, SSDCounters(), status=status)
        assert isinstance(io, PosixPayloadIO)
        [record] = [r for r in caplog.records if "SSD store uses POSIX" in r.getMessage()]
        assert record.levelno == logging.WARNING
        assert "could not open the drive files" in record.getMessage() and "kvikio" in record.getMessage()
        with pytest.raises(StoreConfigError, match=r"kvikio \(kvikio \(compat mode\)\) could not open"):
            open_payload_io("kvikio", files, 4096, SSDCounters(), status=status)
        io = open_payload_io("auto", files, 4096, SSDCounters(), status=decide_kvikio(
            installed=True, cuda=True, import_error="ImportError: boom"))  # broken install: warned, POSIX
        assert isinstance(io, PosixPayloadIO)
        assert caplog.records[-1].levelno == logging.WARNING and "import failed" in caplog.records[-1].getMessage()
    finally:
        for f in files:
            f.close()


@pytest.mark.skipif(not (CUDA and KVIKIO), reason="needs CUDA and kvikio")
def test_kvikio_payload_io_reports_the_decided_mode(tmp_path):
    files = drive_files(tmp_path)
    status = kvikio_status()
    try:
        io = open_payload_io("auto", files, 4096, SSDCounters())
        if status.usable:
            assert io.name == status.name and io.mode == status.mode and io.gds_active is status.gds_active
            assert io.name in ("kvikio (GDS)", "kvikio (compat mode)")
        else:
            assert io.name == "posix"
        io.close()
    finally:
        for f in files:
            f.close()

"""`saria cluster start`: a Mooncake master and storage node run in the foreground, as a user runs
them. Started as a subprocess: its printed master address takes a client (the doctor's check);
SIGTERM stops both processes; a node that dies takes the master with it and the command says so.
Bad arguments are one line and exit status 2 before anything starts, in process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_cases import NO_LIBIBVERBS, NO_MOONCAKE, SKIP_REASON, mooncake_available, without_mooncake
from saria.commands import cli
from saria.dataplane.cluster.probe import check_client

ROOT = Path(__file__).resolve().parent.parent
NEEDS_MOONCAKE = pytest.mark.skipif(not mooncake_available(), reason=SKIP_REASON)


class Started:
    """``saria cluster start`` in a subprocess, read until it printed its master and node."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "saria.commands.cli", "cluster", "start", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("Ctrl-C or SIGTERM"):
                break
        text = "".join(self.lines)
        master = re.search(r"^saria cluster: master at (\S+) \(pid (\d+)\)", text, re.MULTILINE)
        node = re.search(r"^saria cluster: storage node with .* \(pid (\d+), port (\d+)\)", text, re.MULTILINE)
        assert master and node, text + self.proc.stderr.read()
        self.master, self.master_pid, self.node_pid = master.group(1), int(master.group(2)), int(node.group(1))
        self.text = text

    def finish(self, timeout: float = 30) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, "".join(self.lines) + out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@NEEDS_MOONCAKE
def test_start_serves_a_client_and_sigterm_stops_both(tmp_path):
    started = Started("--node-gb", "0.05", "--logdir", str(tmp_path / "logs"))
    try:
        assert f"saria serve MODEL --cluster {started.master}" in started.text
        assert "mooncake_master --rpc_port=" in started.text
        assert "mooncake_client --master_server_address=MASTER_ADDRESS:" in started.text
        assert "--global_segment_size=53687091" in started.text  # 0.05 GiB, in bytes
        check = check_client(started.master)
        assert check["ok"], check
        started.proc.send_signal(signal.SIGTERM)
        rc, out, err = started.finish()
    finally:
        started.kill()
    assert rc == 0, err
    assert f"stopped the master (pid {started.master_pid}) and the storage node (pid {started.node_pid})" in out
    assert gone(started.master_pid) and gone(started.node_pid)
    assert "Traceback" not in err
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"master-1.log", "node-2.log"}


@NEEDS_MOONCAKE
def test_a_node_that_dies_stops_the_master_and_is_named(tmp_path):
    started = Started("--node-gb", "0.05", "--logdir", str(tmp_path))
    try:
        os.kill(started.node_pid, signal.SIGKILL)
        rc, _, err = started.finish()
    finally:
        started.kill()
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"saria cluster start: error: mooncake storage node (pid {started.node_pid}) was killed by "
                          "SIGKILL"), err
    assert "the other process is stopped too" in err and str(tmp_path / "node-2.log") in err
    assert gone(started.master_pid)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = cli.main(list(args))
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--node-gb", "0.001"], "argument --node-gb: must be at least 0.015625 (16 MiB"),
    (["--node-gb", "-1"], "argument --node-gb: must be from 0"),
    (["--node-gb", str(1 << 30)], "argument --node-gb: this host has"),
    (["--rpc-port", "0"], "argument --rpc-port: must be from 1 to 65,535, got 0"),
    (["--rpc-port", "TAKEN"], "--rpc-port TAKEN: cannot listen on it here: in use"),
    (["--node-port", "TAKEN"], "--node-port TAKEN: cannot listen on it here: in use"),
    (["--rpc-port", "40001", "--metrics-port", "40001"], "--metrics-port 40001 is also the --rpc-port"),
    (["--host", "192.0.2.1"], "--host 192.0.2.1 is not an address of this host"),
    (["--host", "0.0.0.0"], "give the address other hosts reach this one at, not 0.0.0.0"),
    (["--host", "10.0.0.1:50051"], "argument --host: not a host name or IPv4 address"),
    (["--logdir", "FILE"], "is not a directory"),
    (["--logdir", ""], "--logdir must not be empty"),
])
def test_bad_arguments_are_one_line_and_status_2(capsys, tmp_path, taken_port, args, message):
    (tmp_path / "f").write_text("")
    args = [a.replace("TAKEN", str(taken_port)).replace("FILE", str(tmp_path / "f")) for a in args]
    message = message.replace("TAKEN", str(taken_port))
    rc, out, err = run_cli(capsys, "cluster", "start", *args)
    assert rc == 2 and out == "", out
    assert err.count("\n") == 1 and err.startswith("saria cluster start: error: ") and message in err, err


@pytest.mark.parametrize("which, missing", [("no-wheel", NO_MOONCAKE), ("no-libibverbs", NO_LIBIBVERBS)])
def test_without_mooncake_it_says_what_to_install(tmp_path, which, missing):
    # as on a machine without the extra, or with it and without libibverbs1 (whatever this one has):
    # "Mooncake Store is not installed completely: libibverbs.so.1 (Debian/Ubuntu package libibverbs1)
    # is missing: apt-get install -y libibverbs1"
    line = ": ".join(missing)
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "cluster", "start", "--node-gb", "0.05"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=without_mooncake(tmp_path, which))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr == f"saria cluster start: error: {line}\n", proc.stderr


def test_help_explains_ports_hosts_and_stopping():
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "cluster", "start", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0
    flat = " ".join(proc.stdout.split())
    for needle in ("--node-gb", "--host", "--rpc-port", "--metrics-port", "--node-port", "--logdir",
                   "50051 (Mooncake's usual one) when it is free, else a free port", "saria serve --cluster",
                   "Ctrl-C or SIGTERM", "mooncake_client"):
        assert needle in flat, needle
    top = subprocess.run([sys.executable, "-m", "saria.commands.cli", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "cluster" in top.stdout

"""A Mooncake master and storage node on this host, on free ports, for tests, benchmarks and a
first try (docs/cluster.md has the commands to run them for real, one storage node per host).

:class:`LocalCluster` starts ``mooncake_master`` and one ``mooncake_client`` (the storage node,
holding ``node_bytes`` of pool memory), every port of each given explicitly (Mooncake's defaults
are fixed ports), waits until each is truly up (a master on a taken port logs "started" and exits:
the process and its ports are polled) and stops them by process id.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def find_binary(name: str) -> str | None:
    """``mooncake_master`` / ``mooncake_client``: the executable inside the wheel's package (the
    console script of the same name is a wrapper around it), else on PATH."""
    try:
        import mooncake
        path = Path(mooncake.__file__).parent / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except Exception:  # noqa: BLE001
        pass
    return shutil.which(name)


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalCluster:
    """One ``mooncake_master`` and one storage node (``mooncake_client`` holding ``node_bytes``),
    every port of each given explicitly; ``master`` is the address clients use."""

    def __init__(self, logdir: str | os.PathLike, node_bytes: int = 256 << 20):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.node_bytes = node_bytes
        self.rpc, self.metrics, self.http_meta, self.node_port, self.node_http = free_ports(5)
        self.master = f"127.0.0.1:{self.rpc}"
        self.master_proc: subprocess.Popen | None = None
        self.node_proc: subprocess.Popen | None = None
        self._starts = 0

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        self._starts += 1
        log = open(self.logdir / f"{name}-{self._starts}.log", "wb")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start_master(self, timeout: float = 20.0) -> None:
        argv = [find_binary("mooncake_master"), f"--rpc_port={self.rpc}", f"--metrics_port={self.metrics}",
                "--metrics_host=127.0.0.1", f"--http_metadata_server_port={self.http_meta}", "--logtostderr"]
        self.master_proc = self._spawn(argv, "master")
        # A master on a taken port logs "started" and exits: poll the process and both ports.
        self._wait(lambda: _listening(self.rpc) and self._health(), self.master_proc, "master", timeout)

    def start_node(self, timeout: float = 20.0) -> None:
        argv = [find_binary("mooncake_client"), f"--master_server_address={self.master}",
                "--metadata_server=P2PHANDSHAKE", "--host=127.0.0.1", "--protocol=tcp",
                f"--port={self.node_port}", f"--http_port={self.node_http}",
                f"--global_segment_size={self.node_bytes}", "--logtostderr"]
        self.node_proc = self._spawn(argv, "node")
        self.wait_mounted(timeout)

    def wait_mounted(self, timeout: float = 20.0) -> None:
        """Until the master counts the node's memory (after a start, or a master restart)."""
        self._wait(lambda: self.metric("master_total_capacity_bytes") >= self.node_bytes, self.node_proc,
                   "storage node", timeout)

    def _wait(self, ready, proc: subprocess.Popen | None, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"mooncake {what} exited with {proc.returncode} (logs in {self.logdir})")
            if self.master_proc is not None and self.master_proc.poll() is not None:
                raise RuntimeError(f"mooncake master exited with {self.master_proc.returncode} (logs in {self.logdir})")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"mooncake {what} not up within {timeout:g} s (logs in {self.logdir})")

    def _health(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/health", timeout=1) as r:
            return r.status == 200

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=1) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def kill_master(self) -> None:
        _stop(self.master_proc, signal.SIGKILL)
        self.master_proc = None

    def pause_node(self) -> None:
        os.kill(self.node_proc.pid, signal.SIGSTOP)

    def resume_node(self) -> None:
        os.kill(self.node_proc.pid, signal.SIGCONT)

    def start(self) -> "LocalCluster":
        """Start the master, then the storage node; stops what started if either fails."""
        try:
            self.start_master()
            self.start_node()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.node_proc is not None:
            self.resume_node()
        for proc in (self.node_proc, self.master_proc):
            _stop(proc, signal.SIGTERM)
        self.node_proc = self.master_proc = None


def _stop(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()



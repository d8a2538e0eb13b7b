"""Shared set-up of the cluster store tests: a real Mooncake master and one storage node on free
ports, started and stopped by process id, and helpers to fill and check objects.

Mooncake is an optional extra: without it the tests skip, saying how to install it.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

SKIP_REASON = ("Mooncake Store is not installed: pip install -e '.[cluster]' "
               "(and apt-get install -y libibverbs1) to run the cluster tests")


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except Exception:  # noqa: BLE001 - missing wheel or missing libibverbs: both mean "not here"
        return False
    return find_binary("mooncake_master") is not None


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


class MooncakeCluster:
    """One ``mooncake_master`` and one storage node (``mooncake_client`` holding ``node_bytes``),
    every port of each given explicitly; ``master`` is the address clients use."""

    def __init__(self, logdir: Path, node_bytes: int = 256 << 20):
        self.logdir = Path(logdir)
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


def start_cluster(tmp_path_factory, node_bytes: int = 256 << 20) -> MooncakeCluster:
    """A started cluster (the caller stops it); skips the test when Mooncake is not installed."""
    if not mooncake_available():
        pytest.skip(SKIP_REASON)
    cluster = MooncakeCluster(tmp_path_factory.mktemp("mooncake"), node_bytes)
    try:
        cluster.start_master()
        cluster.start_node()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@functools.lru_cache(maxsize=1)
def _noise() -> torch.Tensor:
    g = torch.Generator().manual_seed(20261205)
    return torch.randint(0, 256, (PATTERN_MAX + 65536,), generator=g, dtype=torch.uint8)


PATTERN_MAX = 16 << 20


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Deterministic bytes of an object of up to 16 MiB (the same in every process): seeded noise
    at an offset, every byte xor-ed with the seed's byte (two seeds differ in every byte)."""
    off = (seed * 4099) % 65536
    return _noise()[off:off + nbytes] ^ (seed % 255 + 1)


def fill(views: list[torch.Tensor], seed: int) -> None:
    data = pattern(sum(v.numel() for v in views), seed)
    off = 0
    for v in views:
        v.copy_(data[off:off + v.numel()])
        off += v.numel()


def matches(views: list[torch.Tensor], seed: int) -> bool:
    return torch.equal(torch.cat([v for v in views]), pattern(sum(v.numel() for v in views), seed))

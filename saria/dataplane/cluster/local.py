"""A Mooncake master and storage node on this host, for tests, benchmarks, a first try and
``saria cluster start`` (docs/cluster.md has the commands to run them by hand, one storage node
per host).

:class:`LocalCluster` starts ``mooncake_master`` and one ``mooncake_client`` (the storage node,
holding ``node_bytes`` of pool memory), every port of each given explicitly (the ones asked for,
the others free ports: Mooncake's defaults are fixed ports), waits until each is truly up (a
master on a taken port logs "started" and exits: the process and its ports are polled) and stops
them by process id.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Collection
from pathlib import Path

from saria.safe_files import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, file_problem, shown


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


def free_ports(n: int, avoid: Collection[int] = ()) -> list[int]:
    """``n`` distinct ports free on every address of this host, none of them in ``avoid``."""
    socks = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)  # held until all are picked: the kernel hands out each one once
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _last_error(log: Path, levels: str = "EF") -> str:
    """The text of the last line of one of glog's ``levels`` in ``log`` (``E1205 12:24:39.438529  3511
    file.cpp:63] text``: E error, F fatal); "" when there is none."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line[:1] in levels and line[1:5].isdigit() and "] " in line:
            return line.split("] ", 1)[1].strip()
    return ""


_WHAT = {"master": "mooncake master", "node": "mooncake storage node"}



def open_log(path: Path):
    """``path`` opened to write a process's log from its start: created 0600, or an earlier run's
    log emptied, never through a symbolic link, never a FIFO, a file of another user or one with
    another link (a ``--logdir`` may be shared: nothing else there is truncated); ``OSError``
    naming the path otherwise (docs/security.md, "Files on the box")."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0o600)
    try:
        problem = file_problem(os.fstat(fd))
        if problem:
            raise OSError(errno.EPERM, f"{problem}: refused, left as it is")
        os.ftruncate(fd, 0)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_NONBLOCK)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise

class LocalCluster:
    """One ``mooncake_master`` and one storage node (``mooncake_client`` holding ``node_bytes``),
    every port of each given explicitly; ``master`` is the address clients use.

    Args:
        logdir: where each process's log goes (``master-1.log``, ``node-2.log``: one per start,
            numbered in the order started); None: a new temporary directory.
        node_bytes: the storage node's pool memory (Mooncake takes at least 16 MiB).
        host: this host's address as clients reach it: the storage node advertises it, the
            master's metrics server listens on it (its RPC server listens on every address).
        rpc_port, metrics_port, node_port: the master's RPC and HTTP metrics ports and the node's
            service port; None: a free port.
        own_process_group: start both in a process group of their own, so that a Ctrl-C at the
            terminal reaches only this process, which then stops them in order (``saria cluster
            start``); by default they share the caller's group and die with its Ctrl-C.
    """

    def __init__(self, logdir: str | os.PathLike | None = None, node_bytes: int = 256 << 20, *,
                 host: str = "127.0.0.1", rpc_port: int | None = None, metrics_port: int | None = None,
                 node_port: int | None = None, own_process_group: bool = False):
        self.logdir = Path(tempfile.mkdtemp(prefix="saria-cluster-") if logdir is None else logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.node_bytes = node_bytes
        self.host = host
        asked = [p for p in (rpc_port, metrics_port, node_port) if p is not None]
        if len(set(asked)) < len(asked):
            raise ValueError(f"the master's RPC and metrics ports and the node's port must differ, got {asked}")
        free = iter(free_ports(5, avoid=asked))
        self.rpc = next(free) if rpc_port is None else rpc_port
        self.metrics = next(free) if metrics_port is None else metrics_port
        self.node_port = next(free) if node_port is None else node_port
        self.http_meta, self.node_http = next(free), next(free)
        self.master = f"{host}:{self.rpc}"
        self.master_proc: subprocess.Popen | None = None
        self.node_proc: subprocess.Popen | None = None
        self._own_group = own_process_group
        self._logs: dict[str, Path] = {}
        self._starts = 0

    def master_command(self, program: str | None = None) -> list[str]:
        """The master's command line (``program``: the executable, default the wheel's binary)."""
        return [program or find_binary("mooncake_master"), f"--rpc_port={self.rpc}", f"--metrics_port={self.metrics}",
                f"--metrics_host={self.host}", f"--http_metadata_server_port={self.http_meta}", "--logtostderr"]

    def node_command(self, program: str | None = None, *, master: str | None = None,
                     host: str | None = None) -> list[str]:
        """The storage node's command line; ``master`` and ``host`` default to this cluster's (another
        host's node names its own address and this master's)."""
        return [program or find_binary("mooncake_client"), f"--master_server_address={master or self.master}",
                "--metadata_server=P2PHANDSHAKE", f"--host={host or self.host}", "--protocol=tcp",
                f"--port={self.node_port}", f"--http_port={self.node_http}",
                f"--global_segment_size={self.node_bytes}", "--logtostderr"]

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        self._starts += 1
        self._logs[name] = self.logdir / f"{name}-{self._starts}.log"
        try:
            log_file = open_log(self._logs[name])
        except OSError as exc:  # a start that cannot be told from the outside: one line, as a child's failure
            why = "is a symbolic link: refused, left as it is" if exc.errno == errno.ELOOP else exc.strerror or exc
            raise RuntimeError(f"the {name}'s log {shown(self._logs[name])}: {why}") from None
        with log_file as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    process_group=0 if self._own_group else None)

    def start_master(self, timeout: float = 20.0) -> None:
        self.master_proc = self._spawn(self.master_command(), "master")
        # A master on a taken port logs "started" and exits: poll the process and both ports.
        self._wait(lambda: _listening(self.host, self.rpc) and self._health(), "master", timeout)

    def start_node(self, timeout: float = 20.0) -> None:
        self.node_proc = self._spawn(self.node_command(), "node")
        self.wait_mounted(timeout)

    def wait_mounted(self, timeout: float = 20.0) -> None:
        """Until the master counts the node's memory (after a start, or a master restart)."""
        self._wait(lambda: self.metric("master_total_capacity_bytes") >= self.node_bytes, "node", timeout)

    def exited(self) -> str | None:
        """Why the cluster is down, when its master or node process has exited (else None)."""
        for name, proc in (("master", self.master_proc), ("node", self.node_proc)):
            if proc is not None and proc.poll() is not None:
                return self._exit_message(name, proc)
        return None

    def _exit_message(self, name: str, proc: subprocess.Popen) -> str:
        code = proc.returncode
        if code < 0:  # a signal: glog's fatal line says why when it aborted; its error lines are older news
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            error = _last_error(self._logs[name], "F")
        else:
            how, error = f"exited with {code}", _last_error(self._logs[name])
        return f"{_WHAT[name]} (pid {proc.pid}) {how}" + (f": {error}" if error else "") + f" (log: {self._logs[name]})"

    def _wait(self, ready, name: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            down = self.exited()
            if down:
                raise RuntimeError(down)
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{_WHAT[name]} not up within {timeout:g} s (log: {self._logs[name]})")

    def _health(self) -> bool:
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics}/health", timeout=1) as r:
            return r.status == 200

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics}/metrics", timeout=1) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def kill_master(self) -> None:
        _stop(self.master_proc, signal.SIGKILL)
        self.master_proc = None

    def pause_node(self, timeout: float = 10.0) -> None:
        """Stop the storage node (SIGSTOP) and return once every thread of it has stopped: ``kill``
        returns before that, and a node thread still running (one that the CPU had not scheduled yet)
        can serve a request sent after it."""
        self.node_proc.send_signal(signal.SIGSTOP)
        end = time.monotonic() + timeout
        while not _stopped(self.node_proc.pid):
            if time.monotonic() >= end:
                raise RuntimeError(f"{_WHAT['node']} (pid {self.node_proc.pid}) not stopped within {timeout:g} s")
            time.sleep(0.001)

    def resume_node(self) -> None:
        self.node_proc.send_signal(signal.SIGCONT)  # nothing when it has exited (and been reaped)

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


def _stopped(pid: int) -> bool:
    """Whether no thread of process ``pid`` can run: each is stopped or traced (``T``/``t`` in
    ``/proc/<pid>/task/*/stat``), or the process is gone or a zombie."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that exited
        state = stat[stat.rindex(b")") + 2:][:1]  # the field after the command name, which may hold ")"
        if state not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def _stop(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()



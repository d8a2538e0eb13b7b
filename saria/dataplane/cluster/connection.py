"""The store's one Mooncake client and the tier's health: on, or off and reconnecting.

The client contributes no memory to the pool (``global_segment_size`` 0: objects live in the
storage nodes, ``mooncake_client`` processes, never in the process that wrote them; it keeps a
16 MiB local buffer for Mooncake's copying calls) and registers
the host memory the store moves bytes from and into once per client, at setup.

Mooncake's client setup against a dead master retries for ~4.4 s per attempt (its default, 20
attempts, is ~90 s), holding the GIL all along (every thread of the process stops). So the store
sets ``MC_STORE_CLIENT_SETUP_RETRIES`` to 1 unless the environment says otherwise, calls setup
only once the master's port accepts a TCP connection (a plain socket connect, ``connect_timeout_s``),
and never on the caller's thread: setup runs on the health thread and the constructor waits for it
at most ``setup_wait_s``. When setup fails, or a call finds the
master unreachable (status -900, RPC_FAIL), the tier turns off with one warning; every call is then
a quick :class:`~saria.dataplane.cluster.errors.ClusterOff` miss while the health thread probes
(with the client that had worked: Mooncake's client reconnects by itself once a master listens
again; or with a fresh client when setup never succeeded), backing off from ``retry_min_s`` to
``retry_max_s``, and logs once when the tier is back. A restarted master knows no key: every
object written before is a miss.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from saria.dataplane.devices import bind_thread, resolve

log = logging.getLogger("saria.dataplane.cluster")

RPC_FAIL = -900  # Mooncake: the master could not be reached
SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
_PROBE_KEY = "saria/probe"
# The client's own staging memory (not pool memory): Mooncake's copying calls (``get_batch``, used
# for metadata values of unknown size) allocate from it; with 0 they fail.
LOCAL_BUFFER_BYTES = 16 << 20


LIBIBVERBS = "libibverbs.so.1"  # the OS library Mooncake's wheel loads, even over TCP
INSTALL_LIBIBVERBS = "apt-get install -y libibverbs1"
INSTALL_MOONCAKE = "pip install 'saria[cluster]'"


class MooncakeMissing(ImportError):
    """Mooncake Store cannot be imported here: ``str()`` is the one line saying what is missing and
    the command that installs it (``reason: install``).

    Attributes:
        kind: ``"libibverbs"`` (the wheel is there, the OS library it loads is not), ``"package"``
            (no ``mooncake`` package, or one without ``mooncake.store``) or ``"other"``.
        reason: what is wrong, e.g. ``Mooncake Store is not installed``.
        install: the command that installs what is missing.
        error: the import's own error text.
    """

    def __init__(self, kind: str, reason: str, install: str, error: str):
        super().__init__(kind, reason, install, error)  # all four: it pickles (a worker's error)
        self.kind, self.reason, self.install, self.error = kind, reason, install, error

    def __str__(self) -> str:
        return f"{self.reason}: {self.install}"


def mooncake_missing(exc: ImportError) -> MooncakeMissing:
    """What the failed import of ``mooncake.store`` (``exc``) says is missing, and how to install it:
    the one place the cluster tier's commands and errors take this from."""
    error = str(exc) or type(exc).__name__
    if LIBIBVERBS in error:  # "libibverbs.so.1: cannot open shared object file: No such file or directory"
        return MooncakeMissing("libibverbs", f"Mooncake Store is not installed completely: {LIBIBVERBS} "
                               "(Debian/Ubuntu package libibverbs1) is missing", INSTALL_LIBIBVERBS, error)
    name = (exc.name or "") if isinstance(exc, ModuleNotFoundError) else ""
    if name == "mooncake" or name.startswith("mooncake."):  # "No module named 'mooncake'"
        return MooncakeMissing("package", "Mooncake Store is not installed", INSTALL_MOONCAKE, error)
    return MooncakeMissing("other", f"Mooncake Store is not installed correctly ({error})", INSTALL_MOONCAKE, error)


def import_store_class() -> Any:
    """Mooncake's ``MooncakeDistributedStore``; :class:`MooncakeMissing` (an ``ImportError``) saying
    what is missing and how to install it when it cannot be imported."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise mooncake_missing(exc) from exc
    return MooncakeDistributedStore


_IMPORT_CHECK = """import json
try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as exc:
    print(json.dumps([type(exc).__name__, str(exc), exc.name]))
"""


def store_class_missing(timeout_s: float = 60.0) -> MooncakeMissing | None:
    """What :func:`import_store_class` would raise here, found by importing ``mooncake.store`` in a
    child process (this Python, this environment); ``None`` when it imports. For a process that
    forks others after the check (``saria serve`` before vLLM starts its engine): the import starts
    Mooncake's own threads, which a forked process would lack."""
    try:
        proc = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return mooncake_missing(ImportError(f"importing mooncake.store took over {timeout_s:g} s"))
    lines = proc.stdout.strip().splitlines()
    if lines and lines[-1].startswith("["):
        kind, message, name = json.loads(lines[-1])
        return mooncake_missing((ModuleNotFoundError if kind == "ModuleNotFoundError" else ImportError)(
            message, name=name))
    if proc.returncode != 0:  # not an ImportError: a crash, or another exception
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [f"exit status {proc.returncode}"]
        return mooncake_missing(ImportError(f"importing mooncake.store failed: {last[0][:300]}"))
    return None


class Connection:
    """One Mooncake client and whether the tier is on.

    Args:
        master: the master's RPC address, ``host:port``.
        local_hostname: this host's address as the storage nodes can reach it.
        ranges: ``(pointer, bytes)`` of every memory range to register with each client.
        counters: the store's counters (``went_off`` / ``came_back``).
        setup_wait_s: how long the constructor waits for the first setup.
        retry_min_s, retry_max_s: the reconnect backoff.
        protocol: Mooncake's transport (``"tcp"``; ``"rdma"`` where the hosts have it).
        connect_timeout_s: the TCP check of the master's port before a setup or probe.
        device: made current on the health thread first (it sets clients up and registers memory
            with them; :mod:`saria.dataplane.devices`); ``None``: the device current on the calling thread.
    """

    def __init__(self, master: str, local_hostname: str, ranges: Sequence[tuple[int, int]], counters: Any,
                 setup_wait_s: float = 10.0, retry_min_s: float = 0.5, retry_max_s: float = 10.0,
                 protocol: str = "tcp", connect_timeout_s: float = 1.0, device: Any = None):
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master must be host:port, got {master!r}")
        self._address = (host, int(port))
        self._connect_timeout = connect_timeout_s
        self._cls = import_store_class()
        os.environ.setdefault(SETUP_RETRIES_ENV, "1")
        self.master = master
        self._hostname = local_hostname
        self._ranges = list(ranges)
        self._counters = counters
        self._protocol = protocol
        self._retry = (retry_min_s, retry_max_s)
        self._cond = threading.Condition()
        self._client: Any = None  # the client that set up (kept across an outage: it reconnects)
        self._on = False
        self._closed = False
        self._warned = False  # the one warning of the current outage was logged
        self.reason: str | None = None  # why the tier is off (the last failed attempt); None while on
        self._first = threading.Event()
        self._device = resolve(device)
        self._thread = threading.Thread(target=self._run, name="saria-cluster-health", daemon=True)
        self._thread.start()
        if not self._first.wait(setup_wait_s):
            self._turn_off(f"setup did not finish within {setup_wait_s:g} s")

    @property
    def on(self) -> bool:
        return self._on

    def client(self) -> Any:
        """The client when the tier is on, else ``None``."""
        return self._client if self._on else None

    def check(self, codes: Sequence[int], what: str) -> bool:
        """Whether ``codes`` (a Mooncake call's statuses) say the master is unreachable; if so the
        tier turns off (the first time with a warning naming ``what``)."""
        if any(c == RPC_FAIL for c in codes):
            self._turn_off(f"{what} failed with RPC_FAIL ({RPC_FAIL})")
            return True
        return False

    def probe(self) -> str | None:
        """One ``batch_is_exist`` of a probe key with the client that set up: ``None`` when the master
        answered, else why not (the tier's state is left as it is)."""
        client = self._client
        if client is None:
            return "no client has set up"
        try:
            codes = client.batch_is_exist([_PROBE_KEY])
        except Exception as exc:  # noqa: BLE001 - any failure of Mooncake's is "no answer"
            return str(exc) or type(exc).__name__
        return None if codes and codes[0] in (0, 1) else f"probe returned {list(codes)}"

    def close(self) -> None:
        """Stop the health thread and close the client (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._on = False
            self._cond.notify_all()
        self._thread.join(timeout=30)
        client, self._client = self._client, None
        if client is not None and not self._thread.is_alive():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a client of a dead master may fail; nothing to keep
                log.debug("closing the Mooncake client failed", exc_info=True)

    # ----------------------------------------------------------------- health thread

    def _turn_off(self, why: str) -> None:
        with self._cond:
            if self._closed:
                return
            was_on, self._on = self._on, False
            self.reason = why
            if was_on:
                self._counters.add(went_off=1)
            if not self._warned:
                self._warned = True
                log.warning("cluster tier off: master %s unreachable (%s); every call is a miss until "
                            "it is back (reconnecting in the background)", self.master, why)
            self._cond.notify_all()

    def _turn_on(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._on = True
            self.reason = None
            if self._warned:
                self._warned = False
                self._counters.add(came_back=1)
                log.warning("cluster tier back: master %s reachable again", self.master)
        self._first.set()

    def _setup(self) -> Any:
        client = self._cls()
        rc = client.setup(self._hostname, "P2PHANDSHAKE", 0, LOCAL_BUFFER_BYTES, self._protocol, "", self.master)
        if rc != 0:
            raise ConnectionError(f"Mooncake client setup returned {rc}")
        for ptr, nbytes in self._ranges:
            rc = client.register_buffer(ptr, nbytes)
            if rc != 0:
                raise ConnectionError(f"Mooncake register_buffer({nbytes} bytes) returned {rc}")
        return client

    def _attempt(self) -> str | None:
        """One try to (re)connect; ``None`` on success, else why not."""
        try:
            socket.create_connection(self._address, timeout=self._connect_timeout).close()
        except OSError as exc:
            return f"its port does not accept connections ({exc})"
        if self._client is not None:
            return self.probe()
        try:
            self._client = self._setup()
        except Exception as exc:  # noqa: BLE001 - any failure of Mooncake's is "not reachable yet"
            return str(exc) or type(exc).__name__
        return None

    def _run(self) -> None:
        bind_thread(self._device)
        delay = self._retry[0]
        while True:
            with self._cond:
                while self._on and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            why = self._attempt()
            if why is None:
                delay = self._retry[0]
                self._turn_on()
                continue
            self._turn_off(why)
            self._first.set()
            with self._cond:
                end = time.monotonic() + delay
                while not self._closed and time.monotonic() < end:
                    self._cond.wait(end - time.monotonic())
            delay = min(delay * 2, self._retry[1])

"""Whether a Mooncake master answers: the checks behind ``saria doctor --cluster``.

:func:`check_port`: does the master's RPC port accept a TCP connection (its name resolved and the
connection made within a deadline each). :func:`check_client`: can a Mooncake client (a
:class:`~saria.dataplane.cluster.connection.Connection`, no memory registered) set up against the
master and answer a ``batch_is_exist`` probe. That one runs in a child process, killed past its
deadline: Mooncake's setup holds the GIL while it tries (30 s against a port that accepts
connections but does not speak Mooncake's RPC; measured with 0.3.13.post1), so no thread of the
caller could keep time, and it writes its glog lines to the process's stderr, which the child's
stays. Run as ``python -m saria.dataplane.cluster.probe MASTER [LOCAL_HOSTNAME SETUP_WAIT_S]``, the
child prints its answer as one JSON line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from saria.dataplane.devices import bind_thread, current_device


def split_address(master: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``; ``ValueError`` when it is not one."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"the master must be host:port, got {master!r:.60}")
    return host, int(port)


def _resolve(host: str, port: int, timeout_s: float) -> list[tuple] | str:
    """``getaddrinfo``'s stream addresses, or why not; a lookup past ``timeout_s`` is given up on (it
    cannot be cancelled: it finishes on a daemon thread)."""
    result: list[Any] = []
    device = current_device()  # the caller's (the lookup does no device work)

    def lookup() -> None:
        bind_thread(device)
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=lookup, name="saria-probe-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return f"cannot resolve {host} within {timeout_s:g} s"
    if isinstance(result[0], OSError):
        return f"cannot resolve {host}: {result[0].strerror or result[0]}"
    return result[0]


def check_port(master: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """``{"ok", "reason"}``: whether ``master``'s port accepts a TCP connection."""
    host, port = split_address(master)
    addresses = _resolve(host, port, timeout_s)
    if isinstance(addresses, str):
        return {"ok": False, "reason": addresses}
    why = "no address"
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout_s)
                s.connect(address)
            return {"ok": True, "reason": "accepts TCP connections"}
        except ConnectionRefusedError:
            why = ("connection refused: nothing listens on that port (is the master running? `saria cluster "
                   "start` runs one)")
        except TimeoutError:
            why = f"no answer within {timeout_s:g} s (a host that is down, or a firewall)"
        except OSError as exc:
            why = exc.strerror or str(exc)
    return {"ok": False, "reason": why}


def check_client(master: str, local_hostname: str = "127.0.0.1", timeout_s: float = 8.0) -> dict[str, Any]:
    """``{"ok", "reason", "seconds"}``: whether a Mooncake client sets up against ``master`` and
    answers a ``batch_is_exist`` probe, tried in a child process that is killed after ``timeout_s``
    (its client waits half of that for its setup; the rest is the interpreter's start and the close)."""
    package_root = str(Path(__file__).resolve().parents[3])  # the child imports this very saria
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH")))))
    argv = [sys.executable, "-m", "saria.dataplane.cluster.probe", master, local_hostname, f"{timeout_s / 2:g}"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                              stdin=subprocess.DEVNULL)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:  # killed; what it said before is kept
        out, err, code = _text(exc.stdout), _text(exc.stderr), None
    seconds = round(time.monotonic() - t0, 3)
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return {**json.loads(line), "seconds": seconds}
    if code is None:
        why = (f"no answer within {timeout_s:g} s: the port accepts connections but no Mooncake master "
               f"answered a client's setup (is {master} the master's RPC port?)")
    else:
        last = [line for line in err.splitlines() if line.strip()][-1:] or ["nothing on stderr"]
        why = f"the probe process exited with {code}: {last[0][:300]}"
    return {"ok": False, "reason": why, "seconds": seconds}


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def _verdict(conn: Any, setup_s: float) -> dict[str, Any]:
    if not conn.on:
        return {"ok": False, "reason": f"a Mooncake client could not set up: {conn.reason}"}
    t0 = time.monotonic()
    why = conn.probe()
    if why is not None:
        return {"ok": False, "reason": f"a Mooncake client set up but its batch_is_exist probe failed: {why}"}
    return {"ok": True, "reason": f"a Mooncake client set up in {setup_s:.2f} s and answered a batch_is_exist "
                                  f"probe in {(time.monotonic() - t0) * 1e3:.1f} ms"}


def main(argv: list[str]) -> int:
    """The child: ``MASTER [LOCAL_HOSTNAME SETUP_WAIT_S]``; prints its verdict, then closes the client."""
    from saria.dataplane.cluster.connection import Connection
    from saria.dataplane.cluster.counters import ClusterCounters

    master = argv[0]
    local_hostname = argv[1] if len(argv) > 1 else "127.0.0.1"
    setup_wait_s = float(argv[2]) if len(argv) > 2 else 4.0
    t0 = time.monotonic()
    conn = Connection(master, local_hostname, [], ClusterCounters(), setup_wait_s=setup_wait_s)
    try:
        print(json.dumps(_verdict(conn, time.monotonic() - t0)), flush=True)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

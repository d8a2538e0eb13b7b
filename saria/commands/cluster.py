"""``saria cluster start``: Mooncake Store for saria's cluster tier, run on this host.

A Mooncake master (the metadata service: which object lives where) and one storage node (a
``mooncake_client`` holding --node-gb of pool memory) start on this host and run in the
foreground until Ctrl-C or SIGTERM, which stop both by process id. The command prints the master's
address, for ``saria serve --cluster`` (and ``saria doctor --cluster``), and the equivalent
``mooncake_master`` / ``mooncake_client`` command lines for a cluster over several hosts: one
master, and a storage node on every host.

  saria cluster start --node-gb 16
  saria keys new saria.key
  saria serve Qwen/Qwen3-8B --cluster 127.0.0.1:50051 --secret-file saria.key ...
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import shlex
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from saria.argtypes import float_range, host_name, int_range

CONVENTIONAL_RPC_PORT = 50051  # mooncake_master's own default
MIN_NODE_BYTES = 16 << 20  # mooncake_client 0.3.13.post1 refuses less: "Total size must be at least 16777216"
GiB = 1 << 30

EPILOG = """Ports: the master's RPC port is 50051 (Mooncake's usual one) when it is free, else a free port;
the metrics port and the node's port are free ports. Each can be given; one given that is taken
is refused before anything starts. The master's RPC server listens on every address of this host.

--host: the address other hosts and saria's clients reach this one at. The storage node advertises
it (readers fetch objects from there) and the printed master address uses it; the default,
127.0.0.1, serves this host only. For a cluster over several hosts, give this host's network
address, and start a storage node on every other host with the printed mooncake_client command.

If the master or the node exits on its own, the other is stopped too and the command exits with
status 2, naming the process, its last error line and its log. The processes run in a process
group of their own, so a Ctrl-C at the terminal reaches saria, which stops them in order. A saria
killed with SIGKILL leaves them running: their process ids are printed."""


def _node_gb(text: str) -> float:
    """--node-gb: GiB of pool memory, from Mooncake's smallest segment to this host's memory."""
    gb = float_range(0, 1 << 40)(text)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if gb * GiB < MIN_NODE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_NODE_BYTES / GiB:g} (16 MiB, the smallest pool "
                                         f"Mooncake takes), got {text}")
    if gb * GiB > memory:
        raise argparse.ArgumentTypeError(f"this host has {memory / GiB:.1f} GiB of memory, got {text}")
    return gb


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``saria cluster``'s actions; returns the parser of ``start``."""
    actions = p.add_subparsers(dest="cluster_command", title="actions", metavar="ACTION")
    actions.required = True
    start = actions.add_parser("start", help="run a Mooncake master and one storage node here, in the foreground",
                               description=__doc__, epilog=EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    start.add_argument("--node-gb", type=_node_gb, default=4.0, metavar="GB",
                       help="the storage node's pool memory in GiB: what the cluster holds (default 4; at least "
                            "16 MiB, at most this host's memory, taken as objects arrive)")
    start.add_argument("--host", type=host_name, default="127.0.0.1", metavar="ADDR",
                       help="this host's address as other hosts and saria's clients reach it (default 127.0.0.1: "
                            "this host only)")
    start.add_argument("--rpc-port", type=int_range(1, 65535), metavar="PORT",
                       help=f"the master's RPC port, the one saria serve --cluster names (default "
                            f"{CONVENTIONAL_RPC_PORT} when free, else a free port)")
    start.add_argument("--metrics-port", type=int_range(1, 65535), metavar="PORT",
                       help="the master's HTTP port for /health and /metrics (default a free port)")
    start.add_argument("--node-port", type=int_range(1, 65535), metavar="PORT",
                       help="the storage node's service port (default a free port)")
    start.add_argument("--logdir", metavar="DIR",
                       help="where the master's and the node's logs go, created if missing (default a new "
                            "temporary directory, printed)")
    start.set_defaults(command_name="cluster start")
    return start


# --- checks, before anything starts ----------------------------------------------------------------

def _local_address(host: str) -> str:
    """The IPv4 address ``host`` names, if it is one of this host's (one it can listen on)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--host {host}: cannot resolve it ({exc.strerror or exc})") from None
    address = infos[0][4][0]
    if ipaddress.ip_address(address).is_unspecified:
        raise ValueError(f"--host {host}: give the address other hosts reach this one at, not {address}")
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError as exc:
            raise ValueError(f"--host {host} is not an address of this host ({exc.strerror or exc})") from None
    return address


def _port_error(port: int) -> str | None:
    """Why nothing could listen on ``port`` here, or None when it is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            if exc.errno == errno.EACCES:
                return "not allowed (ports below 1024 need root)"
            return exc.strerror or str(exc)
    return None


def _ports(args: argparse.Namespace) -> tuple[dict[str, int | None], str]:
    """The ports asked for (None: a free one), checked; and a note when 50051 was taken."""
    asked = {"--rpc-port": args.rpc_port, "--metrics-port": args.metrics_port, "--node-port": args.node_port}
    seen: dict[int, str] = {}
    for flag, port in asked.items():
        if port is None:
            continue
        if port in seen:
            raise ValueError(f"{flag} {port} is also the {seen[port]}: give each its own port")
        seen[port] = flag
        why = _port_error(port)
        if why:
            raise ValueError(f"{flag} {port}: cannot listen on it here: {why}")
    note = ""
    rpc = args.rpc_port
    if rpc is None:
        if CONVENTIONAL_RPC_PORT not in seen and _port_error(CONVENTIONAL_RPC_PORT) is None:
            rpc = CONVENTIONAL_RPC_PORT
        else:
            note = f" ({CONVENTIONAL_RPC_PORT}, Mooncake's usual port, is taken: a free one instead)"
    return {"rpc_port": rpc, "metrics_port": args.metrics_port, "node_port": args.node_port}, note


def _logdir(text: str | None) -> Path | None:
    """--logdir, created and writable (None: LocalCluster makes a temporary one)."""
    if text is None:
        return None
    if not text.strip():
        raise ValueError("--logdir must not be empty")
    path = Path(text).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--logdir {text} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--logdir {text}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--logdir {text}: cannot write in it")
    return path


def _require_mooncake() -> None:
    """ValueError saying what is missing and the command that installs it (the package, or the OS
    library its binaries and client load) when Mooncake's client or its executables are missing."""
    from saria.dataplane.cluster.connection import INSTALL_MOONCAKE, MooncakeMissing, import_store_class
    from saria.dataplane.cluster.local import find_binary

    try:
        import_store_class()
    except MooncakeMissing as exc:
        raise ValueError(str(exc)) from None
    missing = [name for name in ("mooncake_master", "mooncake_client") if find_binary(name) is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not found in the mooncake package or on PATH ({INSTALL_MOONCAKE})")


# --- the command -----------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    node_bytes = int(args.node_gb * GiB)
    host = _local_address(args.host)
    ports, note = _ports(args)
    logdir = _logdir(args.logdir)
    _require_mooncake()
    from saria.dataplane.cluster.local import LocalCluster

    cluster = LocalCluster(logdir, node_bytes, host=host, own_process_group=True, **ports)
    return run(cluster, note)


def run(cluster: Any, note: str = "") -> int:
    """Start ``cluster`` (a :class:`~saria.dataplane.cluster.local.LocalCluster`), say how to use it,
    and keep it until SIGINT, SIGTERM or SIGHUP; then stop both processes."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            cluster.start()
        except RuntimeError as exc:  # a process that exited or never came up: its own words, its log
            raise ChildProcessError(str(exc)) from None
        pids = cluster.master_proc.pid, cluster.node_proc.pid
        _say(_started(cluster, note))
        while not stop.wait(0.5):
            down = cluster.exited()
            if down:
                raise ChildProcessError(f"{down}; the other process is stopped too")
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say(f"saria cluster: stopped the master (pid {pids[0]}) and the storage node (pid {pids[1]})")
    return 0


def _say(text: str) -> None:
    print(text, flush=True)  # a reader waiting on a pipe sees each line when it is printed


def _started(cluster: Any, note: str) -> str:
    loopback = ipaddress.ip_address(cluster.host).is_loopback
    master = f"MASTER_ADDRESS:{cluster.rpc}" if loopback else cluster.master
    node_bytes = cluster.node_bytes
    size = f"{node_bytes / GiB:g} GiB" if node_bytes >= GiB else f"{node_bytes / 2**20:g} MiB"
    lines = [
        f"saria cluster: master at {cluster.master} (pid {cluster.master_proc.pid}){note}",
        f"saria cluster: storage node with {size} of pool memory (pid {cluster.node_proc.pid}, port "
        f"{cluster.node_port})",
        f"  health:   curl -s http://{cluster.host}:{cluster.metrics}/health   (metrics at /metrics)",
        f"  logs:     {cluster.logdir}",
        f"  use it:   saria serve MODEL --cluster {cluster.master} --secret-file KEY_FILE ...",
        f"            saria doctor --cluster {cluster.master} --secret-file KEY_FILE",
        "            (KEY_FILE: one saria keys new KEY_FILE, copied to every serving host, mode 0400; it seals",
        "            every object, which this cluster's nodes then hold and serve without being able to read or",
        "            forge; --cluster-insecure instead runs the tier unsealed)",
        "",
        "The same by hand, over several hosts: the master on one host, a storage node on every host",
        "(MASTER_ADDRESS and NODE_ADDRESS: the hosts' network addresses; the node's size in bytes):",
        "  " + shlex.join(cluster.master_command("mooncake_master")),
        "  " + shlex.join(cluster.node_command("mooncake_client", master=master, host="NODE_ADDRESS")),
        f"and on every serving host: saria serve MODEL --cluster {master} --cluster-host NODE_ADDRESS "
        "--secret-file KEY_FILE ...",
    ]
    if loopback:
        lines.append(f"(this cluster serves this host only: --host {cluster.host}; give this host's network "
                     "address for others)")
    lines.append("Ctrl-C or SIGTERM stops the master and the node.")
    return "\n".join(lines)

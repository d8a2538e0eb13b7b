"""Shared set-up of the cluster store tests: a real Mooncake master and one storage node on free
ports (:class:`saria.dataplane.cluster.local.LocalCluster`: started, polled until truly up, stopped
by process id), and helpers to fill and check objects.

Mooncake is an optional extra: without it the tests skip, with one line (SKIP_REASON) saying what is
missing and the command that installs it.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from saria.dataplane.cluster.connection import MooncakeMissing, import_store_class
from saria.dataplane.cluster.local import LocalCluster, find_binary

_INSTALL_EXTRA = "pip install -e '.[cluster]'"  # in this checkout (the README's `make test` does it)


def _missing() -> str | None:
    """Why the cluster tests cannot run here, in one line with the command that fixes it; ``None``
    when Mooncake's client imports and its executables are found."""
    try:
        import_store_class()
    except MooncakeMissing as exc:
        if exc.kind == "libibverbs":
            return ("libibverbs.so.1 is missing (Mooncake Store loads it even over TCP): apt-get install -y "
                    "libibverbs1 to run the cluster tests")
        if exc.kind == "package":
            return f"the mooncake wheel is not installed: {_INSTALL_EXTRA} to run the cluster tests"
        return f"Mooncake Store cannot be imported ({exc.error}): {_INSTALL_EXTRA} to run the cluster tests"
    except Exception as exc:  # noqa: BLE001 - an import that fails otherwise: the tests cannot run either
        return (f"Mooncake Store cannot be imported ({type(exc).__name__}: {exc}): {_INSTALL_EXTRA} to run the "
                "cluster tests")
    missing = [name for name in ("mooncake_master", "mooncake_client") if find_binary(name) is None]
    if missing:
        return (f"{' and '.join(missing)} not found in the mooncake package or on PATH: {_INSTALL_EXTRA} to run "
                "the cluster tests")
    return None


MISSING = _missing()
SKIP_REASON = MISSING or "Mooncake Store is installed"  # the skip's reason (unused when nothing is missing)


def mooncake_available() -> bool:
    return MISSING is None


# What importing mooncake.store raised on a machine without libibverbs1 (Debian 12, the wheel
# mooncake-transfer-engine-non-cuda 0.3.13.post1), and without the wheel.
LIBIBVERBS_ERROR = "libibverbs.so.1: cannot open shared object file: No such file or directory"
NO_MOONCAKE_ERROR = "No module named 'mooncake'"
# What saria's commands say then (saria.dataplane.cluster.connection.mooncake_missing): reason, install.
NO_LIBIBVERBS = ("Mooncake Store is not installed completely: libibverbs.so.1 (Debian/Ubuntu package libibverbs1) "
                 "is missing", "apt-get install -y libibverbs1")
NO_MOONCAKE = ("Mooncake Store is not installed", "pip install 'saria[cluster]'")


def without_mooncake(tmp_path, which: str) -> dict[str, str]:
    """The environment of a Python that fails to import Mooncake as a machine without the wheel
    (``which`` "no-wheel") or with it and without libibverbs1 ("no-libibverbs") does, whatever this
    one has: a stand-in ``mooncake`` package first on PYTHONPATH, raising what the real import
    raised there (it reaches the child processes too)."""
    package = tmp_path / "without-mooncake" / "mooncake"
    package.mkdir(parents=True)
    if which == "no-wheel":
        (package / "__init__.py").write_text(f"raise ModuleNotFoundError({NO_MOONCAKE_ERROR!r}, name='mooncake')\n")
    else:  # the package imports; its extension module cannot load the OS library
        (package / "__init__.py").write_text("")
        (package / "store.py").write_text(f"raise ImportError({LIBIBVERBS_ERROR!r}, name='store')\n")
    path = os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def start_cluster(tmp_path_factory, node_bytes: int = 256 << 20) -> LocalCluster:
    """A started cluster (the caller stops it); skips the test when Mooncake is not installed."""
    if not mooncake_available():
        pytest.skip(SKIP_REASON)
    return LocalCluster(tmp_path_factory.mktemp("mooncake"), node_bytes).start()


def raw_client(cluster):
    """A plain Mooncake client of ``cluster`` (to tamper with values as no saria store would)."""
    from mooncake.store import MooncakeDistributedStore
    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    return c


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


def mooncake_keys(cluster) -> list[str]:
    """Every key the master of ``cluster`` holds, as anyone who reaches its HTTP port lists them
    (``/get_all_keys``: how a rogue client learns the names of live objects)."""
    import urllib.request
    with urllib.request.urlopen(f"http://{cluster.host}:{cluster.metrics}/get_all_keys", timeout=5) as r:
        return [line for line in r.read().decode().splitlines() if line]


def raw_values(raw, keys: list[str]) -> dict[str, bytes]:
    """The stored values of ``keys`` read with a plain Mooncake client (every key must be there)."""
    values = raw.get_batch(list(keys))
    assert all(len(v) for v in values), "a value to copy is missing"
    return {k: bytes(v) for k, v in zip(keys, values)}


def raw_write(raw, values: dict[str, bytes]) -> None:
    """Write ``values`` with a plain Mooncake client, replacing what is there (a rogue's writes)."""
    for key, value in values.items():
        assert raw.upsert(key, value) == 0, "Mooncake refused a rogue write"

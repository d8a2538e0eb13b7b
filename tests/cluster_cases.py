"""Shared set-up of the cluster store tests: a real Mooncake master and one storage node on free
ports (:class:`saria.dataplane.cluster.local.LocalCluster`: started, polled until truly up, stopped
by process id), and helpers to fill and check objects.

Mooncake is an optional extra: without it the tests skip, saying how to install it.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from saria.dataplane.cluster.local import LocalCluster, find_binary

SKIP_REASON = ("Mooncake Store is not installed: pip install -e '.[cluster]' "
               "(and apt-get install -y libibverbs1) to run the cluster tests")


def mooncake_available() -> bool:
    try:
        importlib.import_module("mooncake.store")
    except Exception:  # noqa: BLE001 - missing wheel or missing libibverbs: both mean "not here"
        return False
    return find_binary("mooncake_master") is not None


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

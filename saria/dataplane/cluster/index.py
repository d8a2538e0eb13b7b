"""The cluster tier seen from a scheduler: which chunks every rank's objects are complete for.

A server's objects are sharded over its worker ranks (tensor and pipeline parallelism): rank
``r`` writes its shard of every object under its own identity, so a chunk can be reloaded from the
cluster only when every rank finds its shard there. :class:`ClusterIndex` is a lookup-only Mooncake
client (it registers no memory and moves no object bytes) that answers, for a request's chunks in
order, how many leading ones are complete for every rank. The ranks tell the scheduler their
layouts (:attr:`ClusterStore.layout_identity`) with their first report; until all have, and while
the tier is off, every lookup answers 0. An answer is a hint: an object may be evicted before a
worker's get reaches it, and that get is then a miss (vLLM recomputes those tokens).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence

from saria.dataplane.cluster import queries
from saria.dataplane.cluster.connection import Connection
from saria.dataplane.cluster.counters import ClusterCounters
from saria.dataplane.cluster.errors import ClusterOff
from saria.dataplane.cluster.layout import Layout
from saria.dataplane.cluster.sealed import layout_of
from saria.dataplane.devices import pool_initializer, resolve
from saria.dataplane.ssd.keys import parse_object_key

log = logging.getLogger("saria.dataplane.cluster")


class ClusterIndex:
    """Lookups of complete objects over every rank's layout (module docstring).

    Args:
        master: the Mooncake master's RPC address, ``host:port``.
        ranks: how many layouts a lookup needs (the server's worker ranks).
        local_hostname: this host's address as the storage nodes reach it.
        timeout_s: the longest a lookup may take; past it, it answers 0 (counted).
        setup_wait_s: how long the constructor waits for the first client setup (an unreachable
            master never raises: lookups answer 0 while it reconnects in the background).
    """

    def __init__(self, master: str, ranks: int, *, local_hostname: str = "127.0.0.1", timeout_s: float = 0.5,
                 setup_wait_s: float = 2.0, retry_min_s: float = 0.5, retry_max_s: float = 10.0,
                 protocol: str = "tcp"):
        if ranks < 1 or timeout_s <= 0:
            raise ValueError(f"ranks must be >= 1 and timeout_s > 0, got {ranks} and {timeout_s}")
        self.ranks = ranks
        self._timeout = float(timeout_s)
        self._layouts: dict[str, Layout] = {}
        self._counters = ClusterCounters()
        self.lookups = self.lookup_timeouts = self.found = 0
        device = resolve(None)  # the scheduler's: never initializes CUDA where nothing did
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="saria-cluster-index",
                                        initializer=pool_initializer(device))
        self._conn = Connection(master, local_hostname, [], self._counters, setup_wait_s, retry_min_s,
                                retry_max_s, protocol, device=device)

    @property
    def on(self) -> bool:
        return self._conn.on

    @property
    def layouts(self) -> int:
        """How many ranks' layouts are known."""
        return len(self._layouts)

    @property
    def ready(self) -> bool:
        """Whether every rank's layout is known."""
        return len(self._layouts) >= self.ranks

    def add_layouts(self, identities: Sequence[str]) -> None:
        """Layouts the ranks reported (:attr:`ClusterStore.layout_identity`); more than ``ranks``
        distinct ones is a contradiction (two servers' ranks?) and raises ``ValueError``."""
        for identity in identities:
            if identity not in self._layouts:
                if len(self._layouts) >= self.ranks:
                    raise ValueError(f"more cluster layouts reported than the {self.ranks} rank(s) of this server")
                self._layouts[identity] = layout_of(identity)

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (object keys, in request order) are complete for every rank, counted
        from the first; 0 until every rank's layout is known, when the tier is off, or past the
        timeout. Never raises for Mooncake's sake."""
        for key in keys:
            parse_object_key(key)
        if not keys or not self.ready:
            return 0
        if self._conn.client() is None:
            self._counters.add(off_calls=1)
            return 0
        self.lookups += 1
        objects = [(layout, key) for key in keys for layout in self._layouts.values()]
        future = self._pool.submit(queries.exists, self._conn, objects, self._counters)
        try:
            present = future.result(timeout=self._timeout)
        except FutureTimeout:
            self.lookup_timeouts += 1
            return 0
        except ClusterOff:
            return 0
        except Exception:  # noqa: BLE001 - a lookup that failed found nothing, it never fails a request
            log.debug("cluster lookup failed", exc_info=True)
            return 0
        per = len(self._layouts)
        n = 0
        while n < len(keys) and all(present[n * per:(n + 1) * per]):
            n += 1
        self.found += n
        return n

    def counters(self) -> dict[str, Any]:
        """``junk_meta``: metadata values found junk (larger than any object's, or not parsing): misses."""
        return dict(lookups=self.lookups, lookup_timeouts=self.lookup_timeouts, found_chunks=self.found,
                    layouts=len(self._layouts), junk_meta=self._counters.junk_meta, on=self.on,
                    went_off=self._counters.went_off, came_back=self._counters.came_back)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._conn.close()

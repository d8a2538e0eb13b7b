"""The shared cluster tier of a fleet replay: a byte-bounded LRU of chunks, as a Mooncake Store pool.

One :class:`ClusterTier` is shared by every replica of :mod:`saria.replay.fleet`. It holds whole
chunks (a chunk's kv object, and for a hybrid model its GDN checkpoint where the chunk ends one),
keyed by chunk hash, with their sizes in bytes:

* :meth:`put` inserts a chunk as the most recently used; a full pool evicts the least recently used
  chunks silently until the new one fits (Mooncake's pool evicts without telling the writer). A
  chunk larger than the whole pool is refused. Putting a chunk already held refreshes its recency
  and moves no bytes (Mooncake answers an existing key without a transfer).
* :meth:`prefix` is the read side: how many leading chunks of a sequence the pool holds, each
  read refreshing its recency (``touch=True``), with the bytes a get of them moves.

Counters: ``put_chunks`` / ``put_bytes`` (inserted), ``put_duplicates`` (already held),
``put_refused`` (bigger than the pool), ``get_chunks`` / ``get_bytes`` (read by requests),
``evicted_chunks`` / ``evicted_bytes``. ``used_bytes <= capacity_bytes`` always.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

__all__ = ["ClusterTier"]


class ClusterTier:
    """A byte-bounded LRU of chunks shared by the fleet (see the module docstring)."""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"cluster capacity must be an integer number of bytes >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._chunks: OrderedDict[Hashable, int] = OrderedDict()  # oldest first
        self.put_chunks = self.put_bytes = self.put_duplicates = self.put_refused = 0
        self.get_chunks = self.get_bytes = 0
        self.evicted_chunks = self.evicted_bytes = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def keys(self) -> list[Hashable]:
        """The chunks held, least recently used first."""
        return list(self._chunks)

    def put(self, key: Hashable, nbytes: int) -> bool:
        """Insert ``key`` (``nbytes`` > 0) as the most recently used chunk, evicting the least
        recently used until it fits; whether it was inserted (False: already held, or bigger than
        the pool)."""
        chunks = self._chunks
        if key in chunks:
            chunks.move_to_end(key)
            self.put_duplicates += 1
            return False
        if nbytes > self.capacity_bytes:
            self.put_refused += 1
            return False
        while self.used_bytes + nbytes > self.capacity_bytes:
            _, size = chunks.popitem(last=False)
            self.used_bytes -= size
            self.evicted_chunks += 1
            self.evicted_bytes += size
        chunks[key] = nbytes
        self.used_bytes += nbytes
        self.put_chunks += 1
        self.put_bytes += nbytes
        return True

    def prefix(self, keys: Sequence[Hashable], start: int = 0, *, step: int = 1) -> int:
        """How many chunks of ``keys`` from ``start`` on the pool holds contiguously, cut back to a
        multiple of ``step`` (hybrid models: a run must end on a checkpoint). Does not touch."""
        chunks = self._chunks
        end = start
        while end < len(keys) and keys[end] in chunks:
            end += 1
        if step > 1:
            end -= end % step
        return max(0, end - start)

    def get(self, keys: Sequence[Hashable]) -> int:
        """Read ``keys`` (all held): refresh their recency, count them; the bytes moved."""
        chunks = self._chunks
        nbytes = 0
        for key in keys:
            chunks.move_to_end(key)
            nbytes += chunks[key]
        self.get_chunks += len(keys)
        self.get_bytes += nbytes
        return nbytes

    def counters(self) -> dict[str, int]:
        """The pool's counters and its use, as plain ints."""
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes, "chunks": len(self._chunks),
                "put_chunks": self.put_chunks, "put_bytes": self.put_bytes, "put_duplicates": self.put_duplicates,
                "put_refused": self.put_refused, "get_chunks": self.get_chunks, "get_bytes": self.get_bytes,
                "evicted_chunks": self.evicted_chunks, "evicted_bytes": self.evicted_bytes}

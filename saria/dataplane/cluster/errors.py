"""Exceptions of the cluster store: per-object misses, and refusals raised by the call itself.

Every way an object cannot be served from the cluster tier is a :class:`ClusterMiss` reaching the
caller through the object's Future, never bytes handed back as valid: the object is absent
(never written, evicted, removed, a part missing), corrupt (a metadata value that does not parse
or does not belong to its key, a value of the wrong size, a part whose checksum does not match),
unauthentic or of an unknown key epoch (a sealed store's object, docs/cluster.md "Sealed
objects"), the batch timed out, the tier is off (master unreachable), or Mooncake returned an
error code.
``cause`` names which, as counted in ``misses`` (:mod:`~saria.dataplane.cluster.counters`).

Bad arguments (``TypeError`` / ``ValueError``: a key that is not an object key, memory outside the
registered host memory, a part larger than ``max_part_bytes``) and :class:`ClusterClosed` are
raised by the call itself, before anything is sent.
"""

from __future__ import annotations

import threading


class ClusterError(Exception):
    """Base class of every error the cluster store raises on purpose."""


class ClusterClosed(ClusterError):
    """The store was closed; no new operation is accepted."""


class ClusterMiss(ClusterError):
    """The object could not be served (or stored); ``cause`` is one of :data:`MISS_CAUSES`."""

    cause = "error"

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code  # Mooncake's status code when one caused it


class ObjectAbsent(ClusterMiss):
    """No complete object under the key: never written, evicted, removed, or a part missing."""

    cause = "absent"


class ObjectCorrupt(ClusterMiss):
    """The stored values are not the object written: a metadata value that does not parse, a value
    of the wrong size, or a part whose checksum does not match. The object is dropped."""

    cause = "corrupt"


class ObjectUnauthentic(ClusterMiss):
    """A sealed store's object whose stored values do not authenticate: a metadata value or part
    that fails its tag, is of the wrong size or names another key file, metadata whose clear fields
    disagree with its sealed body, or of another layout. Planted, moved, swapped, flipped, truncated
    or extended values all end here; no byte of it is served. The object is dropped."""

    cause = "unauthentic"


class ObjectUnknownEpoch(ClusterMiss):
    """A sealed store's object sealed under a key epoch its key file lacks: a retired one (older
    than every epoch it holds: the object is dropped) or a newer one (another server rotated first:
    left in place)."""

    cause = "unknown_epoch"

    def __init__(self, message: str, code: int | None = None, retired: bool = False):
        super().__init__(message, code)
        self.retired = retired  # older than every epoch of the key file: the object is dropped


class ClusterTimeout(ClusterMiss):
    """The batch did not finish within the store's ``timeout_s``.

    Mooncake's call cannot be cancelled: it may still read the sources of a put, or write the
    destinations of a get, after this exception was delivered. ``released`` is set once that call
    has returned; a caller must not reuse a timed-out get's destination memory before it is set
    (:meth:`~saria.dataplane.cluster.store.ClusterStore.wait_released` waits for all of them).
    A timed-out put commits nothing: its object is not served.
    """

    cause = "timeout"

    def __init__(self, message: str, released: threading.Event):
        super().__init__(message)
        self.released = released


class ClusterOff(ClusterMiss):
    """The tier is off: the master was unreachable; a background thread is reconnecting."""

    cause = "off"


class ClusterWriteError(ClusterMiss):
    """Mooncake refused or failed a put (pool full with nothing evictable, transfer error); nothing
    of the object is served."""

    cause = "write_failed"


MISS_CAUSES = ("absent", "corrupt", "unauthentic", "unknown_epoch", "timeout", "off", "write_failed", "error")

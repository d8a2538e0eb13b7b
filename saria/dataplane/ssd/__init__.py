"""The SSD store: opaque objects striped over one preallocated file per NVMe drive, verified on every
read and found again after a restart (design, format and guarantees: docs/ssd.md).

One job per module:

* ``store``: :class:`SSDStore`, the object I/O API (write, read, read_many, delete, info, ...).
* ``jobs``: one object's write or read in flight on the store's worker pools; ``reads``: the read
  path's store side (a read checked and its object pinned, its parts queued; ``read_many``).
* ``startup``: opening the drives (locks, files, sizing) and recovering the index from the headers,
  wiping files that are not the store's to serve.
* ``lost``: taking a drive whose file was deleted or replaced out of service.
* ``checks``: the store's arguments (options, keys, tensors, checksums, parts);
  ``memory``: caller memory shared with operations in flight, or read-only.
* ``files``: the syscall layer (:class:`IoOps`), drive files, directory locks, aligned buffers,
  :func:`probe_direct_io`; ``backends``: the payload backends (POSIX, kvikio) over them;
  ``kvikio_status``: what kvikio would do here (shared with ``saria doctor``).
* ``sealing``: sealed parts (AES-256-GCM through :class:`saria.seal.Sealer`, private bounce buffers);
  ``format``: the on-disk format; ``index``: the index and how headers rebuild it; ``alloc``: slot
  allocation; ``counters``, ``errors``; ``keys``: stable object keys (:func:`object_key`).
"""

from saria.dataplane.ssd.counters import PathCounters, SSDCounters
from saria.dataplane.ssd.errors import (DriveLost, ObjectCorrupt, ObjectEpochUnknown, ObjectNotFound, ObjectReadError,
                                        ObjectUnauthentic, ObjectUnreadable, ObjectWriteError, SSDStoreError,
                                        StoreClosed, StoreConfigError, StoreFull)
from saria.dataplane.ssd.files import IoOps, probe_direct_io
from saria.dataplane.ssd.index import ObjectInfo, PartLocation
from saria.dataplane.ssd.keys import object_key, parse_object_key
from saria.dataplane.ssd.kvikio_status import KvikioStatus, kvikio_status
from saria.dataplane.ssd.store import SSDStore

__all__ = [
    "DriveLost", "IoOps", "KvikioStatus", "ObjectCorrupt", "ObjectEpochUnknown", "ObjectInfo", "ObjectNotFound",
    "ObjectReadError", "ObjectUnauthentic", "ObjectUnreadable", "ObjectWriteError", "PartLocation", "PathCounters",
    "SSDCounters", "SSDStore", "SSDStoreError", "StoreClosed", "StoreConfigError", "StoreFull", "kvikio_status",
    "object_key", "parse_object_key", "probe_direct_io",
]

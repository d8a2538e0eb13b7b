"""The data plane: moves bytes between GPU, pinned DRAM and NVMe SSD (DESIGN.md, "Data plane").

SSD store: :class:`SSDStore` keeps opaque objects striped over one preallocated file per drive,
verified on every read and found again after a restart (``ssd_store``; on-disk format in
``ssd_format``; POSIX / kvikio backends and the ``IoOps`` syscall layer in ``ssd_backends``).
"""

from .ssd_backends import IoOps, probe_direct_io
from .ssd_counters import PathCounters, SSDCounters
from .ssd_errors import (ObjectCorrupt, ObjectNotFound, ObjectReadError, ObjectUnreadable, ObjectWriteError,
                         SSDStoreError, StoreClosed, StoreConfigError, StoreFull)
from .ssd_index import ObjectInfo, PartLocation
from .ssd_store import SSDStore

__all__ = [
    "IoOps", "ObjectCorrupt", "ObjectInfo", "ObjectNotFound", "ObjectReadError", "ObjectUnreadable",
    "ObjectWriteError", "PartLocation", "PathCounters", "SSDCounters", "SSDStore", "SSDStoreError",
    "StoreClosed", "StoreConfigError", "StoreFull", "probe_direct_io",
]

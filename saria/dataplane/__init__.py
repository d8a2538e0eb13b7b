"""The data plane: moves bytes between GPU, pinned DRAM and NVMe SSD (docs/architecture.md,
"Data plane"), in three folders by medium and job:

* ``dram/``: the DRAM tier: :class:`HostPool` (pinned host memory in fixed-size slots),
  :class:`DramStore` (which objects live in which slots) and the reloads' staging buffers.
* ``ssd/``: the SSD tier: :class:`SSDStore` (opaque objects striped over one preallocated file per
  drive, verified on every read, found again after a restart), its on-disk format, index, jobs,
  backends (POSIX, kvikio GDS) and errors.
* ``transfer/``: :class:`TransferEngine`, which executes the control plane's reload plans and
  orders on separate paths (DRAM->GPU paced by the :class:`Coordinator`, SSD->GPU, GPU->DRAM,
  SSD writes, SSD->DRAM prewarms), one module each; a reload in flight is a :class:`LoadJob`;
  :class:`PCIeMonitor` samples NVML's PCIe counters and :func:`calibrate` refines the
  coordinator's bandwidth estimates from them.

``build`` sizes and opens all of it for a configuration; ``nvtx`` names the profiler ranges.
docs/ssd.md has the SSD store's design, docs/dataplane.md the rest.
"""

from saria.dataplane.dram.host_pool import HostPool, HostPoolFull
from saria.dataplane.dram.store import DramObject, DramStore
from saria.dataplane.ssd.files import IoOps, probe_direct_io
from saria.dataplane.ssd.counters import PathCounters, SSDCounters
from saria.dataplane.ssd.errors import (DriveLost, ObjectCorrupt, ObjectNotFound, ObjectReadError, ObjectUnreadable,
                                        ObjectWriteError, SSDStoreError, StoreClosed, StoreConfigError, StoreFull)
from saria.dataplane.ssd.index import ObjectInfo, PartLocation
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.ssd.store import SSDStore
from saria.dataplane.transfer.coordinator import Coordinator, pace_bytes_per_s
from saria.dataplane.transfer.engine import Completion, OrderRun, TransferEngine
from saria.dataplane.transfer.load_job import LoadItem, LoadJob, LoadResult
from saria.dataplane.transfer.pcie import PCIeMonitor, calibrate

__all__ = [
    "Completion", "Coordinator", "DramObject", "DramStore", "HostPool", "HostPoolFull", "LoadItem", "LoadJob",
    "LoadResult", "OrderRun", "PCIeMonitor",
    "TransferEngine", "calibrate", "object_key", "pace_bytes_per_s",
    "DriveLost", "IoOps", "ObjectCorrupt", "ObjectInfo", "ObjectNotFound", "ObjectReadError", "ObjectUnreadable",
    "ObjectWriteError", "PartLocation", "PathCounters", "SSDCounters", "SSDStore", "SSDStoreError",
    "StoreClosed", "StoreConfigError", "StoreFull", "probe_direct_io",
]

"""The data plane: moves bytes between GPU, pinned DRAM and NVMe SSD (DESIGN.md, "Data plane").

Transfer engine: :class:`TransferEngine` executes the control plane's reload plans and orders on
separate paths (DRAM->GPU paced by the :class:`Coordinator`, SSD->GPU, GPU->DRAM, SSD writes),
one module each (``dram_loads``, ``ssd_loads``, ``offload``; what they share in ``paths``).
Host pool: :class:`HostPool`, pinned host memory in fixed-size slots (the DRAM tier), indexed by
:class:`DramStore`. A reload in flight is a :class:`LoadJob` (``load_job``).
PCIe monitor: :class:`PCIeMonitor` samples NVML's PCIe counters; :func:`calibrate` refines the
coordinator's bandwidth estimates from them.

SSD store: :class:`SSDStore` keeps opaque objects striped over one preallocated file per drive,
verified on every read and found again after a restart (``ssd/``: the store in ``ssd.store``,
on-disk format in ``ssd.format``, start-up and recovery in ``ssd.startup``, lost drives in
``ssd.lost``, POSIX / kvikio backends in ``ssd.backends``, drive files, locks and the ``IoOps``
syscall layer in ``ssd.files``, checks on arguments and caller memory in ``ssd.checks`` and
``ssd.memory``; docs/ssd.md).
"""

from saria.dataplane.transfer.coordinator import Coordinator, pace_bytes_per_s
from saria.dataplane.dram.store import DramObject, DramStore
from saria.dataplane.transfer.engine import Completion, OrderRun, TransferEngine
from saria.dataplane.dram.host_pool import HostPool, HostPoolFull
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.transfer.load_job import LoadItem, LoadJob, LoadResult
from saria.dataplane.transfer.pcie import PCIeMonitor, calibrate
from saria.dataplane.ssd.files import IoOps, probe_direct_io
from saria.dataplane.ssd.counters import PathCounters, SSDCounters
from saria.dataplane.ssd.errors import (DriveLost, ObjectCorrupt, ObjectNotFound, ObjectReadError, ObjectUnreadable,
                         ObjectWriteError, SSDStoreError, StoreClosed, StoreConfigError, StoreFull)
from saria.dataplane.ssd.index import ObjectInfo, PartLocation
from saria.dataplane.ssd.store import SSDStore

__all__ = [
    "Completion", "Coordinator", "DramObject", "DramStore", "HostPool", "HostPoolFull", "LoadItem", "LoadJob",
    "LoadResult", "OrderRun", "PCIeMonitor",
    "TransferEngine", "calibrate", "object_key", "pace_bytes_per_s",
    "DriveLost", "IoOps", "ObjectCorrupt", "ObjectInfo", "ObjectNotFound", "ObjectReadError", "ObjectUnreadable",
    "ObjectWriteError", "PartLocation", "PathCounters", "SSDCounters", "SSDStore", "SSDStoreError",
    "StoreClosed", "StoreConfigError", "StoreFull", "probe_direct_io",
]

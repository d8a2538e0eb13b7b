"""Building a data plane sized for a configuration: the host pool, the SSD store, the coordinator
and the transfer engine, as ``TieredCache`` and the vLLM connector's worker both need them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from saria.config import SariaConfig
from saria.kernels import PageTable
from saria.seal import Sealer
from saria.sizing import TierSizing, size_tiers

from saria.dataplane.transfer.coordinator import Coordinator
from saria.dataplane.transfer.engine import TransferEngine
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.dram.numa import pool_numa_node
from saria.dataplane.ssd.store import SSDStore


def sized_config(config: SariaConfig, kv_table: PageTable, block_tokens: int,
                 state_table: PageTable | None = None, state_pages: int = 1) -> SariaConfig:
    """``config`` with its object sizes taken from the page tables (what the bytes really weigh):
    ``chunk.kv_bytes_per_token`` and ``chunk.kv_element_bytes`` from the KV pages,
    ``chunk.state_bytes`` from the state pages."""
    chunk_tokens = config.chunk.chunk_tokens
    if block_tokens < 1 or chunk_tokens % block_tokens:
        raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a whole number of {block_tokens}-token pages")
    if kv_table.bytes_per_page % block_tokens:
        raise ValueError(f"a page of {kv_table.bytes_per_page} bytes is not {block_tokens} equal tokens")
    state_bytes = state_table.staging_bytes(state_pages) if state_table is not None else 0
    chunk = dataclasses.replace(config.chunk, kv_bytes_per_token=kv_table.bytes_per_page // block_tokens,
                                state_bytes=state_bytes, kv_element_bytes=kv_table.tensors[0].element_size())
    return dataclasses.replace(config, chunk=chunk)


@dataclass
class DataPlaneParts:
    """The data plane's parts for one engine; ``close()`` closes them all. ``sizing``: the
    layout the host pool and the SSD store were built to (give it to the control plane)."""

    engine: TransferEngine
    host_pool: HostPool
    ssd: SSDStore | None
    coordinator: Coordinator
    sizing: TierSizing | None = None

    def close(self) -> None:
        self.engine.close()
        if self.ssd is not None:
            self.ssd.close()
        self.host_pool.close()


def open_data_plane(config: SariaConfig, kv_table: PageTable, *, block_tokens: int,
                    state_table: PageTable | None = None, state_pages: int = 1,
                    ssd_paths: Sequence[str] | None = None, coordinator_mode: str = "coordinated",
                    durable: bool = True, direct: bool | str = "auto", ssd_identity: str = "",
                    staging_bytes: int = 0, ssd_sealer: Sealer | None = None) -> DataPlaneParts:
    """A data plane whose host pool and SSD store are laid out by :func:`saria.sizing.size_tiers`:
    never more pinned memory than ``config.dram_bytes`` (+ ``staging_bytes``) and never more bytes
    preallocated per drive than ``config.ssd_bytes / drives``; a tier that holds no object of some
    kind is refused (``ValueError``). The control plane driving it must be built with the same
    layout (``ControlPlane(config, sizing=parts.sizing)``): it charges each object its whole slots
    and parts against what they hold, so whatever it admits fits. ``config`` must already carry the
    tables' object sizes (:func:`sized_config`).

    ``ssd_paths`` defaults to ``config.ssd_paths``; a policy that uses SSD needs at least one.
    ``ssd_identity`` is what the SSD store's objects are written for (see :class:`SSDStore`): drive
    files written for another identity are wiped at open. ``ssd_sealer``: a
    :class:`saria.seal.Sealer` of kind ``"ssd"`` made for ``ssd_identity``, to seal every SSD part
    (docs/ssd.md, "Sealed objects"); ``None``: unsealed. ``staging_bytes``: host memory beyond
    the DRAM tier's, in whole slots (rounded down), which the control plane never places objects in
    (the cluster tier's reloads land there before they go to the GPU).
    """
    chunk = config.chunk
    expected = sized_config(config, kv_table, block_tokens, state_table, state_pages).chunk
    if (chunk.kv_bytes_per_token, chunk.state_bytes, chunk.kv_element_bytes) != \
            (expected.kv_bytes_per_token, expected.state_bytes, expected.kv_element_bytes):
        raise ValueError(f"config sizes objects at {chunk.kv_bytes_per_token} B/token of {chunk.kv_element_bytes}-byte "
                         f"elements and {chunk.state_bytes} B/state but the pages hold {expected.kv_bytes_per_token}, "
                         f"{expected.kv_element_bytes} and {expected.state_bytes}: build the config with sized_config()")
    paths = list(config.ssd_paths if ssd_paths is None else ssd_paths)
    sizing = size_tiers(config, drives=len(paths), staging_bytes=staging_bytes)
    host_pool = HostPool(sizing.pinned_bytes, sizing.dram.unit_bytes, numa_node=pool_numa_node(kv_table.device))
    ssd = None
    try:
        if sizing.ssd.units:
            ssd = SSDStore(paths, sizing.ssd.file_bytes, sizing.ssd.unit_bytes, durable=durable, direct=direct,
                           identity=ssd_identity, sealer=ssd_sealer, device=kv_table.device)
            if ssd.total_parts != sizing.ssd.units:  # the store's own rule for its files' slots
                raise RuntimeError(f"the SSD store holds {ssd.total_parts} parts, its layout says {sizing.ssd.units}")
        coordinator = Coordinator(config.bandwidth, mode=coordinator_mode)
        engine = TransferEngine(kv_table, host_pool=host_pool, coordinator=coordinator,
                                pages_per_chunk=config.chunk.chunk_tokens // block_tokens, ssd=ssd,
                                state_table=state_table, state_pages=state_pages, ssd_dtype=config.ssd_dtype)
    except BaseException:
        host_pool.close()
        if ssd is not None:
            ssd.close()
        raise
    return DataPlaneParts(engine, host_pool, ssd, coordinator, sizing)

"""Building a data plane sized for a configuration: the host pool, the SSD store, the coordinator
and the transfer engine, as ``TieredCache`` and the vLLM connector's worker both need them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from saria.config import SariaConfig
from saria.kernels import PageTable

from saria.dataplane.transfer.coordinator import Coordinator
from saria.dataplane.transfer.engine import TransferEngine
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.ssd.store import SSDStore

MAX_SLOT_BYTES = 4 << 20  # host slot = SSD part: 4 MiB moves at full PCIe / NVMe speed
PAGE = 4096


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def slot_bytes_for(object_sizes: Sequence[int]) -> int:
    """One slot per object for objects up to 4 MiB (no waste), else 4 MiB slots."""
    return min(MAX_SLOT_BYTES, _round_up(min(object_sizes), PAGE))


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
    """The data plane's parts for one engine; ``close()`` closes them all."""

    engine: TransferEngine
    host_pool: HostPool
    ssd: SSDStore | None
    coordinator: Coordinator

    def close(self) -> None:
        self.engine.close()
        if self.ssd is not None:
            self.ssd.close()
        self.host_pool.close()


def open_data_plane(config: SariaConfig, kv_table: PageTable, *, block_tokens: int,
                    state_table: PageTable | None = None, state_pages: int = 1,
                    ssd_paths: Sequence[str] | None = None, coordinator_mode: str = "coordinated",
                    durable: bool = True, direct: bool | str = "auto", ssd_identity: str = "",
                    staging_bytes: int = 0) -> DataPlaneParts:
    """A data plane whose host pool and SSD store hold what ``config``'s control plane may place
    there. ``config`` must already carry the tables' object sizes (:func:`sized_config`).

    Objects round up to whole slots, so both tiers get room for as many objects as the control
    plane's byte capacity admits. ``ssd_paths`` defaults to ``config.ssd_paths``; a policy that
    uses SSD needs at least one. ``ssd_identity`` is what the SSD store's objects are written for
    (see :class:`SSDStore`): drive files written for another identity are wiped at open.
    ``staging_bytes``: host slots beyond the DRAM tier's, which the control plane never places
    objects in (the cluster tier's reloads land there before they go to the GPU).
    """
    chunk = config.chunk
    expected = sized_config(config, kv_table, block_tokens, state_table, state_pages).chunk
    if (chunk.kv_bytes_per_token, chunk.state_bytes, chunk.kv_element_bytes) != \
            (expected.kv_bytes_per_token, expected.state_bytes, expected.kv_element_bytes):
        raise ValueError(f"config sizes objects at {chunk.kv_bytes_per_token} B/token of {chunk.kv_element_bytes}-byte "
                         f"elements and {chunk.state_bytes} B/state but the pages hold {expected.kv_bytes_per_token}, "
                         f"{expected.kv_element_bytes} and {expected.state_bytes}: build the config with sized_config()")
    sizes = [chunk.kv_bytes] + ([chunk.state_bytes] if chunk.state_bytes else [])
    slot = slot_bytes_for(sizes)
    slots_per = [-(-s // slot) for s in sizes]
    dram_slots = max(max(slots_per), -(-config.dram_bytes // slot) + config.dram_bytes // min(sizes) + 1)
    # What the SSD holds: kv objects in their FP8 form under ssd_dtype="fp8", in parts sized for them
    # (a part is then not a host slot: writes from DRAM quantize first anyway)
    ssd_sizes = [config.ssd_kv_bytes] + sizes[1:]
    part = slot if config.ssd_dtype == "auto" else slot_bytes_for(ssd_sizes)
    parts_per = [-(-s // part) for s in ssd_sizes]
    if staging_bytes < 0:
        raise ValueError(f"staging_bytes must be >= 0, got {staging_bytes}")
    host_pool = HostPool((dram_slots + -(-staging_bytes // slot)) * slot, slot)
    paths = list(config.ssd_paths if ssd_paths is None else ssd_paths)
    ssd = None
    try:
        if config.ssd_bytes:
            if not paths:
                raise ValueError("the policy uses SSD but no ssd_paths were given (one directory per drive)")
            parts = -(-config.ssd_bytes // part) + config.ssd_bytes // min(ssd_sizes) + 1
            per_drive = -(-parts // len(paths)) + max(parts_per)
            ssd = SSDStore(paths, PAGE + per_drive * (PAGE + part), part, durable=durable, direct=direct,
                           identity=ssd_identity)
        coordinator = Coordinator(config.bandwidth, mode=coordinator_mode)
        engine = TransferEngine(kv_table, host_pool=host_pool, coordinator=coordinator,
                                pages_per_chunk=config.chunk.chunk_tokens // block_tokens, ssd=ssd,
                                state_table=state_table, state_pages=state_pages, ssd_dtype=config.ssd_dtype)
    except BaseException:
        host_pool.close()
        if ssd is not None:
            ssd.close()
        raise
    return DataPlaneParts(engine, host_pool, ssd, coordinator)

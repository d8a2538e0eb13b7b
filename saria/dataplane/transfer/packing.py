"""Packing for the offload paths: the one ``offload`` thread and stream that stores and GPU-source
writes share, in submission order (:class:`Packer`).

An order's objects are resolved to block ids or prepacked staging (:meth:`Packer.resolve`) on the
caller's thread, then packed on the offload thread with one :func:`~saria.kernels.pack_pages`
launch per object kind (:meth:`Packer.pack`), after the caller's queued work (CUDA); for the SSD
under ``ssd_dtype="fp8"``, kv objects are packed straight into their FP8 form by the quantizing
kernel. The packs look :func:`pack_pages` up in this module at run time: tests and the harness
replace ``saria.dataplane.transfer.packing.pack_pages`` to slow or gate them.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, Mapping

import torch

from saria.orders import KV, STATE, ObjectKey, Order
from saria.kernels import BlockIds, checksum, pack_pages, pack_pages_fp8, quantize_staging

from saria.dataplane import nvtx
from saria.dataplane.devices import pool_initializer
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.transfer.streams import Streams
from saria.dataplane.transfer.tables import Blocks, Tables, log

# (key, block ids, prepacked staging) per object of an order: see Packer.resolve
Objects = list[tuple[ObjectKey, "BlockIds | None", "torch.Tensor | None"]]


class Packer:
    """The offload thread (``pool``) and what runs on it: resolving, packing and checksumming an
    order's objects on the ``offload`` stream."""

    def __init__(self, tables: Tables, host_pool: HostPool, streams: Streams):
        self.tables = tables
        self.host_pool = host_pool
        self.streams = streams
        self.device = tables.device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="saria-offload",
                                       initializer=pool_initializer(tables.device))

    def close(self) -> None:
        """Finish the queued orders and stop the offload thread."""
        self.pool.shutdown(wait=True)

    def submit(self, run: Callable[..., object], order: Order, objects: Objects, released: threading.Event,
               *args) -> Future:
        """Queue ``run(order, objects, ready, released, *args)`` on the offload thread, where
        ``ready`` is an event on the caller's stream that the packs must follow (CUDA). If the
        thread is gone (the engine is closing) ``released`` is set and ``RuntimeError`` raised."""
        ready = self.streams.caller_event()
        try:
            return self.pool.submit(run, order, objects, ready, released, *args)
        except RuntimeError:
            released.set()
            raise

    def capture(self, ids: BlockIds) -> torch.Tensor:
        """Pack one state object's pages now, on the caller's thread and current stream."""
        with nvtx.nvtx_range(nvtx.PACK):
            return pack_pages(self.tables.state_table, ids)

    def resolve(self, order: Order, kv_blocks: Mapping[Hashable, Blocks], state_blocks: Mapping[Hashable, Blocks],
                prepacked: Mapping[ObjectKey, torch.Tensor]) -> Objects:
        """(key, block ids, prepacked staging) per object of ``order``: exactly one of the two is
        set, or neither when the caller has no copy of a prepacked-only object (it then fails)."""
        out = []
        for kind, chunks, blocks in ((KV, order.kv, kv_blocks), (STATE, order.state, state_blocks)):
            for n, chunk in enumerate(chunks):
                key = ObjectKey(chunk, kind)
                staging = prepacked.get(key)
                if staging is not None:
                    _, _, nbytes = self.tables.table(kind)
                    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8 or \
                            staging.numel() != nbytes or staging.device != self.device:
                        raise ValueError(f"prepacked {key} must be {nbytes} uint8 bytes on {self.device}")
                    out.append((key, None, staging.reshape(-1)))
                elif chunk in blocks or not prepacked:
                    what = f"{kind} object {n} of order {order.order_id}"  # by place: never its chunk hash
                    out.append((key, self.tables.ids(kind, what, blocks.get(chunk)), None))
                else:
                    out.append((key, None, None))
        return out

    def pack(self, objects: Objects, *, for_ssd: bool = False
             ) -> list[tuple[ObjectKey, torch.Tensor | None, BaseException | None]]:
        """Pack the objects of one order into GPU staging, on the current stream: one pack launch
        per object kind over the block ids of all its objects (the staging of a batch is the
        concatenation of the objects' packed bytes, one row each). Prepacked objects are used as
        is. ``for_ssd``: in the form the SSD stores (kv objects in their FP8 form under
        ``ssd_dtype="fp8"``, quantized inside the pack). Returns ``(key, staging, error)`` per
        object, in order; an object whose pages cannot be packed (or with neither pages nor a
        packed copy) has an error instead of a staging."""
        out: list = [None] * len(objects)
        for kind in (KV, STATE):
            batch = [(n, ids) for n, (key, ids, packed) in enumerate(objects) if key.kind == kind and ids is not None]
            if not batch:
                continue
            table, _, _ = self.tables.table(kind)
            pack = pack_pages_fp8 if for_ssd and self.tables.quantized(kind) else pack_pages
            try:
                with nvtx.nvtx_range(nvtx.PACK):
                    rows = pack(table, BlockIds.stack([ids for _, ids in batch]))
                for (n, _), row in zip(batch, rows):
                    out[n] = (objects[n][0], row, None)
            except Exception:  # one bad object: pack them one by one to name it
                for n, ids in batch:
                    try:
                        with nvtx.nvtx_range(nvtx.PACK):
                            out[n] = (objects[n][0], pack(table, ids), None)
                    except Exception as exc:
                        out[n] = (objects[n][0], None, exc)
        for n, (key, ids, packed) in enumerate(objects):
            if ids is None:
                error = None if packed is not None else LookupError(
                    f"{key}: neither its pages nor a packed copy were given")
                if packed is not None and for_ssd and self.tables.quantized(key.kind):
                    packed = quantize_staging(packed, self.tables.kv_dtype)
                out[n] = (key, packed, error)
        return out

    def part_checksums(self, staging: torch.Tensor, part: int | None = None) -> tuple[int, ...]:
        """Checksums of an object's parts of ``part`` bytes (default one host slot, which is one
        SSD part unless the SSD stores FP8)."""
        part = part or self.host_pool.slot_bytes
        with nvtx.nvtx_range(nvtx.VERIFY):
            return tuple(checksum(staging[o:o + part]) for o in range(0, staging.numel(), part))

    def packed_on_device(self, stream_name: str) -> None:
        """Block until the packs queued on ``stream_name`` have run (CUDA): the pages are free."""
        self.streams.record(stream_name).synchronize()

    def settle(self, stream_name: str) -> None:
        """Wait for what is queued on a stream before its memory is given back (failure paths:
        never raises; a device that cannot even synchronize has bigger problems to report)."""
        try:
            self.streams.synchronize(stream_name)
        except Exception as exc:
            log.warning("synchronizing the %s stream failed: %s", stream_name, exc)

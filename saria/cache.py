"""``TieredCache``: saria in one process, a control plane and a transfer engine wired together.

The vLLM connector splits the two across processes (the control plane in the scheduler, the
engine in the worker, orders and completions carried by connector metadata). Everything else that
runs saria in-process (the demo, the ingress benchmark, tests, a custom engine) uses this class:

    cache = TieredCache(SariaConfig(...), kv_caches, block_tokens=16, ssd_paths=["/mnt/nvme0/saria"])
    plan = cache.lookup(chunk_hashes)                       # reusable prefix and its sources
    job = cache.load(plan, kv_blocks=[blocks of chunk 0, blocks of chunk 1, ...])
    result = job.wait()                                     # pages filled; result.failed, valid_chunks
    ... prefill the rest ...
    cache.commit(chunk_hashes, plan=plan, kv_blocks={chunk: blocks, ...}, failed=result.failed)
    cache.drain()                                           # before the pages are reused

Completions flow back to the control plane on a thread of their own; the drops they cause run
there too. Object sizes come from the page tables, not from the config: the config's
``chunk.kv_bytes_per_token`` and ``chunk.state_bytes`` are replaced by what the tables hold.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Hashable, Mapping, Sequence

import torch

from saria.config import SariaConfig
from saria.control import ControlPlane, ObjectKey, Order, ReloadPlan
from saria.dataplane.coordinator import Coordinator
from saria.dataplane.engine import Blocks, Completion, LoadJob, TransferEngine
from saria.dataplane.host_pool import HostPool
from saria.dataplane.ssd_store import SSDStore
from saria.kernels import PageTable

MAX_SLOT_BYTES = 4 << 20  # host slot = SSD part: 4 MiB moves at full PCIe / NVMe speed
PAGE = 4096


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def slot_bytes_for(object_sizes: Sequence[int]) -> int:
    """One slot per object for objects up to 4 MiB (no waste), else 4 MiB slots."""
    return min(MAX_SLOT_BYTES, _round_up(min(object_sizes), PAGE))


class TieredCache:
    """A :class:`~saria.control.ControlPlane` and a :class:`~saria.dataplane.engine.TransferEngine`
    over one engine's paged KV cache (module docstring).

    ``kv_caches``: the engine's full-attention paged tensors (or a :class:`PageTable`);
    ``block_tokens``: tokens per page; ``state_caches`` / ``state_pages``: a hybrid model's GDN
    state pages and how many make one checkpoint. ``ssd_paths`` (one directory per drive; default
    ``config.ssd_paths``) may be empty only when the policy uses no SSD. ``clock`` gives the
    control plane's ``now``.
    """

    def __init__(self, config: SariaConfig, kv_caches: PageTable | Sequence[torch.Tensor], *, block_tokens: int,
                 state_caches: PageTable | Sequence[torch.Tensor] | None = None, state_pages: int = 1,
                 ssd_paths: Sequence[str] | None = None, coordinator_mode: str = "coordinated",
                 durable: bool = True, direct: bool | str = "auto", clock: Callable[[], float] = time.monotonic):
        kv_table = PageTable.of(kv_caches)
        state_table = PageTable.of(state_caches) if state_caches is not None else None
        chunk_tokens = config.chunk.chunk_tokens
        if block_tokens < 1 or chunk_tokens % block_tokens:
            raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a whole number of {block_tokens}-token pages")
        if kv_table.bytes_per_page % block_tokens:
            raise ValueError(f"a page of {kv_table.bytes_per_page} bytes is not {block_tokens} equal tokens")
        pages_per_chunk = chunk_tokens // block_tokens
        state_bytes = state_table.staging_bytes(state_pages) if state_table is not None else 0
        chunk = dataclasses.replace(config.chunk, kv_bytes_per_token=kv_table.bytes_per_page // block_tokens,
                                    state_bytes=state_bytes)
        self.config = config = dataclasses.replace(config, chunk=chunk)
        self.block_tokens = block_tokens
        self.clock = clock
        self.control = ControlPlane(config)

        sizes = [chunk.kv_bytes] + ([state_bytes] if state_bytes else [])
        slot = slot_bytes_for(sizes)
        slots_per = [-(-s // slot) for s in sizes]
        # Objects round up to whole slots: room for as many objects as the control plane can fit.
        most_objects = config.dram_bytes // min(sizes) + 1
        dram_slots = max(max(slots_per), -(-config.dram_bytes // slot) + most_objects)
        self.host_pool = HostPool(dram_slots * slot, slot)
        paths = list(config.ssd_paths if ssd_paths is None else ssd_paths)
        self.ssd = None
        try:
            if config.ssd_bytes:
                if not paths:
                    raise ValueError("the policy uses SSD but no ssd_paths were given (one directory per drive)")
                parts = -(-config.ssd_bytes // slot) + config.ssd_bytes // min(sizes) + 1
                per_drive = -(-parts // len(paths)) + max(slots_per)
                self.ssd = SSDStore(paths, PAGE + per_drive * (PAGE + slot), slot, durable=durable, direct=direct)
            self.coordinator = Coordinator(config.bandwidth, mode=coordinator_mode)
            self.engine = TransferEngine(kv_table, host_pool=self.host_pool, coordinator=self.coordinator,
                                         pages_per_chunk=pages_per_chunk, ssd=self.ssd, state_table=state_table,
                                         state_pages=state_pages)
        except BaseException:
            self.host_pool.close()
            if self.ssd is not None:
                self.ssd.close()
            raise
        self._completions = ThreadPoolExecutor(1, thread_name_prefix="saria-complete")
        self._outstanding: set[Future] = set()
        self._lock = threading.Lock()
        self.completion_errors: list[BaseException] = []

    # --- the request path ------------------------------------------------------------------------

    def lookup(self, chunk_hashes: Sequence[Hashable]) -> ReloadPlan:
        return self.control.plan(chunk_hashes, self.clock())

    def load(self, plan: ReloadPlan, kv_blocks: Sequence[Blocks], state_blocks: Blocks | None = None, *,
             timeline: list | None = None) -> LoadJob:
        return self.engine.load(plan, kv_blocks, state_blocks, timeline=timeline)

    def commit(self, chunk_hashes: Sequence[Hashable], kv_blocks: Mapping[Hashable, Blocks], *,
               plan: ReloadPlan | None = None, state_blocks: Mapping[Hashable, Blocks] | None = None,
               failed: Sequence[Hashable | ObjectKey] = ()) -> list[Order]:
        """The request's prefill is done: let the control plane account it and run what it orders
        (stores of new KV, writes, promotions, drops). ``kv_blocks`` maps every chunk hash of the
        request to its pages. Returns the orders; :meth:`drain` waits for them."""
        orders = self.control.commit_prefill(chunk_hashes, self.clock(), plan=plan, failed=failed)
        self._execute(orders, kv_blocks, state_blocks)
        return orders

    def release(self, plan: ReloadPlan, failed: Sequence[Hashable | ObjectKey] = ()) -> None:
        """Unpin a plan that will not be committed (request aborted)."""
        self._execute(self.control.release(plan, self.clock(), failed=failed), {}, None)

    def _execute(self, orders: Sequence[Order], kv_blocks, state_blocks) -> None:
        for future in self.engine.execute(orders, kv_blocks, state_blocks):
            with self._lock:
                self._outstanding.add(future)
            future.add_done_callback(lambda f: self._completions.submit(self._report, f))

    def _report(self, future: Future) -> None:
        """Hand a completion to the control plane; run the drops it causes."""
        try:
            completion: Completion = future.result()
            follow_up = self.control.complete(completion.order_id, completion.ok, self.clock(),
                                              failed=completion.failed)
            self._execute(follow_up, {}, None)
        except BaseException as exc:  # surfaced by drain(): a bug, not a data error
            self.completion_errors.append(exc)
        finally:
            with self._lock:
                self._outstanding.discard(future)

    def drain(self, timeout: float | None = 60.0) -> None:
        """Wait until every order issued so far (and every drop it caused) has completed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._outstanding)
            if not pending:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, not_done = wait(pending, timeout=left)
            if not_done and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(not_done)} orders still running after {timeout} s")
            self._completions.submit(lambda: None).result()  # let queued reports run
        if self.completion_errors:
            raise RuntimeError(f"completion failed: {self.completion_errors[0]!r}") from self.completion_errors[0]

    # --- state -----------------------------------------------------------------------------------

    def counters(self) -> dict:
        return {"control": dataclasses.asdict(self.control.counters()), "data": self.engine.counters()}

    def close(self) -> None:
        self.engine.close()
        self._completions.shutdown(wait=True)
        if self.ssd is not None:
            self.ssd.close()
        self.host_pool.close()

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
there too, before any later call's orders are issued (the slots they free may be what those
orders were given). Object sizes come from the page tables, not from the config: the config's
``chunk.kv_bytes_per_token`` and ``chunk.state_bytes`` are replaced by what the tables hold. The
control plane is built with the data plane's layout (``saria.sizing``): it charges every object
its whole host slots and SSD parts, against what the host pool and the drive files hold.
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
from saria.dataplane.transfer.engine import Blocks, Completion, LoadJob
from saria.dataplane.build import open_data_plane, sized_config
from saria.dataplane.devices import pool_initializer
from saria.kernels import PageTable

class TieredCache:
    """A :class:`~saria.control.ControlPlane` and a :class:`~saria.dataplane.transfer.engine.TransferEngine`
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
        self.config = config = sized_config(config, kv_table, block_tokens, state_table, state_pages)
        self.block_tokens = block_tokens
        self.clock = clock
        self.data = open_data_plane(config, kv_table, block_tokens=block_tokens, state_table=state_table,
                                    state_pages=state_pages, ssd_paths=ssd_paths,
                                    coordinator_mode=coordinator_mode, durable=durable, direct=direct)
        try:
            self.control = ControlPlane(config, sizing=self.data.sizing)
        except BaseException:
            self.data.close()
            raise
        self.engine, self.host_pool, self.ssd = self.data.engine, self.data.host_pool, self.data.ssd
        self.coordinator = self.data.coordinator
        self._completions = ThreadPoolExecutor(1, thread_name_prefix="saria-complete",
                                               initializer=pool_initializer(self.engine.device))
        self._outstanding: set[Future] = set()
        self._lock = threading.Lock()
        # held from a control-plane call that returns orders until they are issued: the drops a
        # completion causes run before the orders of any later call, which may use their slots
        self._issuing = threading.Lock()
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
        with self._issuing:
            orders = self.control.commit_prefill(chunk_hashes, self.clock(), plan=plan, failed=failed)
            self._execute(orders, kv_blocks, state_blocks)
        return orders

    def release(self, plan: ReloadPlan, failed: Sequence[Hashable | ObjectKey] = ()) -> None:
        """Unpin a plan that will not be committed (request aborted)."""
        with self._issuing:
            self._execute(self.control.release(plan, self.clock(), failed=failed), {}, None)

    def _execute(self, orders: Sequence[Order], kv_blocks, state_blocks) -> None:
        for run in self.engine.execute(orders, kv_blocks, state_blocks):
            future = run.completion
            if future is None:  # a drop: done already
                continue
            with self._lock:
                self._outstanding.add(future)
            future.add_done_callback(lambda f: self._completions.submit(self._report, f))

    def _report(self, future: Future) -> None:
        """Hand a completion to the control plane; run the drops it causes."""
        try:
            completion: Completion = future.result()
            with self._issuing:
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
        self.engine.close()  # finishes queued work, whose completions are reported below
        self._completions.shutdown(wait=True)
        self.data.close()

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The connector's worker half: saria's data plane on vLLM's paged KV cache.

* ``register_kv_caches``: one page table over every full-attention layer (each layer's tensor seen
  as ``[num_blocks, ...]`` pages), then a host pool, SSD store, coordinator and transfer engine
  sized by the same options as the scheduler's control plane.
* ``start_load_kv``: start each reload of the step's metadata (asynchronous: vLLM keeps the request
  waiting until ``get_finished`` reports it).
* ``get_finished``: reloads whose every object is in its pages (or failed); the failed objects'
  blocks go to ``get_block_ids_with_load_errors`` in the same step, so vLLM recomputes them.
* ``wait_for_save``: after the step's forward, run the orders of requests whose prompt it
  completed: stores and promotions copy pages to host slots (finished before the step ends, so the
  blocks may be reused at once and the next lookup finds them), writes from HBM are packed before
  the step ends and written to SSD in the background, drops free slots.
* ``build_connector_worker_meta``: load results and order completions, for the scheduler.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Hashable

import torch

from saria.orders import DropOrder, ObjectKey, PromoteOrder, StoreOrder, WriteOrder
from saria.dataplane.engine import LoadJob
from saria.dataplane.setup import DataPlane, open_data_plane
from saria.kernels import PageTable, pack_pages

from .geometry import EngineGeometry
from .metadata import CompletionReport, LoadReport, LoadSpec, SariaConnectorMetadata, SariaWorkerMetadata
from .settings import ConnectorSettings

log = logging.getLogger("saria.vllm")


def page_views(name: str, tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """A layer's KV cache as paged tensors whose dim 0 indexes vLLM blocks.

    vLLM 0.32 layer views put the block id first (``[num_blocks, ...]``, whatever the order inside
    a block); the older ``[2, num_blocks, ...]`` layout is two paged tensors (K and V).
    """
    if tensor.dim() >= 1 and tensor.shape[0] == num_blocks:
        return [tensor]
    if tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
        return [tensor[0], tensor[1]]
    raise ValueError(f"saria cannot find the block dimension of layer {name!r}: shape {tuple(tensor.shape)}, "
                     f"{num_blocks} blocks (expected [num_blocks, ...] or [2, num_blocks, ...])")


class SariaWorker:
    """Worker-side state of the connector (module docstring)."""

    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry, *, num_blocks: int):
        self.settings = settings
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.num_blocks = num_blocks
        self.data: DataPlane | None = None
        self.state_table: PageTable | None = None
        self._loads: dict[str, tuple[LoadSpec, LoadJob]] = {}
        self._load_reports: list[LoadReport] = []
        self._error_blocks: set[int] = set()
        self._failed_requests: set[str] = set()
        self._orders: list[tuple[int, Future]] = []
        self._captured: dict[str, dict[Hashable, torch.Tensor]] = {}  # GDN states set aside, per request

    @property
    def engine(self):
        if self.data is None:
            raise RuntimeError("saria: KV caches not registered yet")
        return self.data.engine

    def _table(self, layers: tuple[str, ...], kv_caches: dict[str, torch.Tensor]) -> PageTable:
        missing = [name for name in layers if name not in kv_caches]
        if missing:
            raise ValueError(f"saria: vLLM registered no KV cache for layer(s) {missing}")
        return PageTable([v for name in layers for v in page_views(name, kv_caches[name], self.num_blocks)])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        g = self.geometry
        table = self._table(g.attention_layers, kv_caches)
        if table.bytes_per_page != g.kv_bytes_per_token * self.block_size:
            raise ValueError(f"saria: attention pages hold {table.bytes_per_page} B, vLLM's spec says "
                             f"{g.kv_bytes_per_token * self.block_size}")
        if g.hybrid:
            self.state_table = self._table(g.state_layers, kv_caches)
            if self.state_table.bytes_per_page != g.state_bytes:
                raise ValueError(f"saria: GDN pages hold {self.state_table.bytes_per_page} B of state, vLLM's spec "
                                 f"says {g.state_bytes}")
        config = self.settings.saria_config(block_size=self.block_size, kv_bytes_per_token=g.kv_bytes_per_token,
                                            state_bytes=g.state_bytes)
        self.data = open_data_plane(config, table, block_tokens=self.block_size, state_table=self.state_table,
                                    ssd_paths=self.settings.ssd_paths, coordinator_mode=self.settings.coordinator,
                                    durable=self.settings.durable)
        log.info("saria worker: %d attention + %d GDN layers, %d B per page, host pool %s, SSD %s",
                 len(g.attention_layers), len(g.state_layers), table.bytes_per_page, self.data.host_pool,
                 f"{self.data.ssd.backend_name} on {len(self.data.ssd.paths)} drive(s)" if self.data.ssd else "off")

    # --- loads -----------------------------------------------------------------------------------

    def start_load_kv(self, meta: SariaConnectorMetadata) -> None:
        """Start the step's reloads. On CPU, wait for them here: the engine loop would otherwise hold
        the GIL between our threads' small operations (a convoy that turned a 1 MiB reload into
        seconds); waiting on an event frees it. On CUDA the copies run on the device and the loads
        stay asynchronous."""
        jobs = []
        for spec in meta.loads:
            job = self.engine.load(spec.plan, spec.kv_blocks, spec.state_blocks, skip_pages=spec.skip_pages)
            self._loads[spec.req_id] = (spec, job)
            jobs.append(job)
        if self.engine.device.type == "cpu":
            for job in jobs:
                job.wait()

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Reloads whose objects are all in their pages (or failed), reported once. Requests that
        vLLM finished drop the GDN states set aside for them."""
        for req_id in finished_req_ids:
            self._captured.pop(req_id, None)
        done = set()
        for req_id, (spec, job) in list(self._loads.items()):
            if not job.ready():
                continue
            result = job.wait()
            del self._loads[req_id]
            done.add(req_id)
            self._load_reports.append(LoadReport(req_id, spec.plan.plan_id, result.failed, result.valid_chunks))
            if result.failed:
                if self.geometry.hybrid:  # block ids are per group: vLLM takes request-level failures
                    self._failed_requests.add(req_id)
                    continue
                # Every block from the first chunk that did not arrive on: vLLM recomputes them.
                for c in range(result.valid_chunks, len(spec.kv_blocks)):
                    skip = spec.skip_pages if c == 0 else 0
                    self._error_blocks.update(spec.kv_blocks[c][skip:])
            elif spec.state_blocks is not None:  # keep the loaded state: a promotion may store it
                self._capture(req_id, spec.plan.state_chunk, spec.state_blocks[0])
        return done

    def take_error_blocks(self) -> set[int]:
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def take_failed_requests(self) -> set[str]:
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def _capture(self, req_id: str, chunk: Hashable, block: int) -> None:
        self._captured.setdefault(req_id, {})[chunk] = pack_pages(self.state_table, torch.tensor([block]))

    # --- orders ----------------------------------------------------------------------------------

    def wait_for_save(self, meta: SariaConnectorMetadata) -> None:
        """Run the step's orders after its forward; return once no page is read any more."""
        engine = self.engine
        for capture in meta.captures:  # states at the boundaries this step's forward ended on
            self._capture(capture.req_id, capture.chunk, capture.block)
        for batch in meta.orders:
            states = self._captured.pop(batch.req_id, {}) if batch.req_id is not None else {}
            prepacked = {ObjectKey(chunk, "state"): staging for chunk, staging in states.items()}
            for order in batch.orders:
                if isinstance(order, DropOrder):
                    engine.drop(order)
                elif isinstance(order, (StoreOrder, PromoteOrder)):
                    future = engine.store(order, batch.kv_blocks, prepacked=prepacked)
                    future.result()  # pages copied to host slots before the blocks can be reused
                    self._orders.append((order.order_id, future))
                elif isinstance(order, WriteOrder):
                    packed = threading.Event()
                    future = engine.write(order, batch.kv_blocks, packed=packed, prepacked=prepacked)
                    packed.wait()
                    self._orders.append((order.order_id, future))
                else:
                    raise ValueError(f"saria: unknown order {order!r}")

    def build_worker_meta(self) -> SariaWorkerMetadata | None:
        completions = []
        pending = []
        for order_id, future in self._orders:
            if future.done():
                c = future.result()
                completions.append(CompletionReport(order_id, c.ok, c.failed))
            else:
                pending.append((order_id, future))
        self._orders = pending
        loads, self._load_reports = self._load_reports, []
        if not loads and not completions:
            return None
        return SariaWorkerMetadata(loads, completions)

    def shutdown(self) -> None:
        if self.data is not None:
            for _, job in self._loads.values():
                job.wait()
            for _, future in self._orders:
                future.result()
            self.data.close()
            self.data = None

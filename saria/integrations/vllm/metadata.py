"""What crosses between the connector's two halves, and nothing else: the scheduler's per-step
metadata (loads to start, orders to run) and the worker's per-step report (loads finished,
orders completed). Plain picklable dataclasses: the halves may live in different processes.

Both carry the control plane's ``epoch``: the scheduler starts a new one whenever it replaces its
control plane after a fault, the worker drops what the new control plane cannot vouch for (DRAM
objects, unfinished SSD writes) when it first sees a newer one and reports its SSD inventory again
for the new control plane to take over, and the scheduler ignores reports of an older epoch. ``off``: that half turned
saria off for the rest of the run, and the other follows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from saria.orders import ObjectKey, Order, ReloadPlan

from .compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Reload ``plan`` into a request's pages: ``kv_blocks[i]`` are chunk ``i``'s block ids,
    ``skip_pages`` leading pages of chunk 0 are the engine's own (already computed) and are left
    alone; ``state_blocks``: where a hybrid plan's GDN state object goes. ``cluster``: chunks
    after the plan's, read from the cluster tier (their blocks are the last ``len(cluster)`` of
    ``kv_blocks``; the control plane knows nothing of them). ``audit_names``: with ``audit_kv``
    and a key file only, vLLM's block hash of each of the plan's chunks, the names under which the
    audit records what it served (a reference replays vLLM's pages by them: docs/security.md).
    ``layerwise``: a load inside the step that computes the request, layer by layer (vLLM heard it
    as synchronous: it is never reported finished, and a failed chunk's blocks go back as errors)."""

    req_id: str
    plan: ReloadPlan
    kv_blocks: tuple[tuple[int, ...], ...]
    skip_pages: int = 0
    state_blocks: tuple[int, ...] | None = None
    cluster: tuple[Hashable, ...] = ()
    audit_names: tuple[bytes, ...] = ()
    layerwise: bool = False


@dataclass(frozen=True)
class RequestOrders:
    """Orders the control plane returned for one request (or completions' follow-ups, ``req_id``
    None), with the pages of the chunks they read from HBM. A request's state objects come from
    the GDN states the worker captured for it (:class:`StateCapture`). ``share``: chunks whose kv
    objects go to the cluster tier: put once a store of them lands in DRAM, or before a DRAM drop
    frees them (``cluster_admission``)."""

    req_id: str | None
    orders: tuple[Order, ...]
    kv_blocks: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)
    share: frozenset = frozenset()


@dataclass(frozen=True)
class StateCapture:
    """After this step's forward, copy the GDN state in ``block`` (the request's state at the end of
    chunk ``chunk``, a boundary where the step ended) aside for the request's commit."""

    req_id: str
    chunk: Hashable
    block: int


@dataclass
class SariaConnectorMetadata(KVConnectorMetadata):
    """One step's work. ``cancels``: requests vLLM was told to wait for a load that will never be
    sent (a fault came between): the worker reports each one finished and failed, so vLLM
    recomputes it instead of waiting forever; a cancelled in-step (layer-wise) load, which vLLM runs
    in this very step, is named in ``cancel_blocks`` with the request's blocks, which the worker
    reports in error (vLLM drops the step's output for it and recomputes). ``held``: finished
    requests whose blocks vLLM keeps until the worker reports them sent (``request_finished``
    said so: orders still read them); ``preempted``: requests whose blocks vLLM freed this step, which the worker must stop reading
    before the step's forward writes them (``handle_preemptions``). ``resets``: how many times vLLM
    reset the connector (``reset_cache``: sleep, a weight update's pause,
    ``reset_prefix_cache(reset_connector=True)``); a worker that sees it change drops every object
    it holds (:mod:`.resets`)."""

    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[StateCapture] = field(default_factory=list)
    orders: list[RequestOrders] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    cancel_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    epoch: int = 0
    off: bool = False
    resets: int = 0


@dataclass(frozen=True)
class LoadReport:
    """A reload ended on ``reports`` workers (tensor parallelism: each holds a shard).
    ``failed``: the plan's objects that failed (for the control plane); ``cluster_failed``: how many
    of the load's cluster chunks were misses (the control plane never hears of them);
    ``valid_chunks``: the leading chunks of the whole load that arrived."""

    req_id: str
    plan_id: int
    failed: tuple[ObjectKey, ...]
    valid_chunks: int
    reports: int = 1
    cluster_failed: int = 0

    @property
    def short(self) -> bool:
        """Whether anything of the load failed (vLLM recomputes from ``valid_chunks`` on)."""
        return bool(self.failed or self.cluster_failed)

    def merge(self, other: "LoadReport") -> "LoadReport":
        """Two workers' reports of one load: it failed where either failed."""
        return LoadReport(self.req_id, self.plan_id, tuple(dict.fromkeys(self.failed + other.failed)),
                          min(self.valid_chunks, other.valid_chunks), self.reports + other.reports,
                          max(self.cluster_failed, other.cluster_failed))


@dataclass(frozen=True)
class CompletionReport:
    """An order ended on ``reports`` workers."""

    order_id: int
    ok: bool
    failed: tuple[ObjectKey, ...] = ()
    reports: int = 1

    def merge(self, other: "CompletionReport") -> "CompletionReport":
        """Two workers' reports of one order: it failed where either failed."""
        return CompletionReport(self.order_id, self.ok and other.ok, tuple(dict.fromkeys(self.failed + other.failed)),
                                self.reports + other.reports)


@dataclass
class SariaWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's report of the workers. ``inventory`` (sent once after a worker's data plane
    opened, and again at each new epoch): the SSD objects a previous run left (this run's too, at
    a new epoch), each with the number of ranks whose store holds its shard, merged over
    ``inventory_reports`` ranks. ``cluster_layouts`` (sent once, after a
    worker's cluster store opened): the layout each rank's cluster objects are keyed by."""

    loads: list[LoadReport] = field(default_factory=list)
    completions: list[CompletionReport] = field(default_factory=list)
    epoch: int = 0
    off: bool = False
    inventory: dict[ObjectKey, int] | None = None
    inventory_reports: int = 0
    cluster_layouts: tuple[str, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Tensor-parallel workers each hold a shard of every object: a load or order failed if it
        failed on any worker; saria is off if any worker turned it off; reports of an older epoch
        than the other worker's are dropped (the scheduler would ignore them)."""
        if not isinstance(other, SariaWorkerMetadata):
            return self
        if self.epoch != other.epoch:
            newer = self if self.epoch > other.epoch else other
            return SariaWorkerMetadata(newer.loads, newer.completions, newer.epoch, self.off or other.off,
                                       newer.inventory, newer.inventory_reports,
                                       self.cluster_layouts + other.cluster_layouts)
        loads = {r.req_id: r for r in self.loads}
        for r in other.loads:
            loads[r.req_id] = loads[r.req_id].merge(r) if r.req_id in loads else r
        done = {c.order_id: c for c in self.completions}
        for c in other.completions:
            done[c.order_id] = done[c.order_id].merge(c) if c.order_id in done else c
        return SariaWorkerMetadata(list(loads.values()), list(done.values()), self.epoch, self.off or other.off,
                                   *merge_inventories(self, other),
                                   cluster_layouts=self.cluster_layouts + other.cluster_layouts)


def merge_inventories(a: "SariaWorkerMetadata", b: "SariaWorkerMetadata"
                      ) -> tuple[dict[ObjectKey, int] | None, int]:
    """Two ranks' (or groups of ranks') inventories: per object, how many ranks hold it."""
    if a.inventory is None or b.inventory is None:
        return (a.inventory, a.inventory_reports) if b.inventory is None else (b.inventory, b.inventory_reports)
    return add_counts(a.inventory, b.inventory), a.inventory_reports + b.inventory_reports


def add_counts(a: dict[Any, int], b: dict[Any, int]) -> dict[Any, int]:
    """Per key, the count in ``a`` plus the count in ``b`` (a new dict): per object the ranks holding
    it, or per name a counter."""
    merged = dict(a)
    for key, count in b.items():
        merged[key] = merged.get(key, 0) + count
    return merged

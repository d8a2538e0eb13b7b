"""Live reload plans: what each one pinned, which of its SSD reads failed, and ending it.

A plan handed out by ``ControlPlane.plan`` stays live (in :class:`LivePlans`), its objects pinned
in their source tiers, until the request is committed or the plan released; then
:func:`finish_reads` marks its failed SSD reads bad, counts the reads a committed request used,
and unpins everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from saria.control.checks import check_id, objects_named
from saria.control.counters import Counters
from saria.control.residency import PendingChanges, Residency
from saria.control.tree import CacheObject, Node
from saria.orders import SSD, ControlPlaneError, ReloadPlan, Tier

if TYPE_CHECKING:
    from saria.control.emission import OrderEmitter

__all__ = ["LivePlans", "PlanRecord", "finish_reads"]


@dataclass(slots=True)
class PlanRecord:
    """A live plan and what it was planned from."""

    plan: ReloadPlan
    hashes: tuple             # the request's chunk hashes, as planned
    nodes: list[Node | None]  # their nodes (None: unknown), resolved at tree ``generation``
    generation: int
    state: CacheObject | None  # the checkpoint the plan reads (hybrid), pinned like its kv objects

    def reads(self) -> list[tuple[CacheObject, Tier]]:
        """Every (object, source tier) the plan reads and pins, in request order."""
        out: list[tuple[CacheObject, Tier]] = list(zip(self.nodes, self.plan.kv_sources))
        if self.state is not None:
            out.append((self.state, self.plan.state_source))
        return out

    def read_failures(self, failed: tuple) -> tuple[set[CacheObject], int]:
        """The plan's SSD-read objects named in ``failed`` (checked by ``check_names``), and the
        index of the first failed chunk (the plan's length if none)."""
        if not failed:
            return set(), self.plan.num_chunks
        ssd_reads = [obj for obj, source in self.reads() if source is SSD]
        bad = objects_named(ssd_reads, failed, f"plan {self.plan.plan_id} reads from SSD")
        index = {node: i for i, node in enumerate(self.nodes[:self.plan.num_chunks])}
        return bad, min(index[obj.node] for obj in bad)


class LivePlans:
    """The live plans of a control plane by id; ``orders`` hands out the ids (and knows the orders
    in flight), so that a lookup says what a wrong id is."""

    def __init__(self, orders: OrderEmitter) -> None:
        self._records: dict[int, PlanRecord] = {}
        self._orders = orders

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, plan_id: int) -> bool:
        return plan_id in self._records

    def records(self) -> Iterable[PlanRecord]:
        return self._records.values()

    def add(self, record: PlanRecord) -> None:
        self._records[record.plan.plan_id] = record

    def get(self, plan_id: int) -> PlanRecord | None:
        """The record of live plan ``plan_id``, or None (unchecked: :meth:`live` says what a wrong id is)."""
        return self._records.get(plan_id)

    def remove(self, record: PlanRecord) -> None:
        del self._records[record.plan.plan_id]

    def live(self, plan: ReloadPlan | int) -> PlanRecord:
        """The record of live plan ``plan`` (a plan or its id); raises :class:`ControlPlaneError`
        naming what ``plan`` is otherwise."""
        plan_id = plan.plan_id if isinstance(plan, ReloadPlan) else check_id(plan, "plan")
        record = self._records.get(plan_id)
        if record is None:
            if plan_id in self._orders.in_flight:
                raise ControlPlaneError(f"id {plan_id} is an order, not a reload plan")
            if self._orders.issued(plan_id):
                raise ControlPlaneError(f"plan {plan_id} was already released or committed (or is not a plan)")
            raise ControlPlaneError(f"unknown plan id {plan_id!r}: never issued")
        if isinstance(plan, ReloadPlan) and plan is not record.plan and plan != record.plan:
            raise ControlPlaneError(f"plan {plan_id} does not match the plan this control plane issued")
        return record


def finish_reads(record: PlanRecord, bad: set[CacheObject] | frozenset, used: bool, tiers: Residency, counters: Counters,
                 changes: PendingChanges) -> None:
    """Mark the plan's failed SSD reads (``bad``) bad, count its completed reads (of a ``used``
    plan: a committed request's; SSD bytes, as ``plan.ssd_bytes`` counts them), unpin everything the plan pinned."""
    plan = record.plan
    objs = record.nodes[:len(plan.chunk_hashes)]
    sources = plan.kv_sources
    if record.state is not None:
        objs.append(record.state)
        sources = sources + (plan.state_source,)
    for obj in bad:
        tiers.mark_bad(obj)
    if used and plan.ssd_bytes:
        counters.ssd_reads += sources.count(SSD) - len(bad)
        counters.ssd_bytes_read += plan.ssd_bytes - sum(obj.ssd_nbytes for obj in bad)
        for obj, source in zip(objs, sources):
            if source is SSD and obj.ssd_unread and obj not in bad:
                obj.ssd_unread = False
                counters.ssd_useful_write_bytes += obj.ssd_nbytes
    tiers.unpin_all(objs, sources, changes)

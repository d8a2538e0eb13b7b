"""What the connector's scheduler half keeps and counts: each request's state
(:class:`RequestState`), what the loads delivered (:class:`LoadCounters`), which orders read a
request's blocks or report back, and the periodic summary line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from saria.control import DropOrder, ObjectKey, Order, PromoteOrder, ReloadPlan, StoreOrder, Tier, WriteOrder

from .compat import resumed_req_ids
from .metadata import LoadReport, LoadSpec

_DRAM, _SSD = Tier.DRAM.value, Tier.SSD.value  # an enum's .value is a descriptor call: read once
TIER_NAMES = {tier: tier.value for tier in Tier}

TOTALS_FROM_CONTROL = ("requests", "ssd_writes", "ssd_bytes_written", "admissions_eviction", "admissions_reuse",
                       "admissions_prewrite", "promotions")


@dataclass
class LoadCounters:
    """What the connector's loads actually delivered into vLLM's blocks (a plan's chunks that vLLM
    already held, or that failed and were recomputed, are not hits)."""

    loads: int = 0
    loads_failed: int = 0
    hit_tokens_dram: int = 0
    hit_tokens_ssd: int = 0
    hit_tokens_cluster: int = 0
    cluster_chunks_missed: int = 0

    def count(self, chunks: tuple[tuple[str, int], ...], report: LoadReport, *, hybrid: bool) -> None:
        """One load ended (every rank's report merged): ``chunks`` is its ``(tier, tokens)`` per
        chunk. A failed load delivered its chunks before ``valid_chunks`` (vLLM recomputes from
        there on); a hybrid model's failed load delivered nothing (vLLM recomputes the request)."""
        self.loads += 1
        delivered = len(chunks)
        if report.short:
            self.loads_failed += bool(report.failed)  # a cluster miss is not a failure
            self.cluster_chunks_missed += report.cluster_failed
            delivered = 0 if hybrid else min(report.valid_chunks, len(chunks))
        for tier, tokens in chunks[:delivered]:
            if tier == _DRAM:
                self.hit_tokens_dram += tokens
            elif tier == _SSD:
                self.hit_tokens_ssd += tokens
            elif tier == "cluster":
                self.hit_tokens_cluster += tokens


@dataclass(slots=True)
class RequestState:
    """What the scheduler half knows of one request, from its lookup to its end."""

    request: Any  # vLLM's Request (block_hashes, num_prompt_tokens)
    plan: ReloadPlan | None = None  # pinned, until committed or released
    load: LoadSpec | None = None  # to send with the next metadata
    load_sent: bool = False
    load_report: LoadReport | None = None
    computed: int = 0  # tokens computed once the last scheduled step ends
    block_ids: list[int] = field(default_factory=list)  # full-attention group
    state_block_ids: list[int] = field(default_factory=list)  # GDN group (hybrid models)
    captured: set[int] = field(default_factory=set)  # chunk indices whose GDN state the worker holds
    committed: bool = False
    load_tokens: tuple[tuple[str, int], ...] = ()  # (tier, tokens) per chunk of the load, as sent
    reads_pages: bool = False  # its commit sent orders that read its blocks after the step (stores, GPU writes)
    cluster: tuple = ()  # chunks after the plan found in the cluster tier (chunk cluster_start on)
    cluster_start: int = 0
    load_end: int = 0  # tokens: where the planned load ends (the plan's end, or its cluster chunks')
    load_first: int = 0  # the load's first chunk (vLLM holds the ones before)
    prompt_hashes: tuple | None = None  # the prompt's chunk hashes (names), from its lookup

    def preempted(self) -> None:
        """vLLM preempted the request: its blocks are freed and its tokens will be computed again."""
        self.block_ids, self.state_block_ids, self.computed = [], [], 0
        self.captured.clear()

    def cluster_loaded(self) -> tuple:
        """The cluster chunks the load delivered into the request's blocks."""
        if self.load_report is None or not self.cluster:
            return ()
        if not self.load_report.short:
            return self.cluster
        return self.cluster[:max(0, self.load_first + self.load_report.valid_chunks - self.cluster_start)]

    @property
    def failed(self) -> tuple[ObjectKey, ...]:
        """The plan's SSD reads that failed, for the control plane (which hears of SSD reads only)."""
        return self.failed_from(Tier.SSD)

    def failed_from(self, tier: Tier) -> tuple[ObjectKey, ...]:
        """The objects of the plan read from ``tier`` whose reload failed."""
        if self.load_report is None or self.plan is None or not self.load_report.failed:
            return ()
        keys = set(self.plan.keys_from(tier))
        return tuple(key for key in self.load_report.failed if key in keys)


def follow_blocks(requests: dict[str, RequestState], out: Any, fa: int, gdn: int | None) -> None:
    """Follow each request's blocks (``fa``: vLLM's full-attention group, ``gdn``: its GDN group
    or None) and computed tokens through vLLM's scheduler output. A new request, or (vLLM 0.34) a
    resumed one, brings all its blocks; a cached one appends its new blocks, unless it resumed
    after a preemption this step (vLLM 0.32, 0.33: :func:`~.compat.resumed_req_ids`)."""
    scheduled = out.num_scheduled_tokens
    seen = 0  # followed requests among the new ones
    for new in out.scheduled_new_reqs:
        state = requests.get(new.req_id)
        if state is not None:
            seen += 1
            state.block_ids = list(new.block_ids[fa]) if new.block_ids else []
            state.state_block_ids = list(new.block_ids[gdn]) if new.block_ids and gdn is not None else []
            state.computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
    if seen < len(requests):  # some followed requests run from an earlier step (a request is new or cached, not both)
        _follow_cached(requests, out, fa, gdn, scheduled)
    for req_id in out.preempted_req_ids or ():
        state = requests.get(req_id)
        if state is not None:
            state.preempted()


def _follow_cached(requests: dict[str, RequestState], out: Any, fa: int, gdn: int | None, scheduled: dict) -> None:
    """:func:`follow_blocks` for the followed requests among ``out.scheduled_cached_reqs``."""
    cached = out.scheduled_cached_reqs
    resumed = resumed_req_ids(cached)
    req_ids = cached.req_ids
    if len(requests) < len(req_ids):  # fewer followed than running: find them by id
        index = dict(zip(req_ids, range(len(req_ids))))
        followed = [(i, req_id) for req_id in requests if (i := index.get(req_id)) is not None]
    else:
        followed = enumerate(req_ids)
    for i, req_id in followed:
        state = requests.get(req_id)
        if state is None:
            continue
        new_ids = cached.new_block_ids[i]
        if req_id in resumed:
            state.block_ids = list(new_ids[fa]) if new_ids else []
            state.state_block_ids = list(new_ids[gdn]) if new_ids and gdn is not None else []
        elif new_ids:
            state.block_ids += new_ids[fa]
            if gdn is not None:
                state.state_block_ids += new_ids[gdn]
        state.computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)


def reads_pages(order: Order) -> bool:
    """Orders that read a request's blocks after its step: stores, promotions, writes from HBM."""
    return isinstance(order, (StoreOrder, PromoteOrder)) or (isinstance(order, WriteOrder) and order.source is Tier.GPU)


def completes(order: Order) -> bool:
    """Orders that report back (drops do not)."""
    return not isinstance(order, DropOrder)


def summary_line(totals: dict[str, int], rebuilds: int = 0) -> str:
    """The periodic log line, from :meth:`SchedulerGuard.totals` (since start, over rebuilds): what
    the loads delivered (tokens vLLM did not compute), SSD traffic and admissions, faults."""
    t = totals
    cluster = f" + {t['hit_tokens_cluster']} from the cluster" if t.get("hit_tokens_cluster") else ""
    return (f"{t['requests']} requests, loaded {t['hit_tokens_dram']} tokens from DRAM + {t['hit_tokens_ssd']} "
            f"from SSD{cluster} in {t['loads']} loads ({t['loads_failed']} failed), SSD writes {t['ssd_writes']} "
            f"({t['ssd_bytes_written'] / 2**30:.2f} GiB), admissions eviction {t['admissions_eviction']} / reuse "
            f"{t['admissions_reuse']} / prewrite {t['admissions_prewrite']}, promotions {t['promotions']}, "
            f"faults {t['scheduler_faults']} (control plane rebuilt {rebuilds}x)")

"""The connector's scheduler half: saria's control plane inside vLLM's scheduler.

Per request:

1. ``get_num_new_matched_tokens``: plan the request's full chunks (chunk ``i``'s hash is vLLM's
   block hash of its last block, prefix-chained like vLLM's own) and offer the planned tokens
   beyond what vLLM computed locally, loaded asynchronously (the request waits for them).
2. ``update_state_after_alloc``: the load's target blocks are known; a ``LoadSpec`` goes into
   the next step's metadata.
3. ``update_connector_output``: the worker reports the load (failed objects, if any) and order
   completions; completions go to the control plane, whose follow-up drops go to the worker
   (in the next metadata, before that step's commits, whose orders may take the slots they free). A
   failed DRAM reload means the control plane and the data plane disagree: it raises, and the
   guard rebuilds both.
4. ``build_connector_meta``: in the step whose forward completes the request's prompt, commit it
   (``commit_prefill``, with the load's failures) and send the orders with the blocks of every
   chunk: the worker starts them after that forward, and the step goes on without waiting for them.
5. ``request_finished``: release a plan never committed (aborted or preempted requests); a
   request whose commit sent orders that read its blocks (stores, promotions, writes from HBM) keeps
   them until the worker reports it sent (vLLM's delayed free), so no step waits for a copy.
6. Cache hints (:mod:`saria.control.hints`, docs/vllm.md "Cache hints"): a request's
   ``kv_transfer_params`` (and vLLM's ``session_id``) are read once (:meth:`SariaScheduler.hints_of`),
   keyed by its tenant; its commit passes them to ``commit_prefill``, its finish to ``turn_ended``,
   and each ``build_connector_meta`` adds the hinted prewarms due. A malformed hint is counted and
   warned about (rate-limited, never its value), never a failed request.
7. Prewarming (``Policy.prewarm``, :mod:`.prewarm`): a request's arrival and finish feed its
   session's gap predictor (sessions keyed by the hash of their latest prompt's last full chunk);
   each ``build_connector_meta`` adds the prewarm orders due (``PromoteOrder`` from SSD to DRAM),
   run by the workers like every order and completed through ``update_connector_output``.

At start (``recover``, :mod:`.recovery`), the SSD objects a previous run of this server left are taken over: each
worker rank reports its store's inventory with its first report, and once every rank has, the
objects every rank holds a shard of go to the control plane (``ControlPlane.recover_ssd``); the
others are deleted on every rank (a chunk is served only whole). Until then (at most
``recover_wait_s``) lookups answer "not yet" and vLLM asks again next step (the pending work keeps
it stepping), so the first requests after a restart find the previous run's prefixes. A control
plane built after a fault (:class:`~.guard.SchedulerGuard`) does the same with the objects this run
wrote: the ranks send their inventories again at the new epoch, and the SSD tier is served on.

vLLM calls it through :class:`~.guard.SchedulerGuard`, which replaces it (and its control plane)
when it raises.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from saria.control import ControlPlane, DropOrder, Order, StoreOrder, Tier
from saria.control.makers import frozen_maker
from saria.control.hints import parse_hints
from saria.dataplane.cluster.index import ClusterIndex
from saria.dataplane.ssd.keys import object_key
from saria.sizing import size_tiers

from .geometry import EngineGeometry
from .metadata import (CompletionReport, LoadReport, LoadSpec, RequestOrders, SariaConnectorMetadata,
                       SariaWorkerMetadata, StateCapture)
from .events import KVEvents
from .prewarm import PrewarmSession, PrewarmSessions
from .recovery import InventoryTakeover
from .requests import TIER_NAMES, TOTALS_FROM_CONTROL, LoadCounters, RequestState, follow_blocks, reads_pages
from .sealing import ChunkNames
from .settings import ConnectorSettings

log = logging.getLogger("saria.vllm")

RECOVER_WAIT_S = 30.0  # longest a lookup waits for the ranks' SSD inventories at start
HINT_WARN_EVERY_S = 60.0  # at most one warning about malformed or refused hints per this many seconds
# the hint counters (saria.control.hints.HintCounters) in the connector's totals; pinned_bytes is a gauge
HINT_TOTALS = ("hinted_admissions", "pinned_bytes", "pins_refused", "retains_refused", "prewarms_hinted",
               "sessions_done")
MAX_HINTED_REQUESTS = 1 << 16  # requests whose hints are kept (each is forgotten when it finishes)
NO_HINTS = (None, None)  # hints_of a request without kv_transfer_params or session_id
LAYOUT_WAIT_S = 30.0  # longest a lookup waits for the ranks' cluster layouts at start
# LoadSpec(...) and RequestOrders(...), once per request each, every field given (saria.control.makers)
_make_load = frozen_maker(LoadSpec)
_make_orders = frozen_maker(RequestOrders)
_NO_SHARE: frozenset = frozenset()


def uncount_failed(state: RequestState, load: LoadReport) -> None:
    """An in-step (layer-wise) load fell short: vLLM counted all of its tokens as cached when it
    scheduled the request in the load's step (``Request.prefill_stats``, what the request's
    ``cached_tokens`` reports) and recomputes the failed ones now. Take those back out, so the
    request reports the tokens it reused, as an asynchronous load's does. (Dense models only: a
    hybrid one never loads in-step.)"""
    chunks = state.load_tokens
    delivered = min(load.valid_chunks, len(chunks))
    uncount_tokens(state.request, sum(tokens for _, tokens in chunks[delivered:]))


def uncount_tokens(request: Any, tokens: int) -> None:
    """Take ``tokens`` external tokens back out of what vLLM counts as the request's cached tokens
    (vLLM 0.32's ``Request.prefill_stats``, set when it first scheduled the request; not yet
    reported: a step whose load failed emits nothing for the request)."""
    stats = getattr(request, "prefill_stats", None)
    if stats is None or not hasattr(stats, "num_external_cached_tokens") or tokens <= 0:
        return
    stats.set(num_prompt_tokens=stats.num_prompt_tokens, num_local_cached_tokens=stats.num_local_cached_tokens,
              num_external_cached_tokens=max(0, stats.num_external_cached_tokens - tokens))


class SariaScheduler:
    """Scheduler-side state of the connector (module docstring)."""

    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry, *, workers: int = 1,
                 recover: bool = False, recover_wait_s: float = RECOVER_WAIT_S,
                 clock: Callable[[], float] = time.monotonic, cluster: ClusterIndex | None = None,
                 names: ChunkNames | None = None, layerwise: bool = False, events: KVEvents | None = None,
                 pin_bytes_per_tenant: int | None = None):
        if cluster is not None and geometry.hybrid:
            raise ValueError("saria: the cluster tier serves dense (attention-only) models; this one is hybrid "
                             "(GDN states): drop the cluster option")
        self.settings = settings
        # loads run inside the step that computes the request, layer by layer (settings.layerwise_for):
        # vLLM hears them as synchronous, and schedules the request in the same step
        self.layerwise = layerwise and not geometry.hybrid
        self.cluster = cluster  # the cluster tier's lookups (shared by every control plane of this server)
        self._layouts_since: float | bool | None = None  # when lookups began waiting for the ranks' layouts (False: done)
        self.geometry = geometry
        block_size = geometry.block_size
        self.config = settings.saria_config(block_size=block_size, kv_bytes_per_token=geometry.kv_bytes_per_token,
                                            state_bytes=geometry.state_bytes, shards=workers,
                                            kv_element_bytes=geometry.kv_element_bytes)
        # each worker rank lays out its host pool and drive files by the same rule (open_data_plane,
        # one drive file per ssd_paths entry): charged whole slots and parts, what it admits fits there
        # the pin and retain caps are the server's, per tenant; the control plane counts one shard's bytes
        pin_cap = settings.pin_bytes_per_tenant if pin_bytes_per_tenant is None else pin_bytes_per_tenant
        retain_cap = settings.retain_bytes_per_tenant
        self.control = ControlPlane(self.config, sizing=size_tiers(self.config, drives=len(self.config.ssd_paths)),
                                    pin_bytes_per_tenant=None if pin_cap is None else pin_cap // workers,
                                    retain_bytes_per_tenant=None if retain_cap is None else retain_cap // workers)
        self.block_size = block_size
        self.blocks_per_chunk = self.config.chunk.chunk_tokens // block_size
        # read on every hook: kept here once (config and geometry are fixed for this scheduler's life)
        self._chunk_tokens = self.config.chunk.chunk_tokens
        self._hashes_per_chunk = self._chunk_tokens // geometry.hash_tokens
        self._hybrid = geometry.hybrid
        if cluster is not None and settings.cluster_staging_bytes < self.config.chunk.kv_bytes:
            raise ValueError(f"saria: cluster_staging_bytes ({settings.cluster_staging_bytes}) holds no chunk: a chunk's "
                             f"object is {self.config.chunk.kv_bytes} bytes per rank; give at least that")
        self.checkpoint_tokens = settings.checkpoint_tokens_for(self.config.chunk.chunk_tokens)
        self.workers = workers
        self.clock = clock
        self._requests: dict[str, RequestState] = {}
        # of those, the ones not yet committed, in the same order: the only ones a step's metadata
        # follows, loads or commits (a committed request's blocks and tokens are no longer read)
        self._open: dict[str, RequestState] = {}
        # of those, the ones still computing their prompt (a dense model's: a request past its prompt,
        # waiting for its load report to commit, needs no more of vLLM's blocks or tokens, only a
        # preemption's reset); a hybrid model's steps follow every open request (_captures)
        self._computing: dict[str, RequestState] = {}
        self._follow_ups: list[Order] = []  # drops caused by completions and releases
        self._partial_loads: dict[str, LoadReport] = {}
        self._partial_orders: dict[int, CompletionReport] = {}
        self._in_flight: set[int] = set()
        self._first: list[Order] = []  # drops to run before any other order (recovery's)
        self.takeover = InventoryTakeover(self.control, workers, recover_wait_s, clock, active=recover)
        self.loaded = LoadCounters()
        self.prewarm = PrewarmSessions(self.control, self.config)
        self._sessions: dict[str, PrewarmSession] = {}  # request id -> its session (prewarming only)
        self.names = names or ChunkNames(None)  # block hashes, or with a key file the tenant's chunk ids
        self._hints: dict[str, tuple] = {}  # request id -> (Hints or None, tenant), read once per request
        self.hints_malformed = 0  # malformed or unknown hint keys ignored
        self._warned = {kind: (0, -HINT_WARN_EVERY_S) for kind in ("malformed", "refused", "retain_refused")}  # (count, when)
        # vLLM's KV events for saria's tiers (shared by every control plane of this server): this one holds nothing yet
        self.events = events
        if events is not None:
            events.restart()
            if not recover:
                events.recovered(())  # no SSD takeover will come

    # --- hashing ---------------------------------------------------------------------------------

    def chunk_hashes(self, request: Any, max_tokens: int) -> list[bytes]:
        """Hashes of the request's full chunks within its first ``max_tokens`` tokens: vLLM's
        block hash at each chunk's last token (block hashes are prefix-chained; vLLM computes one
        every ``hash_block_size`` tokens, a block or, for hybrid models with partial prefix hits,
        a fraction of one). With a key file, each is the tenant's chunk id of that block hash
        (:class:`~.sealing.ChunkNames`): nothing past this method sees a block hash or a salt."""
        k = self._hashes_per_chunk
        block_hashes = request.block_hashes
        chunks = min(len(block_hashes) // k, max(0, max_tokens) // self._chunk_tokens)
        return self.names.names(request, block_hashes[k - 1:chunks * k:k])

    # --- vLLM scheduler hooks --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if (self.takeover.active and self.takeover.waiting()) or (self.cluster is not None and self._awaiting_layouts()):
            return None, False  # vLLM asks again next step
        req_id = request.request_id
        if req_id in self._requests:
            self._drop_plan(req_id)  # a re-query (e.g. after preemption) plans afresh
        state = RequestState(request)
        self._track(req_id, state)
        # the prompt's chunk hashes, kept for its commit (the same request, the same prompt); a
        # tuple, as the control plane takes them (a list would be copied at its plan and its commit)
        prompt_tokens = request.num_prompt_tokens
        full = state.prompt_hashes = tuple(self.chunk_hashes(request, prompt_tokens))
        if self.prewarm.enabled and req_id not in self._sessions:  # its arrival
            self._sessions[req_id] = self.prewarm.arrived(list(full), self.clock())
        # vLLM must compute at least the prompt's last token itself.
        hashes = full[:(prompt_tokens - 1) // self._chunk_tokens]
        if not hashes:
            return 0, False
        plan = self.control.plan(hashes, self.clock())
        tokens = plan.tokens
        if self.cluster is not None and plan.num_chunks < len(hashes):
            start = max(plan.num_chunks, num_computed_tokens // self.config.chunk.chunk_tokens)
            room = self.settings.cluster_staging_bytes // self.config.chunk.kv_bytes  # one load's staging holds
            found = self.cluster.leading([object_key(h, "kv") for h in hashes[start:start + room]])
            if found:
                state.cluster, state.cluster_start = tuple(hashes[start:start + found]), start
                tokens = (start + found) * self.config.chunk.chunk_tokens
        if tokens <= num_computed_tokens:
            self._follow_ups += self.control.release(plan, self.clock())
            state.cluster = ()
            return 0, False
        state.plan, state.load_end = plan, tokens
        return tokens - num_computed_tokens, not self.layerwise

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 groups: Any = None) -> None:
        """``groups``: ``blocks.get_block_ids()``, when the caller has it already."""
        state = self._requests.get(request.request_id)
        if state is None or state.plan is None or state.load_sent:
            return
        if num_external_tokens == 0:  # vLLM will not load (e.g. no room): nothing to pin
            self._drop_plan(request.request_id)
            return
        plan = state.plan
        chunk_tokens = self._chunk_tokens
        end = state.load_end
        start = end - num_external_tokens  # tokens vLLM holds already
        first = state.load_first = start // chunk_tokens
        skip = (start % chunk_tokens) // self.block_size
        if groups is None:
            groups = blocks.get_block_ids()
        ids = groups[self.geometry.attention_group]
        k = self.blocks_per_chunk
        if first < len(plan.chunk_hashes):  # the chunks vLLM does not hold, with their totals
            # from chunk 0 that is the live plan this state holds (what plan_from answers)
            sub = plan if first == 0 else self.control.plan_from(plan, first)
        else:  # vLLM holds the whole local plan: the load is cluster chunks only
            sub = dataclasses.replace(plan, chunk_hashes=(), kv_sources=(), tokens=0, dram_bytes=0, ssd_bytes=0)
        state_blocks = None
        if plan.state_chunk is not None:
            # vLLM resumes a GDN layer from the state in the block of the last block boundary reached.
            state_blocks = (groups[self.geometry.state_group][plan.tokens // self.block_size - 1],)
            state.captured.add(plan.num_chunks - 1)  # the worker keeps the loaded state for promotion
        cluster = state.cluster[max(0, first - state.cluster_start):]
        state.load_tokens = self._load_tokens(state, num_external_tokens)
        audit_names = ()
        if self.settings.audit_kv and self.names.renamed:  # a verification mode (docs/security.md)
            h = self.config.chunk.chunk_tokens // self.geometry.hash_tokens
            audit_names = tuple(request.block_hashes[(c + 1) * h - 1] for c in range(first, first + sub.num_chunks))
        state.load = _make_load(request.request_id, sub,
                                tuple([tuple(ids[c:c + k]) for c in range(first * k, end // chunk_tokens * k, k)]),
                                skip, state_blocks, cluster, audit_names, self.layerwise)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the load by tier (``"dram"`` / ``"ssd"`` / ``"cluster"``), for vLLM's hit-source stats."""
        state = self._requests.get(request.request_id)
        if state is None or state.plan is None or num_external_tokens <= 0:
            return {}
        out: dict[str, int] = {}
        for tier, tokens in self._load_tokens(state, num_external_tokens):
            out[tier] = out.get(tier, 0) + tokens
        return out

    def _load_tokens(self, state: RequestState, num_external_tokens: int) -> tuple[tuple[str, int], ...]:
        """``(tier, tokens)`` per chunk that the load fills: the request's last ``num_external_tokens``
        tokens up to the end of its plan and cluster chunks (vLLM holds the ones before)."""
        chunk_tokens, end = self._chunk_tokens, state.load_end
        start = end - num_external_tokens
        names = TIER_NAMES
        tiers = [names[tier] for tier in state.plan.kv_sources]
        if state.cluster:
            tiers += ["vllm"] * (state.cluster_start - len(tiers)) + ["cluster"] * len(state.cluster)
        out = []
        low = 0  # chunk i covers tokens [low, low + chunk_tokens)
        for tier in tiers:
            high = low + chunk_tokens
            tokens = (high if high < end else end) - (low if low > start else start)
            if tokens > 0:
                out.append((tier, tokens))
            low = high
        return tuple(out)

    def build_connector_meta(self, scheduler_output: Any) -> SariaConnectorMetadata:
        open_ = self._open
        if self._hybrid:
            follow_blocks(open_, scheduler_output, self.geometry.attention_group, self.geometry.state_group)
        else:
            self._follow_computing(scheduler_output)
        meta = SariaConnectorMetadata()
        if self._first:
            meta.orders.append(RequestOrders(None, tuple(self._first)))
            self._first = []
        # the drops completions and releases caused, before this step's commits: the control plane
        # freed their slots when it decided them and may have given them to a commit's orders
        # (charged exactly, saria.sizing: a host pool or drive file has no slot to spare)
        if self._follow_ups:
            meta.orders.append(RequestOrders(None, tuple(self._follow_ups), share=self._shares(self._follow_ups)))
            self._follow_ups = []
        for state in open_.values():
            if state.load is not None:
                meta.loads.append(state.load)
                state.load, state.load_sent = None, True
        if self._hybrid:
            meta.captures = self._captures(scheduler_output)
        committed = [(req_id, state) for req_id, state in open_.items()
                     if not state.committed and state.computed >= state.request.num_prompt_tokens
                     and (not state.load_sent or state.load_report is not None)]  # _ready_to_commit, inlined
        orders = meta.orders
        computing = self._computing
        for req_id, state in committed:
            del open_[req_id]
            if computing:
                computing.pop(req_id, None)
            orders.append(self._commit(req_id, state))
        if self.prewarm.enabled:
            warm = self.prewarm.due(self.clock())
            if warm:
                orders.append(RequestOrders(None, tuple(warm)))
        if self.control.hints_active():  # next_turn_s hints: their own schedule, no policy needed
            warm = self.control.hinted_prewarms(self.clock())
            if warm:
                orders.append(RequestOrders(None, tuple(warm)))
        in_flight, events = self._in_flight, self.events
        for batch in orders:  # the orders that report back (completes(), inlined: drops do not)
            in_flight.update([o.order_id for o in batch.orders if not isinstance(o, DropOrder)])
            if events is not None:
                events.sent(batch.orders)
        return meta

    def update_connector_output(self, output: Any) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, SariaWorkerMetadata):
            return
        if report.inventory is not None:
            self._first += self.takeover.add(report.inventory, report.inventory_reports)
            if self.events is not None and not self.takeover.active:
                self.events.recovered(self.takeover.recovered)
        if report.cluster_layouts and self.cluster is not None:
            self.cluster.add_layouts(report.cluster_layouts)
        lost = {}
        for load in report.loads:
            load = self._merge(self._partial_loads, load.req_id, load)
            if load is not None:
                state = self._requests.get(load.req_id)
                if state is not None:
                    state.load_report = load
                    self.loaded.count(state.load_tokens, load, hybrid=self.geometry.hybrid)
                    if load.failed and state.plan is not None and state.plan.state_chunk is not None:
                        state.captured.discard(state.plan.num_chunks - 1)  # no loaded state to keep
                    if load.failed and state.failed_from(Tier.DRAM):
                        lost[load.req_id] = state.failed_from(Tier.DRAM)
                    if self.layerwise and load.short:
                        uncount_failed(state, load)
                if load.failed:
                    log.warning("saria: reload for request %s failed for %d object(s); vLLM recomputes them",
                                load.req_id, len(load.failed))
                elif load.cluster_failed:  # evicted, timed out, ...: a miss, not a fault
                    log.info("saria: %d cluster chunk(s) of request %s missed; vLLM recomputes them",
                             load.cluster_failed, load.req_id)
        for done in report.completions:
            done = self._merge(self._partial_orders, done.order_id, done)
            if done is not None:
                self._in_flight.discard(done.order_id)
                self._follow_ups += self.control.complete(done.order_id, done.ok, self.clock(), failed=done.failed)
                if self.events is not None:
                    self.events.completed(done.order_id, done.ok, done.failed)
        if lost:  # the control plane holds copies the data plane does not: neither can be trusted
            raise RuntimeError(f"DRAM reloads failed (objects the control plane holds in DRAM that the data plane "
                               f"could not deliver): {lost}")

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Blocks of a request whose commit sent orders that read them (stores, promotions, writes
        from HBM) stay with vLLM until the worker reports the request sent (those orders no longer
        read them, :meth:`SariaWorker.get_finished`); any other request's are freed at once."""
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is not None and state.plan is not None:
            self._drop_plan(req_id)
        if self._sessions:
            session = self._sessions.pop(req_id, None)
            if session is not None:
                self.prewarm.finished(session, self.chunk_hashes(request, request.num_prompt_tokens), self.clock())
        hints, tenant = self.hints_of(request)
        if self._hints:
            self._hints.pop(req_id, None)
        if hints is not None and hints.next_turn_s is not None:
            self.control.turn_ended(self.chunk_hashes(request, request.num_prompt_tokens), self.clock(), hints, tenant)
        if state is not None:
            del self._requests[req_id]
            self._open.pop(req_id, None)
            self._computing.pop(req_id, None)
        self.names.forget(req_id)
        return state is not None and state.reads_pages, None

    def totals(self) -> dict[str, int]:
        """Counters since this scheduler (and its control plane) started: what loads delivered
        (:class:`LoadCounters`) and the control plane's requests, SSD writes and admissions."""
        c = self.control.counters()
        out = {name: getattr(self.loaded, name) for name in self.loaded.__dataclass_fields__}  # numbers: shallow
        for name in TOTALS_FROM_CONTROL:
            out[name] = getattr(c, name)
        h = self.control.hint_counters()
        for name in HINT_TOTALS:
            out[name] = getattr(h, name)
        out["hints_malformed"] = self.hints_malformed
        return out

    def hints_of(self, request: Any) -> tuple:
        """``(hints, tenant)`` of a request (:func:`saria.control.hints.parse_hints` of its
        ``kv_transfer_params`` and ``session_id``; its tenant, :meth:`~.sealing.ChunkNames.tenant_of`),
        read once and kept until it finishes. Malformed or unknown keys are counted and warned about
        (rate-limited; never a value). Never raises: a request whose hints cannot be read has none."""
        req_id = request.request_id
        found = self._hints.get(req_id)
        if found is not None:
            return found
        params, session_id = getattr(request, "kv_transfer_params", None), getattr(request, "session_id", None)
        if params is None and session_id is None:  # the common case: no hint to read (parse_hints: none, no problem)
            return NO_HINTS
        try:
            hints, problems = parse_hints(params, session_id)
            tenant = self.names.tenant_of(request) if hints is not None else None
        except Exception:  # noqa: BLE001 - a salt of an odd type, say: no hints, one problem
            hints, problems, tenant = None, 1, None
        if problems:
            self.hints_malformed += problems
            self._warn("malformed", problems, "malformed or unknown cache hint(s) in kv_transfer_params ignored "
                                              "(docs/vllm.md, 'Cache hints')")
        if len(self._hints) >= MAX_HINTED_REQUESTS:
            self._hints.clear()  # a bound, not a policy: each request's entry goes when it finishes
        self._hints[req_id] = found = (hints, tenant)
        return found

    def _warn(self, kind: str, count: int, what: str) -> None:
        """One warning per ``HINT_WARN_EVERY_S`` per kind, with the count since the last one."""
        pending, last = self._warned[kind]
        pending += count
        now = self.clock()
        if now - last >= HINT_WARN_EVERY_S:
            log.warning("saria: %d %s", pending, what)
            pending, last = 0, now
        self._warned[kind] = (pending, last)

    def has_pending_work(self) -> bool:
        """Orders not yet sent or not yet completed, or inventories awaited (for at most
        ``recover_wait_s``: an idle engine steps to fetch them, and stops stepping if they never
        come), or a prewarm due now: the engine should keep stepping."""
        due = self.control.next_hinted_prewarm()
        return bool(self._follow_ups or self._first or self._in_flight or self.takeover.waiting()
                    or self._awaiting_layouts()
                    or (self.prewarm.enabled and self.prewarm.pending(self.clock()))
                    or (due is not None and due <= self.clock()))

    # --- internals -------------------------------------------------------------------------------

    def _awaiting_layouts(self) -> bool:
        """Whether lookups should wait for the ranks' cluster layouts (their first report, one step
        after start), for at most ``LAYOUT_WAIT_S``: without them no cluster object can be found."""
        if self.cluster is None or self.cluster.ready or self._layouts_since is False:
            return False
        now = self.clock()
        if self._layouts_since is None:
            self._layouts_since = now
        if now - self._layouts_since < LAYOUT_WAIT_S:
            return True
        self._layouts_since = False  # waited long enough: serve, and say so once
        log.warning("saria: cluster layouts came from %d of %d worker rank(s) within %g s; cluster lookups find "
                    "nothing until the rest arrive", self.cluster.layouts, self.workers, LAYOUT_WAIT_S)
        return False

    def _captures(self, out: Any) -> list[StateCapture]:
        """GDN states to copy aside after this step: where a request's step ends on a chunk
        boundary that is a checkpoint (a multiple of ``checkpoint_tokens``) or its prompt's last
        chunk boundary. vLLM keeps the state at block boundary ``b`` in GDN block ``b - 1``."""
        captures = []
        chunk_tokens = self.config.chunk.chunk_tokens
        for req_id in out.num_scheduled_tokens:
            state = self._open.get(req_id)
            if state is None or state.committed:
                continue
            end = state.computed
            last = state.request.num_prompt_tokens // chunk_tokens * chunk_tokens
            if end == 0 or end % chunk_tokens or end > last:
                continue
            if end != last and end % self.checkpoint_tokens:
                continue
            index = end // chunk_tokens - 1
            hashes = self.chunk_hashes(state.request, end)
            block_index = end // self.block_size - 1
            if len(hashes) <= index or block_index >= len(state.state_block_ids):
                continue
            block = state.state_block_ids[block_index]
            if block == 0:  # vLLM's null block: no state kept there
                continue
            captures.append(StateCapture(req_id, hashes[index], block))
            state.captured.add(index)
        return captures

    def _follow_computing(self, out: Any) -> None:
        """:func:`follow_blocks` for a dense model: only the open requests still computing their
        prompt are followed. One that has computed it keeps the blocks and tokens its commit reads
        (its prompt's chunks' blocks, all allocated by then; its tokens at or past the prompt, which
        only a preemption takes back): it leaves the followed set, and a preemption before its
        commit resets it and follows it again, as following it every step would."""
        computing = self._computing
        if computing:
            follow_blocks(computing, out, self.geometry.attention_group, self.geometry.state_group)
        preempted = out.preempted_req_ids
        if preempted:
            open_ = self._open
            for req_id in preempted:
                state = open_.get(req_id)
                if state is not None and req_id not in computing:
                    state.preempted()
                    computing[req_id] = state
        if computing:
            done = [req_id for req_id, state in computing.items() if state.computed >= state.request.num_prompt_tokens]
            for req_id in done:
                del computing[req_id]

    def _ready_to_commit(self, state: RequestState) -> bool:
        if state.committed or state.computed < state.request.num_prompt_tokens:
            return False
        return not state.load_sent or state.load_report is not None

    def _track(self, req_id: str, state: RequestState) -> None:
        """A request's (new) state, in both maps: ``_open`` keeps the order of ``_requests`` (the
        order in which a step commits its requests), also when a committed request is planned again."""
        again = req_id in self._requests and req_id not in self._open
        self._requests[req_id] = state
        if again:
            self._open = {k: v for k, v in self._requests.items() if not v.committed}
        else:
            self._open[req_id] = state
        if not self._hybrid:
            self._computing[req_id] = state

    def _commit(self, req_id: str, state: RequestState) -> RequestOrders:
        request = state.request
        hashes = state.prompt_hashes
        if hashes is None:
            hashes = self.chunk_hashes(request, request.num_prompt_tokens)
        states = sorted(i for i in state.captured if i < len(hashes)) if self._hybrid else None
        local = state.plan.num_chunks if state.plan is not None else 0
        hints, tenant = self.hints_of(request)
        capped = hints is not None and (hints.pin is not None or hints.retain_s is not None)
        if capped:
            before = self.control.hint_counters()
            refused = (before.pins_refused, before.retains_refused)
        orders = self.control.commit_prefill(hashes, self.clock(), plan=state.plan, failed=state.failed, states=states,
                                             hints=hints, tenant=tenant)
        if capped:
            after = self.control.hint_counters()
            if after.pins_refused > refused[0]:
                self._warn("refused", 1, "pin hint(s) refused (over pin_bytes_per_tenant, over half the SSD tier, or "
                                         "no SSD tier); those prompts are cached as any other")
            if after.retains_refused > refused[1]:
                self._warn("retain_refused", 1, "retain_s hint(s) refused (over retain_bytes_per_tenant, or no SSD tier); "
                                         "those prompts are cached as any other")
        state.plan, state.committed = None, True
        for o in orders:
            if type(o) is StoreOrder or reads_pages(o):  # (a store, the common case, first)
                state.reads_pages = True
                break
        if self.events is not None:  # what the events of the chunks these orders make resident carry
            self.events.remember(request, hashes, orders)
        k = self.blocks_per_chunk
        ids = state.block_ids
        blocks = {h: tuple(ids[j:j + k]) for h, j in zip(hashes, range(0, len(hashes) * k, k))}
        if self.cluster is None:  # no chunk to share (_shares)
            return _make_orders(req_id, tuple(orders), blocks, _NO_SHARE)
        computed = set(hashes[local:]) - set(state.cluster_loaded())
        return _make_orders(req_id, tuple(orders), blocks, self._shares(orders, computed))

    def _shares(self, orders: list[Order], computed: set = frozenset()) -> frozenset:
        """The chunks of ``orders`` to put into the cluster tier (``cluster_admission``): ``all``, the
        ``computed`` ones (their stores put them once landed); ``evicted``, those whose DRAM copy a
        drop of ``orders`` frees (put before the drop)."""
        if self.cluster is None:
            return frozenset()
        if self.settings.cluster_admission == "all":
            return frozenset(computed)
        return frozenset(c for o in orders if isinstance(o, DropOrder) and o.tier is Tier.DRAM for c in o.kv)

    def _drop_plan(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is not None and state.plan is not None and not state.committed:
            self._follow_ups += self.control.release(state.plan, self.clock(), failed=state.failed)
            state.plan = None

    def _merge(self, partial: dict, key: Any, report: LoadReport | CompletionReport) -> Any:
        """Combine the reports of all workers; the combined report once every worker has sent one."""
        if key in partial:
            report = partial.pop(key).merge(report)
        if report.reports >= self.workers:
            return report
        partial[key] = report
        return None


def open_cluster_index(settings: ConnectorSettings, workers: int) -> ClusterIndex | None:
    """The scheduler's cluster lookups when the settings name a master (never blocks long: an
    unreachable master leaves the tier off, reconnecting in the background)."""
    if not settings.cluster:
        return None
    return ClusterIndex(settings.cluster, workers, local_hostname=settings.cluster_host,
                        timeout_s=settings.cluster_lookup_timeout_s)

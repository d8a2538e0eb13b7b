"""The discrete-event replay: a trace's requests through a real :class:`~saria.control.ControlPlane`.

Per request, on the logical clock (seconds):

1. it arrives (``Schedule``: recorded, or a session's successor ``gap`` after its predecessor
   completed) and waits in a FIFO queue for one of ``inflight`` slots;
2. on getting one, ``plan(chunks, now)`` gives its reusable prefix; the plan's load
   (:func:`~saria.replay.timing.transfer_seconds`) waits for the shared GPU ingress (one plan loads
   at a time, FIFO), then prefill computes the tokens not reloaded at ``prefill_tps`` on the GPU
   (one prefill at a time, FIFO, overlapping other requests' loads); with a device profile the
   compute comes from the model's FLOPs instead, and with layer-wise reloads the request's own
   forward overlaps its load layer by layer (:mod:`saria.replay.layerwise`);
3. at the end of prefill (its first token: TTFT = queueing + transfer + prefill)
   ``commit_prefill``; the orders it returns run on their own FIFO lanes (stores and promotions
   GPU->DRAM at ``B_DRAM``, SSD writes at the drives' write bandwidth, of the bytes they put on
   the drives: ``config.ssd_bytes_of``, smaller under ``ssd_dtype="fp8"``) and are completed
   (``complete``) when they end, so DRAM slots held for writes, promotions not yet readable and
   writes not yet persisted are what the control plane really sees at each moment.

Alongside, an unlimited-capacity cache (the set of every chunk committed so far) gives each
request's achievable hits for CHAR: the longest prefix of its chunks already computed when it is
planned (for a hybrid model cut back to a checkpoint boundary, as the planner cuts real plans).

Prewarming (``Policy.prewarm``): each session keeps a :class:`~saria.control.prewarm.GapPredictor`
of its own past idle gaps (observed as its requests arrive: never the recorded gap still to come).
When a request completes and a gap has been observed, a prewarm is due ``prewarm_lead_s`` before
the predicted next arrival (not before the completion): unless the session's next request has
arrived by then, ``prewarm(the completed request's chunks, now, config.prewarm_max_bytes)`` runs
and its order reads SSD on its own FIFO lane at ``config.prewarm_bytes_per_s``, completed when it
ends (the prewarmed copies become readable then). A session's last request is prewarmed after too
(nothing tells the replay that the session ended): what that brings in is wasted. Prewarm reads
are not charged to the plans' ingress: the bandwidth cap is what bounds their interference.

Events at the same moment run completions first, then commits (freeing slots), then arrivals,
then prewarms. Deterministic: same inputs, same result.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Hashable, Sequence

from saria.config import SariaConfig
from saria.control import ControlPlane, Counters, DropOrder, WriteOrder
from saria.control.hints import Hints
from saria.control.prewarm import GapPredictor
from saria.replay.arrivals import Schedule
from saria.replay.labels import EvictionLabels
from saria.replay.layerwise import StepModel, device_profile, exposed_seconds, model_spec
from saria.replay.oracle import TraceFuture
from saria.replay.timing import GB, LOADING_MODES, transfer_seconds
from saria.replay.traces import Trace

__all__ = ["PolicyRun", "ReplayInternalError", "ReplaySettings", "replay"]


class ReplayInternalError(RuntimeError):
    """The control plane raised, or broke an invariant, during a replay: a bug in saria, not bad
    input (the trace and the settings were checked before the replay started). The message names
    the policy and the request; the original exception is the ``__cause__``."""

_COMPLETE, _COMMIT, _ARRIVE, _PREWARM = 0, 1, 2, 3  # same-time order


@dataclass(frozen=True)
class ReplaySettings:
    """How the replay models the server: ``inflight`` requests at once (loading or computing),
    ``prefill_tps`` computed prompt tokens per second, the ``loading`` mode of plans that do not ask
    for serial loading, and the SSD write bandwidth per drive (``None``: the read bandwidth).
    ``truncate_hours`` (the paper truncates at 24 h): requests arriving that long after the first
    one are not replayed (nor the rest of their sessions), and the write budget covers exactly that
    long; ``None``: everything is replayed and the budget covers first arrival to last event.
    ``layerwise``: a request's forward overlaps its reload layer by layer; ``device`` (a
    :data:`saria.replay.layerwise.DEVICES` name, its efficiency replaced by ``device_efficiency``)
    computes prefill from the FLOPs of ``model`` instead of at ``prefill_tps``. Both need ``model``
    (an :class:`~saria.replay.experiment.Experiment` fills it in from its base settings)."""

    inflight: int = 4
    prefill_tps: float = 6500.0
    loading: str = "coordinated"
    disk_write_gbps: float | None = None
    truncate_hours: float | None = None
    layerwise: bool = False
    device: str | None = None
    device_efficiency: float | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.inflight, bool) or not isinstance(self.inflight, int) or self.inflight < 1:
            raise ValueError(f"--inflight must be an integer >= 1, got {self.inflight!r}")
        if not (isinstance(self.prefill_tps, (int, float)) and math.isfinite(self.prefill_tps)
                and self.prefill_tps > 0):
            raise ValueError(f"--prefill-tps must be > 0, got {self.prefill_tps!r}")
        if self.loading not in LOADING_MODES:
            raise ValueError(f"--loading must be one of {', '.join(LOADING_MODES)}, got {self.loading!r}")
        if self.disk_write_gbps is not None and not (math.isfinite(self.disk_write_gbps)
                                                     and self.disk_write_gbps > 0):
            raise ValueError(f"--b-disk-write must be > 0, got {self.disk_write_gbps!r}")
        if self.truncate_hours is not None and not (math.isfinite(self.truncate_hours) and self.truncate_hours > 0):
            raise ValueError(f"--truncate-hours must be > 0, got {self.truncate_hours!r}")
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be True or False, got {self.layerwise!r}")
        self.step_model()  # checks the device, its efficiency and the model

    def step_model(self) -> StepModel:
        """How this replay times a prefill step (:class:`saria.replay.layerwise.StepModel`)."""
        return StepModel(self.prefill_tps, self.layerwise, model_spec(self.model),
                         device_profile(self.device, self.device_efficiency))


@dataclass
class PolicyRun:
    """What one policy's replay produced. Per-request lists are indexed like ``trace.requests``:
    ``arrival_s`` on the replay clock, ``transfer_s`` (NaN for a request that reloaded nothing),
    ``ttft_s`` (arrival to the end of prefill), plan hits and achievable hits in chunks (NaN / 0
    for requests cut by truncation). ``budget_s``: the time the write budget covers; ``truncated``:
    requests not replayed."""

    name: str
    config: SariaConfig
    counters: Counters
    arrival_s: list[float]
    transfer_s: list[float]
    ttft_s: list[float]
    hit_chunks: list[int]
    achievable_chunks: list[int]
    start_s: float
    end_s: float
    budget_s: float
    truncated: int = 0
    governor_history: list[tuple[float, float]] | None = None
    audit: list[str] | None = None
    labels: EvictionLabels | None = None  # replay(..., labels=True): the oracle's label of every DRAM eviction
    hints: dict | None = None  # replay(..., hints=...): what the hints did (saria.control.hints.HintCounters)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def governor_mean_theta(self) -> float | None:
        """The governor's theta_E averaged over time, or None without a governor."""
        history = self.governor_history
        if not history:
            return None
        ends = [t for t, _ in history[1:]] + [self.end_s]
        span = self.end_s - history[0][0]
        if span <= 0:
            return history[-1][1]
        return sum(theta * (end - t) for (t, theta), end in zip(history, ends)) / span


def replay(name: str, trace: Trace, chunks: Sequence[tuple[Hashable, ...]], schedule: Schedule,
           config: SariaConfig, settings: ReplaySettings = ReplaySettings(),
           progress: Callable[[int], None] | None = None, audit: bool = False, audit_every: int = 0,
           labels: bool = False, hints: Sequence[Hints | None] | None = None) -> PolicyRun:
    """Replay ``trace`` (``chunks[i]``: request i's chunk hashes) on ``schedule`` through a fresh
    control plane built from ``config``. ``progress(n)`` is called as requests complete; ``audit``
    checks the control plane's invariants at the end (``PolicyRun.audit``, O(chunks));
    ``audit_every`` > 0 checks them after every that many committed requests too, and a violation
    then stops the replay. An exception of the control plane, or a violation found by
    ``audit_every``, raises :class:`ReplayInternalError` naming the policy and the request.
    ``labels``: label every DRAM eviction of a kv object with what the oracle would do
    (:mod:`saria.replay.labels`, ``PolicyRun.labels``), for training the ``learned`` rule.
    ``hints``: per request, the cache hints an application sends with it (:mod:`saria.replay.hints`
    derives them from a trace): passed at its commit, ``next_turn_s`` prewarms issued when due
    (``PolicyRun.hints``: what they did); None: none, the replay as before."""
    oracle = config.policy.admission == "oracle"
    future = TraceFuture(chunks, schedule) if oracle or labels else None
    labeler = EvictionLabels(future, config.ssd_kv_bytes) if labels else None
    cp = ControlPlane(config, future=future if oracle else None, observer=labeler)
    current = [-1]  # the request being handled, for an internal error's message
    try:
        if hints is not None and len(hints) != len(trace.requests):
            raise ValueError(f"hints: one per request ({len(trace.requests)}), got {len(hints)}")
        run = _replay(cp, name, trace, chunks, schedule, config, settings, progress, audit, audit_every, current,
                      future, hints)
        run.labels = labeler
        if hints is not None:
            run.hints = asdict(cp.hint_counters())
        return run
    except ReplayInternalError:
        raise
    except Exception as exc:
        where = f"request {current[0]}" if current[0] >= 0 else "a completion"
        raise ReplayInternalError(f"internal error in the control plane at {where} (policy {name!r}): "
                                  f"{type(exc).__name__}: {exc}. This is a bug in saria; please report it "
                                  f"with the traceback") from exc


def _replay(cp: ControlPlane, name: str, trace: Trace, chunks: Sequence[tuple[Hashable, ...]], schedule: Schedule,
            config: SariaConfig, settings: ReplaySettings, progress: Callable[[int], None] | None, audit: bool,
            audit_every: int, current: list[int], future: TraceFuture | None = None,
            hints: Sequence[Hints | None] | None = None) -> PolicyRun:
    plan_request, commit, complete = cp.plan, cp.commit_prefill, cp.complete
    requests = trace.requests
    sessions = schedule.sessions
    n = len(requests)
    bw = config.bandwidth
    mode = settings.loading
    tps = settings.prefill_tps
    step = settings.step_model()
    timed = step.layerwise or step.device is not None  # else today's arithmetic, exactly
    state_bytes = config.chunk.state_bytes
    offload_rate = bw.dram_gbps * GB
    write_rate = (settings.disk_write_gbps or bw.disk_gbps_per_drive) * bw.drives * GB
    every = config.chunk.checkpoint_chunks if config.chunk.hybrid else 1

    arrival = [math.nan] * n
    transfer = [math.nan] * n
    ttft = [math.nan] * n
    hits = [0] * n
    achievable = [0] * n
    seen: set = set()  # the unlimited-capacity cache: every chunk committed so far

    events: list[tuple] = []
    seq = 0
    for index, session in enumerate(sessions):
        events.append((session.start_s, _ARRIVE, seq, index, 0))
        seq += 1
    heapq.heapify(events)
    push, pop = heapq.heappush, heapq.heappop
    start = min((s.start_s for s in sessions), default=0.0)
    horizon = math.inf if settings.truncate_hours is None else start + settings.truncate_hours * 3600.0
    truncated = 0
    waiting: deque = deque()
    free = settings.inflight
    ingress_free = compute_free = offload_free = write_free = prewarm_free = -math.inf
    policy = config.policy
    prewarming = policy.prewarm and config.dram_bytes > 0 and config.ssd_bytes > 0
    prewarm_rate = config.prewarm_bytes_per_s
    ssd_bytes_of = config.ssd_bytes_of
    prewarm_cap = config.prewarm_max_bytes
    lead = policy.prewarm_lead_s
    predictors = [GapPredictor() for _ in sessions] if prewarming else []
    arrived_upto = [0] * len(sessions)  # per session: the position of its latest arrived request
    prewarm_orders: set[int] = set()  # in flight; prewarms and their completions do not extend the replay
    done = 0
    now = last = start

    while events:
        now, kind, _, a, b = pop(events)
        if kind == _COMPLETE:
            current[0] = -1
            complete(a, True, now)  # returns only drops: nothing to schedule
            if a in prewarm_orders:
                prewarm_orders.discard(a)
            else:
                last = now
            continue
        if kind != _PREWARM:
            last = now
        if kind == _COMMIT:
            request_index, plan = a
            current[0] = request_index
            keys = chunks[request_index]
            hint = hints[request_index] if hints is not None else None
            orders = commit(keys, now, plan=plan) if hint is None else commit(keys, now, plan=plan, hints=hint)
            if hint is not None and hint.next_turn_s is not None and now < horizon:
                cp.turn_ended(keys, now, hint)  # the replay's request ends at its commit
                due = cp.next_hinted_prewarm()
                if due is not None:
                    push(events, (due, _PREWARM, seq, -1, 0))  # a = -1: the hinted prewarms due then
                    seq += 1
            for order in orders:
                kind_ = type(order)
                if kind_ is DropOrder:
                    continue
                if kind_ is WriteOrder:  # the SSD bytes it writes (ssd_dtype), not the cache's
                    write_free = max(now, write_free) + ssd_bytes_of(len(order.kv), len(order.state)) / write_rate
                    end = write_free
                else:  # StoreOrder, PromoteOrder: GPU -> DRAM
                    offload_free = max(now, offload_free) + order.nbytes / offload_rate
                    end = offload_free
                push(events, (end, _COMPLETE, seq, order.order_id, None))
                seq += 1
            seen.update(keys)
            free += 1
            session_index, position = b
            session = sessions[session_index]
            if prewarming:
                predictor = predictors[session_index]
                predictor.completed(now)
                at = predictor.prewarm_at(lead)
                if at is not None:
                    push(events, (at, _PREWARM, seq, session_index, position + 1))
                    seq += 1
            if position + 1 < len(session.requests):
                push(events, (now + session.gaps_s[position], _ARRIVE, seq, session_index, position + 1))
                seq += 1
            done += 1
            if progress is not None and not done & 255:
                progress(256)
            if audit_every and not done % audit_every:
                problems = cp.audit()
                if problems:
                    raise ReplayInternalError(f"control-plane audit failed after request {request_index} (policy "
                                              f"{name!r}, {done} committed): {'; '.join(problems[:3])}. This is a "
                                              f"bug in saria; please report it")
        elif kind == _PREWARM and a < 0:  # next_turn_s hints (saria.control.hints)
            if now < horizon:
                current[0] = -1
                for order in cp.hinted_prewarms(now, prewarm_cap):
                    if type(order) is DropOrder:
                        continue
                    read = ssd_bytes_of(len(order.kv), len(order.state))
                    prewarm_free = max(now, prewarm_free) + read / prewarm_rate
                    prewarm_orders.add(order.order_id)
                    push(events, (prewarm_free, _COMPLETE, seq, order.order_id, None))
                    seq += 1
        elif kind == _PREWARM:
            if arrived_upto[a] < b and now < horizon:  # else the turn came first, or the replay is over
                current[0] = -1
                for order in cp.prewarm(chunks[sessions[a].requests[b - 1]], now, prewarm_cap):
                    if type(order) is DropOrder:
                        continue
                    read = ssd_bytes_of(len(order.kv), len(order.state))  # SSD bytes, as it reads them
                    prewarm_free = max(now, prewarm_free) + read / prewarm_rate
                    prewarm_orders.add(order.order_id)
                    push(events, (prewarm_free, _COMPLETE, seq, order.order_id, None))
                    seq += 1
        else:
            if b:
                arrived_upto[a] = b
                if prewarming:
                    predictors[a].arrived(now)
            if now >= horizon:  # an arrival past the truncation: it and the rest of its session are cut
                cut = len(sessions[a].requests) - b
                truncated += cut
                if progress is not None:
                    progress(cut)
            else:
                waiting.append((now, a, b))
        while free and waiting:
            arrived, session_index, position = waiting.popleft()
            free -= 1
            request_index = sessions[session_index].requests[position]
            current[0] = request_index
            arrival[request_index] = arrived
            keys = chunks[request_index]
            plan = plan_request(keys, now)
            if future is not None:
                future.planned(request_index)
            # Achievable with unlimited capacity: the committed prefix (the seen set is prefix-closed).
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if keys[mid - 1] in seen:
                    lo = mid
                else:
                    hi = mid - 1
            achievable[request_index] = lo - lo % every
            hits[request_index] = plan.num_chunks
            if timed:
                compute_s = step.compute_seconds(requests[request_index].input_tokens - plan.tokens, plan.tokens)
                if plan.num_chunks:
                    seconds = transfer_seconds(plan.dram_bytes, plan.ssd_bytes, bw, "serial" if plan.serial else mode)
                    start_load = max(now, ingress_free)
                    ingress_free = start_load + seconds
                    transfer[request_index] = seconds
                    compute_free = step.end(start_load, compute_free, seconds,
                                            exposed_seconds(plan, state_bytes, bw, seconds), compute_s)
                else:
                    compute_free = max(now, compute_free) + compute_s
            else:
                if plan.num_chunks:
                    seconds = transfer_seconds(plan.dram_bytes, plan.ssd_bytes, bw, "serial" if plan.serial else mode)
                    loaded = max(now, ingress_free) + seconds
                    ingress_free = loaded
                    transfer[request_index] = seconds
                else:
                    loaded = now
                compute_free = max(loaded, compute_free) + max(0, requests[request_index].input_tokens - plan.tokens) / tps
            ttft[request_index] = compute_free - arrived
            push(events, (compute_free, _COMMIT, seq, (request_index, plan), (session_index, position)))
            seq += 1
    if progress is not None and done & 255:
        progress(done & 255)
    governor = cp.governor
    budget_s = last - start if settings.truncate_hours is None else settings.truncate_hours * 3600.0
    return PolicyRun(name, config, cp.counters(), arrival, transfer, ttft, hits, achievable, start, last, budget_s,
                     truncated, None if governor is None else list(governor.history), cp.audit() if audit else None)

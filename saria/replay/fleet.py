"""Fleet replay: one trace over N replicas behind a router, with an optional shared cluster tier.

Each replica is the server of :mod:`saria.replay.replay` (its own :class:`~saria.control.ControlPlane`
with DRAM and SSD tiers under the chosen policy, its own ``inflight`` slots, ingress, prefill,
store and SSD-write lanes); the replicas share one logical clock, the trace's arrival schedule and,
when ``cluster_bytes`` > 0, one :class:`~saria.replay.cluster_tier.ClusterTier` (a Mooncake Store
pool: an LRU by bytes that evicts the oldest chunks silently).

* **Routing.** Every arrival (a session's first request at its start, a successor its gap after its
  predecessor's first token, as in the single-server replay) is routed on arrival: ``random``
  draws a replica per request from ``random.Random(seed)``; ``session`` sends every request of a
  session to one replica, a fixed hash of the session's index and the seed (sticky routing; with
  recorded arrivals every request is its own session, so this is a hash per request);
  ``least-loaded`` picks the replica with the fewest prompt tokens routed to it and not yet
  through prefill (its outstanding work; ties to the one with the fewest requests routed so far,
  then the lowest index, so an idle fleet is filled round-robin). The replicas split the trace's
  load: N replicas serve the same sessions as one server would.
* **A request on replica r.** ``plan`` gives the longest prefix the local tiers hold. The chunks
  after it that the cluster holds contiguously (for a hybrid model, up to a checkpoint) are
  *cluster hits*: read (their recency refreshed) when the request is planned, loaded after the
  local plan on the same ingress at ``min(cluster_gbps, B_GPU)``, so the transfer is
  ``transfer_seconds(D, S) + C / r_cluster``. The local control plane then commits them as computed
  chunks (stored into DRAM and admitted to SSD by the same rules); the rest is prefilled. With
  layer-wise reloads (``ReplaySettings.layerwise``) the request's forward overlaps the local plan's
  DRAM part layer by layer (:mod:`saria.replay.layerwise`); cluster gets land whole in host memory
  before their layers' hops, so, like SSD reads, they are not hidden.
* **Cluster admission.** ``evicted``: a chunk whose DRAM copy a replica drops (the DRAM
  :class:`~saria.control.DropOrder`\\ s of its commits and completions: evictions, promotions'
  room) is put; ``all``: every chunk a replica computes is put at its commit; ``shared``: a chunk
  is put at the commit of a request of the second session (or later) that references it, however
  that request got it. A put is skipped when the pool holds the chunk or a put of it is under way
  (an existence check, as a Mooncake client makes); it runs on the replica's own FIFO put lane at
  ``cluster_gbps`` and the chunk is in the pool (LRU newest) when the put ends.

The control plane is used through its public calls only. Events at one moment run completions,
then cluster puts, commits, arrivals. Deterministic: same inputs and seed, same result. With
``replicas=1`` and no cluster tier this is :func:`saria.replay.replay.replay` exactly.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from saria.config import SariaConfig
from saria.control import ControlPlane, Counters, DropOrder, WriteOrder
from saria.orders import DRAM
from saria.replay.arrivals import Schedule
from saria.replay.cluster_tier import ClusterTier
from saria.replay.layerwise import exposed_seconds
from saria.replay.replay import ReplayInternalError, ReplaySettings
from saria.replay.timing import GB, transfer_seconds
from saria.replay.traces import Trace

__all__ = ["CLUSTER_ADMISSIONS", "FleetRun", "FleetSettings", "MAX_REPLICAS", "ROUTERS", "check_fleet_config",
           "replay_fleet",
           "route_session"]

ROUTERS = ("random", "session", "least-loaded")
CLUSTER_ADMISSIONS = ("evicted", "all", "shared")
MAX_REPLICAS = 4096
_COMPLETE, _PUT, _COMMIT, _ARRIVE = 0, 1, 2, 3  # same-time order
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class FleetSettings:
    """The fleet: ``replicas`` servers behind ``router`` (seeded by ``seed``), and a cluster tier of
    ``cluster_bytes`` (0: none) read and written at ``cluster_gbps`` GB/s per replica, admitting
    chunks by ``cluster_admission``."""

    replicas: int = 1
    router: str = "session"
    cluster_bytes: int = 0
    cluster_gbps: float = 25.0
    cluster_admission: str = "all"
    seed: int = 0

    def __post_init__(self) -> None:
        if (isinstance(self.replicas, bool) or not isinstance(self.replicas, int)
                or not 1 <= self.replicas <= MAX_REPLICAS):
            raise ValueError(f"--replicas must be an integer from 1 to {MAX_REPLICAS}, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if isinstance(self.cluster_bytes, bool) or not isinstance(self.cluster_bytes, int) or self.cluster_bytes < 0:
            raise ValueError(f"--cluster-gb must be >= 0, got {self.cluster_bytes!r} bytes")
        if not (isinstance(self.cluster_gbps, (int, float)) and math.isfinite(self.cluster_gbps)
                and self.cluster_gbps > 0):
            raise ValueError(f"--cluster-gbps must be > 0, got {self.cluster_gbps!r}")
        if self.cluster_admission not in CLUSTER_ADMISSIONS:
            raise ValueError(f"--cluster-admission must be one of {', '.join(CLUSTER_ADMISSIONS)}, "
                             f"got {self.cluster_admission!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {self.seed!r}")

    @property
    def label(self) -> str:
        """``N x router``, and the cluster tier when there is one."""
        cluster = (f", cluster {self.cluster_bytes / GB:g} GB {self.cluster_admission}" if self.cluster_bytes
                   else ", no cluster")
        return f"{self.replicas} x {self.router}{cluster}"


@dataclass
class FleetRun:
    """What one fleet replay produced. Per-request lists are indexed like ``trace.requests``
    (NaN / 0 / -1 for requests cut by truncation): ``replica`` the request went to, ``arrival_s``,
    ``transfer_s`` (local and cluster loads; NaN when nothing was loaded), ``ttft_s``, local plan
    hits, cluster hits and achievable hits (unlimited capacity, fleet-wide) in chunks. Per replica:
    its control plane's ``counters``, ``busy_s`` (seconds of prefill computed). ``cluster``: the
    pool's counters (None without a cluster tier)."""

    name: str
    config: SariaConfig
    fleet: FleetSettings
    counters: list[Counters]
    busy_s: list[float]
    replica: list[int]
    arrival_s: list[float]
    transfer_s: list[float]
    ttft_s: list[float]
    hit_chunks: list[int]
    cluster_chunks: list[int]
    achievable_chunks: list[int]
    start_s: float
    end_s: float
    truncated: int = 0
    cluster: dict | None = None
    audit: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def check_fleet_config(config: SariaConfig) -> None:
    """Refuse, with one line, a policy the fleet replay does not model: the oracle admission (it
    knows one server's future) and prewarming (per-session gap predictions on one server)."""
    name = config.policy.name
    if config.policy.admission == "oracle":
        raise ValueError(f"--policy {name}: the oracle admission knows one server's future; it is not defined "
                         f"in a fleet replay (--replicas > 1 or --cluster-gb > 0)")
    if config.policy.prewarm:
        raise ValueError(f"--policy {name}: prewarming is not modelled in a fleet replay (--replicas > 1 or "
                         f"--cluster-gb > 0); use prewarm=false")


def route_session(session: int, seed: int, replicas: int) -> int:
    """The ``session`` router's replica for a session index: splitmix64 of (index, seed), mod N."""
    z = (session * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9 + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % replicas


class _Replica:
    """One server's control plane, slots, lanes and outstanding work."""

    __slots__ = ("index", "cp", "waiting", "free", "ingress", "compute", "offload", "write", "put", "outstanding", "routed", "busy")

    def __init__(self, index: int, config: SariaConfig, inflight: int) -> None:
        self.index = index
        self.cp = ControlPlane(config)
        self.waiting: deque = deque()
        self.free = inflight
        self.ingress = self.compute = self.offload = self.write = self.put = -math.inf
        self.outstanding = 0  # prompt tokens routed here and not through prefill yet
        self.routed = 0  # requests routed here
        self.busy = 0.0


def replay_fleet(name: str, trace: Trace, chunks: Sequence[tuple[Hashable, ...]], schedule: Schedule,
                 config: SariaConfig, fleet: FleetSettings, settings: ReplaySettings = ReplaySettings(),
                 audit: bool = False) -> FleetRun:
    """Replay ``trace`` (``chunks[i]``: request i's chunk hashes) on ``schedule`` over the fleet
    (see the module docstring). ``audit`` checks every control plane at the end (``FleetRun.audit``,
    prefixed by the replica). An exception of a control plane raises :class:`ReplayInternalError`."""
    check_fleet_config(config)
    engine = _Fleet(name, trace, chunks, schedule, config, fleet, settings)
    try:
        engine.run()
    except ReplayInternalError:
        raise
    except Exception as exc:
        where = f"request {engine.current}" if engine.current >= 0 else "a completion"
        raise ReplayInternalError(f"internal error in the control plane at {where} (policy {name!r}, fleet "
                                  f"{fleet.label}): {type(exc).__name__}: {exc}. This is a bug in saria; please "
                                  f"report it with the traceback") from exc
    return engine.result(audit)


class _Fleet:
    """The event loop of :func:`replay_fleet`."""

    def __init__(self, name: str, trace: Trace, chunks: Sequence[tuple[Hashable, ...]], schedule: Schedule,
                 config: SariaConfig, fleet: FleetSettings, settings: ReplaySettings) -> None:
        self.name, self.trace, self.chunks, self.schedule = name, trace, chunks, schedule
        self.config, self.fleet, self.settings = config, fleet, settings
        self.replicas = [_Replica(i, config, settings.inflight) for i in range(fleet.replicas)]
        self.cluster = ClusterTier(fleet.cluster_bytes) if fleet.cluster_bytes else None
        chunk = config.chunk
        self.every = chunk.checkpoint_chunks if chunk.hybrid else 1
        self.kv_bytes, self.state_bytes = chunk.kv_bytes, chunk.state_bytes
        self.depth: dict[Hashable, int] = {}  # hybrid only: a chunk's index in its sequence
        bw = config.bandwidth
        self.cluster_rate = min(fleet.cluster_gbps, bw.gpu_gbps) * GB
        self.put_rate = fleet.cluster_gbps * GB
        self.offload_rate = bw.dram_gbps * GB
        self.write_rate = (settings.disk_write_gbps or bw.disk_gbps_per_drive) * bw.drives * GB
        self.rng = random.Random(fleet.seed)
        self.step = settings.step_model()
        n = len(trace.requests)
        self.replica_of = [-1] * n
        self.arrival = [math.nan] * n
        self.transfer = [math.nan] * n
        self.ttft = [math.nan] * n
        self.hits = [0] * n
        self.cluster_hits = [0] * n
        self.achievable = [0] * n
        self.seen: set = set()  # the unlimited-capacity cache: every chunk committed so far, fleet-wide
        self.first_session: dict[Hashable, int] = {}  # shared admission: the first session to reference
        self.pending: set = set()  # chunks on a put lane
        self.events: list[tuple] = []
        self.seq = 0
        self.current = -1
        self.truncated = 0
        sessions = schedule.sessions
        self.start = min((s.start_s for s in sessions), default=0.0)
        self.horizon = (math.inf if settings.truncate_hours is None
                        else self.start + settings.truncate_hours * 3600.0)
        self.last = self.start

    def _push(self, at: float, kind: int, a, b) -> None:
        heapq.heappush(self.events, (at, kind, self.seq, a, b))
        self.seq += 1

    def _size(self, key: Hashable) -> int:
        if self.every == 1:
            return self.kv_bytes
        return self.kv_bytes + (self.state_bytes if (self.depth[key] + 1) % self.every == 0 else 0)

    def _put(self, replica: _Replica, keys, now: float) -> None:
        """Put ``keys`` from ``replica`` to the cluster (those not held nor on their way)."""
        cluster, pending = self.cluster, self.pending
        batch = [(key, self._size(key)) for key in keys if key not in cluster and key not in pending]
        if not batch:
            return
        pending.update(key for key, _ in batch)
        replica.put = max(now, replica.put) + sum(size for _, size in batch) / self.put_rate
        self._push(replica.put, _PUT, tuple(batch), None)

    def _orders(self, replica: _Replica, orders, now: float) -> None:
        """Schedule a commit's orders on the replica's lanes; DRAM drops feed ``evicted`` admission."""
        evicted = self.cluster is not None and self.fleet.cluster_admission == "evicted"
        for order in orders:
            kind = type(order)
            if kind is DropOrder:
                if evicted and order.tier is DRAM and order.kv:
                    self._put(replica, order.kv, now)
                continue
            if kind is WriteOrder:
                nbytes = self.config.ssd_bytes_of(len(order.kv), len(order.state))
                replica.write = end = max(now, replica.write) + nbytes / self.write_rate
            else:  # StoreOrder, PromoteOrder: GPU -> DRAM
                replica.offload = end = max(now, replica.offload) + order.nbytes / self.offload_rate
            self._push(end, _COMPLETE, (replica, order.order_id), None)

    def _route(self, session_index: int) -> _Replica:
        replicas, fleet = self.replicas, self.fleet
        if len(replicas) == 1:
            return replicas[0]
        if fleet.router == "random":
            return replicas[self.rng.randrange(len(replicas))]
        if fleet.router == "session":
            return replicas[route_session(session_index, fleet.seed, len(replicas))]
        return min(replicas, key=lambda r: (r.outstanding, r.routed))  # min() keeps the first of equals

    def run(self) -> None:
        sessions, events, pop = self.schedule.sessions, self.events, heapq.heappop
        for index, session in enumerate(sessions):
            events.append((session.start_s, _ARRIVE, self.seq, index, 0))
            self.seq += 1
        heapq.heapify(events)
        while events:
            now, kind, _, a, b = pop(events)
            if kind == _COMPLETE:
                replica, order_id = a
                self.current = -1
                drops = replica.cp.complete(order_id, True, now)
                if drops and self.cluster is not None and self.fleet.cluster_admission == "evicted":
                    self._orders(replica, drops, now)
                self.last = now
                continue
            if kind == _PUT:
                for key, size in a:
                    self.pending.discard(key)
                    self.cluster.put(key, size)
                continue
            self.last = now
            if kind == _COMMIT:
                replica = self._commit(now, a, b)
            else:
                requests = sessions[a].requests
                if now >= self.horizon:  # past the truncation: it and the rest of its session are cut
                    self.truncated += len(requests) - b
                    continue
                replica = self._route(a)
                replica.routed += 1
                replica.outstanding += self.trace.requests[requests[b]].input_tokens
                replica.waiting.append((now, a, b, replica))
            while replica.free and replica.waiting:
                self._start(now, *replica.waiting.popleft())

    def _start(self, now: float, arrived: float, session_index: int, position: int, replica: _Replica) -> None:
        replica.free -= 1
        index = self.schedule.sessions[session_index].requests[position]
        self.current = index
        self.replica_of[index] = replica.index
        self.arrival[index] = arrived
        keys = self.chunks[index]
        plan = replica.cp.plan(keys, now)
        seen = self.seen
        lo, hi = 0, len(keys)  # achievable: the committed prefix (the seen set is prefix-closed)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if keys[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        self.achievable[index] = lo - lo % self.every
        local = plan.num_chunks
        self.hits[index] = local
        bw = self.config.bandwidth
        seconds = (transfer_seconds(plan.dram_bytes, plan.ssd_bytes, bw,
                                    "serial" if plan.serial else self.settings.loading) if local else 0.0)
        exposed = exposed_seconds(plan, self.state_bytes, bw, seconds) if local else 0.0
        remote = 0
        if self.cluster is not None:
            remote = self.cluster.prefix(keys, local, step=self.every)
            if remote:
                cluster_s = self.cluster.get(keys[local:local + remote]) / self.cluster_rate
                seconds += cluster_s
                exposed += cluster_s
        self.cluster_hits[index] = remote
        step = self.step
        reused = plan.tokens + remote * self.config.chunk.chunk_tokens
        if step.layerwise or step.device is not None:
            computed = step.compute_seconds(self.trace.requests[index].input_tokens - reused, reused)
            if local or remote:
                start = max(now, replica.ingress)
                replica.ingress = start + seconds
                self.transfer[index] = seconds
                replica.compute = step.end(start, replica.compute, seconds, min(exposed, seconds), computed)
            else:
                replica.compute = max(now, replica.compute) + computed
        else:  # today's arithmetic, exactly
            if local or remote:
                replica.ingress = loaded = max(now, replica.ingress) + seconds
                self.transfer[index] = seconds
            else:
                loaded = now
            computed = max(0, self.trace.requests[index].input_tokens - reused) / self.settings.prefill_tps
            replica.compute = max(loaded, replica.compute) + computed
        replica.busy += computed
        self.ttft[index] = replica.compute - arrived
        self._push(replica.compute, _COMMIT, (index, plan, replica), (session_index, position))

    def _commit(self, now: float, a, b) -> _Replica:
        index, plan, replica = a
        session_index, position = b
        self.current = index
        keys = self.chunks[index]
        self._orders(replica, replica.cp.commit_prefill(keys, now, plan=plan), now)
        if self.every > 1:
            for depth, key in enumerate(keys):
                self.depth.setdefault(key, depth)
        self.seen.update(keys)
        replica.free += 1
        replica.outstanding -= self.trace.requests[index].input_tokens
        if self.cluster is not None:
            admission = self.fleet.cluster_admission
            if admission == "all":
                self._put(replica, keys[plan.num_chunks + self.cluster_hits[index]:], now)
            elif admission == "shared":
                first = self.first_session
                self._put(replica, [k for k in keys if first.setdefault(k, session_index) != session_index], now)
        session = self.schedule.sessions[session_index]
        if position + 1 < len(session.requests):
            self._push(now + session.gaps_s[position], _ARRIVE, session_index, position + 1)
        return replica

    def result(self, audit: bool) -> FleetRun:
        problems = []
        if audit:
            for i, replica in enumerate(self.replicas):
                problems += [f"replica {i}: {p}" for p in replica.cp.audit()]
        return FleetRun(self.name, self.config, self.fleet, [r.cp.counters() for r in self.replicas],
                        [r.busy for r in self.replicas], self.replica_of, self.arrival, self.transfer, self.ttft,
                        self.hits, self.cluster_hits, self.achievable, self.start, self.last, self.truncated,
                        None if self.cluster is None else self.cluster.counters(), problems)

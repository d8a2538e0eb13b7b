"""saria's counters in vLLM's metrics: connector stats (logged by vLLM) and Prometheus ``/metrics``.

vLLM 0.32 collects a connector's counters in two places and merges them every step:

* each worker's :meth:`SariaConnector.get_kv_connector_stats` (the data plane's per-step delta,
  :meth:`~saria.integrations.vllm.worker.SariaWorker.stats_delta`), summed over the ranks;
* the scheduler's, called after the step's output (the control plane's delta,
  ``SchedulerGuard.totals()``), added to the workers'.

The merged :class:`SariaStats` goes with the scheduler's stats to the front end, where vLLM's
``KVConnectorLogging`` sums them over its log interval and logs one ``KV Transfer metrics: ...``
line, and :class:`SariaPromMetrics` (built by ``SariaConnector.build_prom_metrics``) adds them to
Prometheus counters served at ``/metrics``. The counters (:data:`METRICS`), all Prometheus
counters with vLLM's labels ``model_name`` and ``engine`` (exposed with ``_total`` appended, as
vLLM's own counters):

=============================================  ===================================================
counter                                        what it counts
=============================================  ===================================================
``vllm:saria_requests``                        requests saria's control plane looked up
``vllm:saria_hit_tokens{tier}``                prompt tokens loaded from saria's tier (``dram``,
                                               ``ssd``, ``cluster``) into vLLM's blocks instead of
                                               computed
``vllm:saria_cluster_chunks_missed``           cluster chunks a lookup found that did not arrive
                                               (evicted, timed out, ...; vLLM recomputed them)
``vllm:saria_cluster_puts{result}``            objects put into the cluster tier (``ok``,
                                               ``failed``), summed over the worker ranks
``vllm:saria_loads``, ``..._loads_failed``     loads sent to the workers; of those, failed (vLLM
                                               recomputed their tokens)
``vllm:saria_admissions{reason}``              chunks admitted to SSD (``eviction``: E_b >= theta_E,
                                               ``reuse``: R_b >= theta_R, ``prewrite``)
``vllm:saria_ssd_writes``,                     SSD writes completed and their bytes (one shard's
``vllm:saria_ssd_bytes_written``               bytes per object, as the control plane counts them)
``vllm:saria_promotions``                      SSD-hit chunks promoted to DRAM (Eqs. 2-3)
``vllm:saria_transfer_bytes{path}``,           bytes moved and seconds spent per data-plane path
``vllm:saria_transfer_seconds{path}``          (``dram_to_gpu``, ``ssd_to_gpu``, ``gpu_to_dram``,
                                               ``to_ssd``), summed over the worker ranks
``vllm:saria_failures{kind}``                  data-plane failures: ``load``, ``store`` (GPU to
                                               DRAM), ``ssd_write``; each a miss, never an error
``vllm:saria_faults{half}``                    faults caught by saria's fault barrier in the
                                               ``scheduler`` or ``worker`` half
``vllm:saria_drops{tier}``                     objects dropped from a tier by the data plane
``vllm:saria_host_pool_full``                  stores refused for want of a free DRAM slot
``vllm:saria_auth_failures{tier}``             sealed parts (``secret_file``) whose AES-GCM tag
                                               failed in the ``ssd`` or ``cluster`` tier: planted,
                                               moved, flipped, truncated or another key file's
                                               bytes; each a miss, never served
``vllm:saria_unknown_epoch{tier}``             sealed parts of a key epoch the key file no longer
                                               holds (retired): each a miss
``vllm:saria_hinted_admissions``               objects written to SSD at their DRAM eviction for a
                                               ``retain_s`` or ``pin`` cache hint that admission
                                               (Eq. 1) would not have written (docs/vllm.md,
                                               "Cache hints")
``vllm:saria_pinned_bytes`` (a gauge)          SSD bytes the ``pin`` hints of every tenant hold now
``vllm:saria_pins_refused``                    ``pin`` hints refused: over ``pin_bytes_per_tenant``
                                               or half the SSD tier, or no SSD tier
``vllm:saria_retains_refused``                 ``retain_s`` hints refused: over
                                               ``retain_bytes_per_tenant``, or no SSD tier
``vllm:saria_hinted_prewarms``                 prewarm orders (SSD to DRAM) issued for
                                               ``next_turn_s`` hints
``vllm:saria_sessions_done``                   ``done`` hints applied
``vllm:saria_hints_malformed``                 malformed or unknown hint keys ignored (never a
                                               failed request)
=============================================  ===================================================

Every metric is a counter except ``vllm:saria_pinned_bytes``, a gauge (:data:`GAUGES`: its
stats carry the change of the value, which the gauge adds). No label value carries anything of a request: labels are the fixed names above (tiers, paths,
reasons) and vLLM's ``model_name`` and ``engine``.

Names begin with ``vllm:`` as vLLM's own: vLLM unregisters every ``vllm:`` collector when it
builds its Prometheus logger again, so these are rebuilt with it instead of colliding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .compat import KVConnectorPromMetrics, KVConnectorStats

# The worker's stats_delta keys that would collide with the scheduler's (or mean something else
# summed over ranks) are renamed before the two halves' stats are merged.
WORKER_RENAMES = {"loads": "rank_loads", "load_objects": "rank_load_objects", "faults": "worker_faults"}


@dataclass(frozen=True)
class Metric:
    name: str  # the Prometheus counter's name
    documentation: str
    label: str | None  # the label that tells the keys apart, if more than one key feeds it
    keys: Mapping[str, str | None]  # stats key -> label value


METRICS: tuple[Metric, ...] = (
    Metric("vllm:saria_requests", "Requests saria's control plane looked up.", None, {"requests": None}),
    Metric("vllm:saria_hit_tokens", "Prompt tokens loaded from saria's tier into vLLM's KV blocks instead of "
           "computed, by tier (dram, ssd, cluster).", "tier",
           {"hit_tokens_dram": "dram", "hit_tokens_ssd": "ssd", "hit_tokens_cluster": "cluster"}),
    Metric("vllm:saria_cluster_chunks_missed", "Cluster chunks a lookup found that did not arrive (evicted, timed "
           "out, ...; vLLM recomputed them).", None, {"cluster_chunks_missed": None}),
    Metric("vllm:saria_cluster_puts", "Objects put into saria's cluster tier, by result, summed over worker ranks.",
           "result", {"cluster_shared": "ok", "cluster_share_failed": "failed"}),
    Metric("vllm:saria_loads", "Loads saria sent to the workers.", None, {"loads": None}),
    Metric("vllm:saria_loads_failed", "Loads that failed (vLLM recomputed their tokens).", None,
           {"loads_failed": None}),
    Metric("vllm:saria_admissions", "Chunks admitted to saria's SSD tier, by reason (eviction: E_b >= theta_E, "
           "reuse: R_b >= theta_R, prewrite).", "reason",
           {"admissions_eviction": "eviction", "admissions_reuse": "reuse", "admissions_prewrite": "prewrite"}),
    Metric("vllm:saria_ssd_writes", "Writes to saria's SSD tier completed.", None, {"ssd_writes": None}),
    Metric("vllm:saria_ssd_bytes_written", "Bytes of the writes to saria's SSD tier completed, as stored (one "
           "rank's shard per object; under ssd_dtype=fp8 a kv object's FP8 form).", None, {"ssd_bytes_written": None}),
    Metric("vllm:saria_promotions", "SSD-hit chunks promoted to saria's DRAM tier.", None, {"promotions": None}),
    Metric("vllm:saria_transfer_bytes", "Bytes moved by saria's data plane, by path, summed over worker ranks "
           "(SSD paths: as stored, an FP8 form's under ssd_dtype=fp8).",
           "path", {"dram_to_gpu_bytes": "dram_to_gpu", "ssd_to_gpu_bytes": "ssd_to_gpu",
                    "gpu_to_dram_bytes": "gpu_to_dram", "ssd_write_bytes": "to_ssd"}),
    Metric("vllm:saria_transfer_seconds", "Seconds saria's data plane spent moving bytes, by path, summed over "
           "worker ranks.", "path", {"dram_to_gpu_seconds": "dram_to_gpu", "ssd_to_gpu_seconds": "ssd_to_gpu",
                                     "gpu_to_dram_seconds": "gpu_to_dram"}),
    Metric("vllm:saria_failures", "saria data-plane failures by kind (each a cache miss, never a failed request).",
           "kind", {"load_failures": "load", "store_failures": "store", "ssd_write_failures": "ssd_write"}),
    Metric("vllm:saria_faults", "Faults caught by saria's fault barrier, by half (scheduler, worker).", "half",
           {"scheduler_faults": "scheduler", "worker_faults": "worker"}),
    Metric("vllm:saria_drops", "Objects dropped from a saria tier by the data plane, by tier.", "tier",
           {"dram_drops": "dram", "ssd_drops": "ssd"}),
    Metric("vllm:saria_host_pool_full", "Stores refused for want of a free DRAM slot.", None,
           {"host_pool_full": None}),
    Metric("vllm:saria_auth_failures", "Sealed parts whose AES-GCM tag failed (planted, moved, flipped, truncated "
           "or another key file's), by tier (ssd, cluster); each a miss, never served.", "tier",
           {"ssd_auth_failures": "ssd", "cluster_auth_failures": "cluster"}),
    Metric("vllm:saria_unknown_epoch", "Sealed parts of a key epoch the key file does not hold (retired), by tier "
           "(ssd, cluster); each a miss.", "tier", {"ssd_unknown_epoch": "ssd", "cluster_unknown_epoch": "cluster"}),
    Metric("vllm:saria_layerwise_steps", "Steps whose reloads ran layer by layer inside the forward (layerwise), "
           "summed over worker ranks.", None, {"layerwise_steps": None}),
    Metric("vllm:saria_layer_waits", "Attention layers that waited for their reloaded pages in those steps (one "
           "per layer and step when every hook ran), summed over worker ranks.", None, {"layer_waits": None}),
    Metric("vllm:saria_hinted_admissions", "Objects written to saria's SSD tier at their DRAM eviction for a "
           "retain_s or pin cache hint that admission (Eq. 1) would not have written.", None,
           {"hinted_admissions": None}),
    Metric("vllm:saria_pinned_bytes", "SSD bytes held by the pin cache hints of every tenant now.", None,
           {"pinned_bytes": None}),
    Metric("vllm:saria_pins_refused", "Pin cache hints refused (over pin_bytes_per_tenant or half the SSD tier, or "
           "no SSD tier); never an error to the request.", None, {"pins_refused": None}),
    Metric("vllm:saria_retains_refused", "retain_s cache hints refused (over retain_bytes_per_tenant, or no SSD "
           "tier); never an error to the request.", None, {"retains_refused": None}),
    Metric("vllm:saria_hinted_prewarms", "Prewarm orders (SSD to DRAM) issued for next_turn_s cache hints.", None,
           {"prewarms_hinted": None}),
    Metric("vllm:saria_sessions_done", "done cache hints applied (the session's private chunks unwritten, evicted "
           "first).", None, {"sessions_done": None}),
    Metric("vllm:saria_hints_malformed", "Malformed or unknown cache hint keys ignored (never a failed request).",
           None, {"hints_malformed": None}),
    Metric("vllm:saria_layerwise_missed_steps", "Steps whose forward skipped some layer's wait: their reloaded "
           "blocks were recomputed (a full CUDA graph?).", None, {"layerwise_missed_steps": None}),
)

SEAL_COUNTERS = ("auth_failures", "unknown_epoch")
# stats keys whose totals are values now, not counts: a delta may be negative, a gauge adds it
GAUGES = frozenset({"pinned_bytes"})
_GAUGE_METRICS = frozenset({"vllm:saria_pinned_bytes"})


def seal_counters(tier: str, counters: Mapping[str, Any] | None) -> dict[str, int]:
    """``{tier}_auth_failures`` and ``{tier}_unknown_epoch`` from a store's counters (an SSD store's
    snapshot, a cluster store's), 0 where the store has none (unsealed, or closed)."""
    counters = counters or {}
    return {f"{tier}_{name}": int(counters.get(name, 0) or 0) for name in SEAL_COUNTERS}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SariaStats(KVConnectorStats):
    """saria's counters for one interval, as vLLM's connector stats: a flat ``{key: number}`` of
    deltas (the scheduler half's and every worker rank's, :data:`METRICS` names the keys). Merging
    adds them up."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if _number(value):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's counters for vLLM's log line: nonzero ones, seconds rounded to ms."""
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Deltas:
    """Per-interval deltas of cumulative counters: ``take(totals)`` returns what grew since the
    last call. A counter found smaller than before was reset (a new source): its value is the delta.
    A gauge's (:data:`GAUGES`) delta is its change, negative when it fell."""

    def __init__(self) -> None:
        self._seen: dict[str, int | float] = {}

    def take(self, totals: Mapping[str, Any]) -> dict[str, int | float]:
        out = {}
        for key, value in totals.items():
            if not _number(value):
                continue
            before = self._seen.get(key, 0)
            delta = value - before if value >= before or key in GAUGES else value
            self._seen[key] = value
            if delta:
                out[key] = delta
        return out


def worker_totals(snapshot: Mapping[str, Any], faults: int) -> dict[str, int | float]:
    """A worker rank's cumulative counters for vLLM's connector stats, from its snapshot
    (``SariaWorker.snapshot``): the engine's transfer counters (bytes and seconds per path,
    failures), the cluster tier's puts, the sealed parts each store refused (:func:`seal_counters`)
    and ``faults``."""
    totals = dict(snapshot.get("engine", {}), faults=faults)
    layerwise = snapshot.get("layerwise")
    if layerwise:
        totals.update(layerwise_missed_steps=layerwise["missed_steps"], layerwise_whole_loads=layerwise["whole_loads"])
    totals.update(seal_counters("ssd", snapshot.get("ssd")))
    cluster = snapshot.get("cluster")
    if cluster:
        totals.update(cluster_shared=cluster["shared"], cluster_share_failed=cluster["share_failed"])
        totals.update(seal_counters("cluster", cluster.get("store")))
    return {k: v for k, v in totals.items() if _number(v)}


def worker_stats(delta: Mapping[str, Any]) -> dict[str, int | float]:
    """The worker's ``stats_delta`` under the keys :class:`SariaStats` uses (:data:`WORKER_RENAMES`)."""
    return {WORKER_RENAMES.get(k, k): v for k, v in delta.items() if _number(v) and v}


class SariaPromMetrics(KVConnectorPromMetrics):
    """saria's Prometheus counters (:data:`METRICS`), one child per engine, fed by vLLM with each
    interval's :class:`SariaStats` data. Keys it does not know (a newer worker's) are skipped:
    they still appear in vLLM's log line."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # (engine index, stats key) -> the counter child with its labels bound
        self._children: dict[tuple[int, str], Any] = {}
        self._levels: dict[tuple[int, str], int | float] = {}  # gauges: the value so far
        for metric in METRICS:
            names = list(labelnames) + ([metric.label] if metric.label else [])
            if metric.name in _GAUGE_METRICS:
                counter = self._gauge_cls(name=metric.name, documentation=metric.documentation, labelnames=names,
                                          multiprocess_mode="livesum")
            else:
                counter = self._counter_cls(name=metric.name, documentation=metric.documentation, labelnames=names)
            for engine, values in per_engine_labelvalues.items():
                for key, label in metric.keys.items():
                    extra = [label] if metric.label else []
                    self._children[(engine, key)] = counter.labels(*(list(values) + extra))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in (transfer_stats_data or {}).items():
            child = self._children.get((engine_idx, key))
            if child is None or not _number(value):
                continue
            if key in GAUGES:  # the change of a value: kept here and set (Ray's gauges can only be set)
                if value:
                    level = self._levels[(engine_idx, key)] = self._levels.get((engine_idx, key), 0) + value
                    child.set(max(0, level))
            elif value > 0:
                child.inc(value)

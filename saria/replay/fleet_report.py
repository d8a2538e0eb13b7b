"""Fleet replays in parallel, and their result records and table (``saria replay --replicas N``).

:func:`run_fleets` replays several (policy, fleet) jobs of one trace and schedule in separate
processes (forked on Linux; results in job order, independent of ``workers``).
:func:`summarize_fleet` is one run's record (keys :data:`FLEET_KEYS`):

* ``referenced_chunks`` (every chunk of every replayed request), hits by tier, in chunks and tokens (``dram_``, ``ssd_``, ``cluster_hit_chunks`` / ``_tokens``:
  a chunk counts where the request read it; the local tiers' hits are the control planes' counters
  summed, cluster hits the chunks loaded from the pool), ``hit_ratio`` (all tiers over every chunk
  referenced) and ``char_mean`` (hits of every tier over the hits an unlimited fleet-wide cache
  would give, as :func:`saria.replay.metrics.char`);
* bytes moved: ``dram_read_bytes`` and ``ssd_read_bytes`` (plans' reads), ``ssd_write_bytes``,
  ``store_bytes`` (GPU -> DRAM), ``cluster_put_bytes`` / ``cluster_get_bytes`` /
  ``cluster_evicted_bytes`` (0 without a cluster tier);
* the TTFT model (mean, P50, P90 in ms; every replayed request) and the mean transfer;
* load balance: requests per replica (min, max) and max over mean of requests and of prefill
  seconds per replica (1.0 is perfectly balanced).
"""

from __future__ import annotations

import math
import multiprocessing as mp
from dataclasses import dataclass
from typing import Hashable, Sequence

from saria.config import SariaConfig
from saria.replay.arrivals import Schedule
from saria.replay.fleet import FleetRun, FleetSettings, replay_fleet
from saria.replay.layerwise import LAYERWISE_SUFFIX
from saria.replay.metrics import char, percentile
from saria.replay.replay import ReplaySettings
from saria.replay.runner import default_workers
from saria.replay.timing import GB
from saria.replay.traces import Trace

__all__ = ["FLEET_KEYS", "FleetJob", "format_fleet_table", "run_fleets", "summarize_fleet"]

FLEET_KEYS = ("policy", "replicas", "router", "cluster_gb", "cluster_gbps", "cluster_admission", "requests",
              "referenced_chunks", "dram_hit_chunks", "dram_hit_tokens", "ssd_hit_chunks", "ssd_hit_tokens", "cluster_hit_chunks",
              "cluster_hit_tokens", "hit_ratio", "char_mean", "dram_read_bytes", "ssd_read_bytes",
              "ssd_write_bytes", "store_bytes", "cluster_put_bytes", "cluster_get_bytes", "cluster_evicted_bytes",
              "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "transfer_ms_mean", "requests_per_replica_min",
              "requests_per_replica_max", "request_imbalance", "prefill_imbalance")


@dataclass(frozen=True)
class FleetJob:
    """One fleet replay: a label, the replicas' config, the fleet, and its replay settings (None:
    those :func:`run_fleets` is given)."""

    name: str
    config: SariaConfig
    fleet: FleetSettings
    settings: ReplaySettings | None = None


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else math.nan


def summarize_fleet(run: FleetRun) -> dict:
    """The result record of one fleet replay (keys :data:`FLEET_KEYS`, in that order)."""
    tokens = run.config.chunk.chunk_tokens
    counters = run.counters
    dram = sum(c.hits_dram_chunks for c in counters)
    ssd = sum(c.hits_ssd_chunks for c in counters)
    remote = sum(run.cluster_chunks)
    references = sum(c.references for c in counters)
    ttfts = [t * 1e3 for t in run.ttft_s if not math.isnan(t)]
    transfers = [t * 1e3 for t in run.transfer_s if not math.isnan(t)]
    served = [i for i, r in enumerate(run.replica) if r >= 0]
    per_replica = [0] * run.fleet.replicas
    for i in served:
        per_replica[run.replica[i]] += 1
    char_mean, _ = char([run.hit_chunks[i] + run.cluster_chunks[i] for i in served],
                        [run.achievable_chunks[i] for i in served])
    cluster = run.cluster or {}
    result = {
        "policy": run.name, "replicas": run.fleet.replicas, "router": run.fleet.router,
        "cluster_gb": run.fleet.cluster_bytes / GB, "cluster_gbps": run.fleet.cluster_gbps,
        "cluster_admission": run.fleet.cluster_admission if run.fleet.cluster_bytes else None,
        "requests": len(served), "referenced_chunks": references,
        "dram_hit_chunks": dram, "dram_hit_tokens": dram * tokens, "ssd_hit_chunks": ssd, "ssd_hit_tokens": ssd * tokens,
        "cluster_hit_chunks": remote, "cluster_hit_tokens": remote * tokens,
        "hit_ratio": (dram + ssd + remote) / references if references else 0.0, "char_mean": char_mean,
        "dram_read_bytes": sum(c.hits_dram_bytes for c in counters),
        "ssd_read_bytes": sum(c.ssd_bytes_read for c in counters),
        "ssd_write_bytes": sum(c.ssd_bytes_written for c in counters),
        "store_bytes": sum(c.store_bytes for c in counters),
        "cluster_put_bytes": cluster.get("put_bytes", 0), "cluster_get_bytes": cluster.get("get_bytes", 0),
        "cluster_evicted_bytes": cluster.get("evicted_bytes", 0),
        "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else math.nan, "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p90": percentile(ttfts, 90),
        "transfer_ms_mean": sum(transfers) / len(transfers) if transfers else math.nan,
        "requests_per_replica_min": min(per_replica), "requests_per_replica_max": max(per_replica),
        "request_imbalance": _imbalance(per_replica), "prefill_imbalance": _imbalance(run.busy_s),
    }
    assert tuple(result) == FLEET_KEYS
    return result


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_fleet_table(rows: Sequence[dict], *, trace: bool = False) -> str:
    """A plain-text table of fleet result records (one line each; ``trace``: a first column naming
    each row's ``trace``)."""
    width = 19 if any(row["policy"].endswith(LAYERWISE_SUFFIX) for row in rows) else 16  # room for "+lw"
    head = (f"{'trace':<24} " if trace else "") + (
        f"{'policy':<{width}} {'N':>3} {'router':<12} {'cluster':>13} {'DRAM hit':>9} {'SSD hit':>8} {'clu hit':>8} "
        f"{'CHAR':>6} {'TTFT ms mean':>12} {'p50':>8} {'p90':>9} {'SSD writes (GiB)':>16} {'put GiB':>8} "
        f"{'get GiB':>8} {'req max/mean':>12}")
    lines = [head]
    for row in rows:
        cluster = f"{row['cluster_gb']:.4g}GB {row['cluster_admission']}" if row["cluster_gb"] else "none"
        refs = row["referenced_chunks"]
        share = (lambda n: _fmt(n / refs, ".1%")) if refs else (lambda n: "-")
        lines.append((f"{row['trace'][:24]:<24} " if trace else "") + (
            f"{row['policy'][:width]:<{width}} {row['replicas']:>3} {row['router']:<12} {cluster:>13} "
            f"{share(row['dram_hit_chunks']):>9} {share(row['ssd_hit_chunks']):>8} "
            f"{share(row['cluster_hit_chunks']):>8} {_fmt(row['char_mean'], '.1%'):>6} "
            f"{_fmt(row['ttft_ms_mean'], ',.1f'):>12} {_fmt(row['ttft_ms_p50'], ',.1f'):>8} "
            f"{_fmt(row['ttft_ms_p90'], ',.1f'):>9} {row['ssd_write_bytes'] / 2**30:>16,.1f} "
            f"{row['cluster_put_bytes'] / 2**30:>8,.1f} {row['cluster_get_bytes'] / 2**30:>8,.1f} "
            f"{_fmt(row['request_imbalance'], '.2f'):>12}"))
    return "\n".join(lines)


_STATE: tuple | None = None  # set in each worker (inherited by fork, or passed to the initializer)


def _init(state: tuple) -> None:
    global _STATE
    _STATE = state


def _work(index: int) -> FleetRun:
    trace, chunks, schedule, jobs, settings = _STATE
    job = jobs[index]
    return replay_fleet(job.name, trace, chunks, schedule, job.config, job.fleet, job.settings or settings)


def run_fleets(trace: Trace, chunks: Sequence[tuple[Hashable, ...]], schedule: Schedule, jobs: Sequence[FleetJob],
               settings: ReplaySettings, *, workers: int | None = None) -> list[FleetRun]:
    """Replay every job (in ``workers`` processes, default one per CPU); runs in job order."""
    if not jobs:
        return []
    workers = default_workers(len(jobs)) if workers is None else max(1, min(workers, len(jobs)))
    if workers == 1:
        return [replay_fleet(job.name, trace, chunks, schedule, job.config, job.fleet, job.settings or settings)
                for job in jobs]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init, initargs=((trace, chunks, schedule, tuple(jobs), settings),)) as pool:
        return pool.map(_work, range(len(jobs)), chunksize=1)

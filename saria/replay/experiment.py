"""One trace, one set of shared settings, many replays: what ``saria replay``, ``sweep`` and ``tune`` share.

An :class:`Experiment` holds the parsed trace, its chunk hashes (computed once for the run's chunk
size), the shared :class:`~saria.replay.policies.BaseSettings` and
:class:`~saria.replay.replay.ReplaySettings`, and builds one arrival schedule per session-start
window. :meth:`Experiment.run` replays a list of :class:`Point`\\ s (a policy spec or a ready
config, and a window) in parallel and returns their result records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from saria.config import SariaConfig
from saria.models import get_model
from saria.replay.arrivals import Schedule, make_schedule
from saria.replay.metrics import add_retention, summarize
from saria.replay.policies import BaseSettings, PolicySpec, build_config, parse_policy
from saria.replay.replay import PolicyRun, ReplaySettings
from saria.replay.runner import Job, run_jobs
from saria.replay.synth import parse_synth_spec, synthesize
from saria.replay.traces import Trace, TraceError, chunk_keys, load_trace

__all__ = ["Experiment", "Point", "REFERENCES", "open_trace"]

# The policies every retention is measured between (issue 15): no SSD, and every chunk on SSD.
REFERENCES = ("dram-only", "full-duplicate")


def open_trace(spec: str, *, fmt: str = "auto", block_tokens: int | None = None, time_unit: str = "ms",
               skip_bad_lines: bool = False, check_units: bool = True) -> Trace:
    """A trace file, or ``synth[:key=value,...]`` for the synthetic agent-session generator."""
    if spec == "synth" or spec.startswith("synth:"):
        if Path(spec).exists():
            raise TraceError(f"{spec!r} is both a file and a synthetic trace spec; pass ./{spec} for the file")
        trace = synthesize(parse_synth_spec(spec))
        if block_tokens is not None and block_tokens != trace.block_tokens:
            raise TraceError(f"the synthetic trace's blocks are {trace.block_tokens} tokens "
                             f"(set synth:block_tokens=N), not --block-tokens {block_tokens}")
        return trace
    return load_trace(spec, block_tokens=block_tokens, time_unit=time_unit, fmt=fmt, skip_bad_lines=skip_bad_lines,
                      check_units=check_units)


@dataclass(frozen=True)
class Point:
    """One replay of an experiment: ``policy`` (a spec, or a ready config) in the session-start
    window ``window_hours`` (None: the experiment's default), reported as ``label``."""

    label: str
    policy: PolicySpec | SariaConfig
    window_hours: float | None = None
    hint_accuracy: float | None = None  # replayed with an application's hints of this accuracy (saria.replay.hints)
    hint_kind: str = "trace"  # which hints (saria.replay.hints.HINT_SOURCES)


class Experiment:
    def __init__(self, trace: Trace, trace_name: str, base: BaseSettings, settings: ReplaySettings, *,
                 arrivals: str = "auto", window_hours: float = 12.0, seed: int = 0, workers: int | None = None,
                 progress: bool = True) -> None:
        self.trace = trace
        self.trace_name = trace_name
        self.base = base
        if settings.model is None:  # the step model's FLOPs and layers are the base's model's
            settings = replace(settings, model=base.model)
        elif settings.model != base.model:
            raise ValueError(f"the replay settings' model {settings.model!r} is not the base settings' "
                             f"{base.model!r}")
        self.settings = settings
        self.arrivals = arrivals
        self.window_hours = window_hours
        self.seed = seed
        self.workers = workers
        self.progress = progress
        # replay every point but the references with an application's hints of this accuracy
        # (saria.replay.hints; sweep and tune --hints); None: points say for themselves (Point.hint_accuracy)
        self.hint_accuracy: float | None = None
        self.hint_kind = "trace"  # with hint_accuracy: which hints (saria.replay.hints.HINT_SOURCES)
        chunk = base.chunk()
        if chunk.chunk_tokens % trace.block_tokens:
            raise TraceError(f"--chunk-tokens {chunk.chunk_tokens} is not a multiple of the trace's "
                             f"{trace.block_tokens}-token blocks")
        self.chunk_tokens = chunk.chunk_tokens
        self.chunks = [chunk_keys(r, trace.block_tokens, chunk.chunk_tokens) for r in trace.requests]
        self._schedules: dict[float | None, Schedule] = {}
        self.schedule(None)  # validate the arrival settings now

    def _key(self, window_hours: float | None) -> float | None:
        """Which schedule a window means: None for recorded arrivals, else the window in hours."""
        if self.mode == "recorded":
            return None
        return self.window_hours if window_hours is None else window_hours

    def schedule(self, window_hours: float | None) -> Schedule:
        """The arrival schedule for a session-start window (None: the experiment's)."""
        key = self._key(window_hours)
        if key not in self._schedules:
            self._schedules[key] = make_schedule(self.trace, self.arrivals, window_hours=key or self.window_hours,
                                                 seed=self.seed)
        return self._schedules[key]

    @property
    def mode(self) -> str:
        if self.arrivals == "auto":
            return "rewindow" if self.trace.has_sessions else "recorded"
        return self.arrivals

    def config_for(self, policy: PolicySpec | SariaConfig) -> SariaConfig:
        return policy if isinstance(policy, SariaConfig) else build_config(policy, self.base)

    def run_points(self, points: list[Point], desc: str = "replay") -> list[PolicyRun]:
        """Replay every point (in parallel processes); runs in point order."""
        if self.mode == "recorded" and any(p.window_hours is not None for p in points):
            raise ValueError("session-start windows need re-windowed arrivals (--arrivals rewindow)")
        keys: list[float | None] = []
        jobs = []
        for point in points:
            key = self._key(point.window_hours)
            self.schedule(point.window_hours)
            if key not in keys:
                keys.append(key)
            config = self.config_for(point.policy)
            accuracy, kind = point.hint_accuracy, point.hint_kind
            if accuracy is None and config.policy.name not in REFERENCES and point.label not in REFERENCES:
                accuracy, kind = self.hint_accuracy, self.hint_kind  # a reference is replayed without
            jobs.append(Job(point.label, config, keys.index(key), accuracy, self.seed, kind))
        schedules = [self._schedules[k] for k in keys]
        return run_jobs(self.trace, self.chunks, schedules, jobs, self.settings, workers=self.workers,
                        progress=self.progress, desc=desc)

    def run(self, points: list[Point], desc: str = "replay", references: bool = True
            ) -> tuple[list[dict], list[PolicyRun]]:
        """Replay every point; their result records (``saria replay --json``'s) and runs. With
        ``references``, each record's ``retention`` is against ``dram-only`` and ``full-duplicate``
        replayed in the same window: the points labelled exactly so, or extra replays of them (not
        returned); without, it is NaN."""
        if not references:
            runs = self.run_points(points, desc)
            return [summarize(run) for run in runs], runs
        keys = [self._key(point.window_hours) for point in points]
        extra: list[Point] = []
        found: dict = {}  # (window key, preset) -> index into points + extra
        for index, (point, key) in enumerate(zip(points, keys)):
            if point.label in REFERENCES:
                found.setdefault((key, point.label), index)
        for key, point in dict(zip(keys, points)).items():
            for name in REFERENCES:
                if (key, name) not in found:
                    found[(key, name)] = len(points) + len(extra)
                    extra.append(Point(f"{name} (reference)", parse_policy(name), point.window_hours))
        runs = self.run_points(points + extra, desc)
        results = [summarize(run) for run in runs]
        for index, key in enumerate(keys):
            add_retention([results[index]], results[found[(key, "dram-only")]],
                          results[found[(key, "full-duplicate")]])
        return results[:len(points)], runs[:len(points)]

    def _device_dict(self) -> dict | None:
        """The device profile prefill is computed on (None: at ``prefill_tps``)."""
        device = self.settings.step_model().device
        if device is None:
            return None
        return {"name": device.name, "peak_tflops": device.tflops, "efficiency": device.efficiency,
                "source": device.source}

    def config_dict(self, runs: list[PolicyRun]) -> dict:
        """What a report's ``config`` says: trace, model, capacities, time model, arrivals, budget,
        and per policy its settings, replayed duration and governor trajectory."""
        base, chunk, trace = self.base, self.base.chunk(), self.trace
        schedule = self.schedule(None)
        model = get_model(base.model)
        sample = runs[0].config if runs else SariaConfig(chunk=chunk)
        policies = {}
        for run in runs:
            policy = asdict(run.config.policy)
            policy.pop("name")
            entry = {"policy": policy, "replayed_seconds": run.duration_s, "budget_seconds": run.budget_s,
                     "write_budget_bytes": run.config.write_budget_bytes_per_s * run.budget_s,
                     "truncated_requests": run.truncated, "governor": run.config.write_budget.auto}
            if run.governor_history is not None:
                thetas = [theta for _, theta in run.governor_history]
                entry["governor_theta_E"] = {"first": thetas[0], "last": thetas[-1], "min": min(thetas),
                                             "max": max(thetas), "mean": run.governor_mean_theta,
                                             "changes": len(thetas) - 1}
            policies[run.name] = entry
        return {
            "trace": {"format": trace.fmt, "requests": len(trace.requests), "block_tokens": trace.block_tokens,
                      "chunk_references": sum(len(c) for c in self.chunks), "recorded_span_s": trace.span_s,
                      "skipped_lines": len(trace.skipped)},
            "model": {"name": model.name, "kv_bytes_per_token": model.kv_bytes_per_token,
                      "state_bytes": model.state_bytes, "source": model.source},
            "chunk_tokens": chunk.chunk_tokens, "checkpoint_tokens": chunk.checkpoint_tokens if chunk.hybrid else None,
            "dram_tokens": base.dram_tokens, "ssd_tokens": base.ssd_tokens,
            "dram_bytes": sample.dram.in_bytes(chunk.kv_bytes_per_token),
            "ssd_bytes": sample.ssd.in_bytes(chunk.kv_bytes_per_token),
            "ssd_dtype": base.ssd_dtype, "ssd_kv_bytes": chunk.ssd_kv_bytes(base.ssd_dtype),
            "ssd_chunks": sample.ssd.in_bytes(chunk.kv_bytes_per_token) // chunk.ssd_kv_bytes(base.ssd_dtype),
            "bandwidth_gbps": asdict(base.bandwidth), "loading": self.settings.loading,
            "disk_write_gbps_per_drive": self.settings.disk_write_gbps or base.bandwidth.disk_gbps_per_drive,
            "inflight": self.settings.inflight, "prefill_tps": self.settings.prefill_tps,
            "layerwise": self.settings.layerwise, "device": self._device_dict(),
            "truncate_hours": self.settings.truncate_hours,
            "arrivals": {"mode": schedule.mode,
                         "window_hours": self.window_hours if schedule.mode == "rewindow" else None,
                         "sessions": len(schedule.sessions) if schedule.mode == "rewindow" else None,
                         "inferred_sessions": schedule.inferred_sessions, "seed": self.seed},
            "write_budget": {"dwpd": base.write_budget.dwpd,
                             "capacity_bytes": (base.write_budget.capacity_bytes
                                                or sample.ssd.in_bytes(chunk.kv_bytes_per_token)),
                             "auto": base.write_budget.auto},
            "policies": policies,
        }

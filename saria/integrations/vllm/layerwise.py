"""The worker's layer-wise reloads (``layerwise``; docs/vllm.md, "Layer-wise reloads").

With ``layerwise`` the scheduler reports a request's load to vLLM as synchronous, so vLLM schedules
the request in the step that loads it, and the load runs inside that step's forward pass:

* ``start_load_kv`` (before the forward): :meth:`LayerLoads.start` queues every layer of the step's
  loads at once (:meth:`~saria.dataplane.transfer.engine.TransferEngine.load_layers`); a load's
  cluster chunks, if any, are fetched whole (:class:`~.cluster_loads.ClusterLoad`) and land before
  the first layer reads its pages.
* ``wait_for_layer_load(layer)`` (vLLM's attention op, on entry): :meth:`LayerLoads.wait` makes the
  forward wait for that layer's pages (on CUDA a wait of the compute stream on the layer's event,
  no host block once the layer is queued; on the CPU a host wait).
* after the forward (``get_finished``): :meth:`LayerLoads.end` collects the results, known on the
  host once every copy is issued: it never waits for the device (the forward's stream already
  waits for every layer; the staging the copies read goes back once they ran, on the engine's
  retire thread). A chunk that failed goes back to vLLM as error blocks (with every chunk after
  it), so vLLM discards the step's output for the request and recomputes from there. If any
  layer's wait was never reached in a step that loaded (a forward that skipped the hooks, e.g. a
  full CUDA graph), every block the step loaded is reported in error (vLLM may have read a layer
  before its pages landed), and the caller's stream is made to wait for every copy first, so
  that the recompute's writes come after them.

Loads whose plan cannot go layer by layer (:meth:`~saria.dataplane.transfer.engine.TransferEngine.layerwise_ok`)
load whole in the same step and land before the first layer's wait: the forward's stream waits
for them (``wait_on``), the host only for what is host work (a cluster fetch's network reads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from saria.dataplane.transfer.engine import TransferEngine
from saria.dataplane.transfer.layerwise import StepLoad
from saria.dataplane.transfer.load_job import LoadResult, PlanLoad

from .cluster_loads import CombinedLoad
from .metadata import LoadSpec

log = logging.getLogger("saria.vllm")


@dataclass
class LayerwiseCounters:
    steps: int = 0  # steps that loaded layer by layer
    layer_waits: int = 0  # attention layers' waits reached in those steps
    missed_steps: int = 0  # steps whose forward skipped some layer's wait: their loads reported in error
    whole_loads: int = 0  # loads of such steps that went whole (a GDN state, FP8 SSD objects, ...)


class LayerLoads:
    """One worker's layer-wise reloads, step by step (module docstring).

    ``layer_names``: vLLM's full-attention layers in kv table order; ``tensors_per_layer``: how many
    of the kv table's tensors each of them is (one for vLLM 0.32's ``[num_blocks, ...]`` layers)."""

    def __init__(self, engine: TransferEngine, layer_names: Sequence[str], tensors_per_layer: Sequence[int], *,
                 max_programs: int | None = None):
        if len(layer_names) != len(tensors_per_layer):
            raise ValueError(f"{len(layer_names)} layer names but {len(tensors_per_layer)} tensor counts")
        groups, start = [], 0
        for n in tensors_per_layer:
            groups.append(list(range(start, start + n)))
            start += n
        self.paths = engine.layerwise(groups, max_programs=max_programs)
        self.streams = self.paths.streams
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.counters = LayerwiseCounters()
        self.failures: list[BaseException] = []  # loads that could not start (the worker counts them as faults)
        self._reset()

    def _reset(self) -> None:
        """No step in flight."""
        # this step's loads: (spec, job), the job of a plan of a layer-wise step (step, its position)
        self._loads: list[tuple[LoadSpec, Any]] = []
        self._steps: list[StepLoad] = []
        self._before_first: list[Any] = []  # jobs that land whole before the first layer reads its pages
        self._first_waited = False

    @property
    def capable(self) -> bool:
        """Whether this engine's pages can go layer by layer (never straddle two host slots)."""
        return self.paths.capable

    @property
    def active(self) -> bool:
        """Whether a step's loads are in flight (between :meth:`start` and :meth:`end`)."""
        return bool(self._loads)

    def start(self, engine: TransferEngine, specs: list[LoadSpec], load_whole, cluster_load) -> None:
        """Start the step's loads: layer by layer where the engine can, whole otherwise
        (``load_whole(spec)`` -> a job). ``cluster_load(spec, local)`` starts a spec's cluster
        chunks (``local``: how many of its chunks the plan holds). A spec that cannot be started
        is kept with no job: :meth:`end` reports it failed (nothing of it lands; what of it did
        start is waited for)."""
        layered: list[LoadSpec] = []
        fits = engine.layerwise_ok_all([spec.plan for spec in specs])  # the engine's part once a step
        for spec, ok in zip(specs, fits):
            if ok:
                layered.append(spec)
                continue
            try:
                job = load_whole(spec)
            except Exception as exc:  # the engine started nothing of it
                self._fail(spec, exc)
                continue
            self.counters.whole_loads += 1
            self._before_first.append(job)
            self._loads.append((spec, job))
        jobs = self._start_layers(engine, [s for s in layered if s.plan.num_chunks])
        for spec in layered:
            job = jobs.get(id(spec))
            if isinstance(job, BaseException):  # counted once, by _start_layers
                self._fail(spec, job, count=False)
                continue
            if spec.cluster:
                local = PlanLoad(job[0].job, job[1]) if job is not None else None  # its plan as a job
                try:
                    fetch = cluster_load(spec, spec.plan.num_chunks)
                except Exception as exc:
                    self._fail(spec, exc, local)  # its local part still lands; the load fails whole
                    continue
                self._before_first.append(fetch)
                job = CombinedLoad(local, spec.plan.num_chunks, fetch)
            self._loads.append((spec, job))
        if self._loads:
            self.counters.steps += 1

    def _start_layers(self, engine: TransferEngine, specs: list[LoadSpec]) -> dict[int, Any]:
        """One layer-wise step for ``specs``: ``id(spec)`` -> ``(step, its plan's position)``, or,
        if the engine refused the step (it started nothing of it), the exception for every one of
        them (one fault: vLLM recomputes their blocks)."""
        if not specs:
            return {}
        try:
            step = engine.load_layers([(s.plan, s.kv_blocks[:s.plan.num_chunks], s.skip_pages) for s in specs])
        except Exception as exc:
            self.failures.append(exc)
            return {id(s): exc for s in specs}
        self._steps.append(step)
        return {id(s): (step, i) for i, s in enumerate(specs)}

    def _fail(self, spec: LoadSpec, exc: BaseException, job: Any = None, *, count: bool = True) -> None:
        log.warning("saria: load of request %s not started: %s", spec.req_id, exc)
        if count:
            self.failures.append(exc)
        self._loads.append((spec, _Failed(job)))

    def take_failures(self) -> list[BaseException]:
        """The exceptions that kept loads from starting since the last call (the worker counts them)."""
        failures, self.failures = self.failures, []
        return failures

    def wait(self, layer_name: str) -> None:
        """vLLM's attention layer ``layer_name`` is about to read its pages."""
        if not self._loads:
            return
        layer = self.index.get(layer_name)
        if layer is None:  # not a full-attention layer saria moves
            return
        if not self._first_waited:
            self._first_waited = True
            for job in self._before_first:  # the forward's stream waits for them; the host does not
                job.wait_on(self.streams)
        for step in self._steps:
            step.wait_layer(layer)
        self.counters.layer_waits += 1

    def end(self) -> list[tuple[LoadSpec, LoadResult | Any | None, bool]]:
        """After the step's forward: ``(spec, result, unsure)`` per load (``result`` ``None``: it
        could not start), ``unsure`` when the forward may have read some layer before it landed
        (its blocks must all be recomputed)."""
        if not self._loads:
            return []
        missed = any(not all(step.waited) for step in self._steps) or (bool(self._before_first)
                                                                        and not self._first_waited)
        if missed:  # the recompute of these blocks is queued after every copy that writes them
            for step in self._steps:
                step.wait_all()
            if not self._first_waited:
                self._first_waited = True
                for job in self._before_first:
                    job.wait_on(self.streams)
        ended = {id(step): step.end() for step in self._steps}  # each plan's result, by position
        if missed:
            self.counters.missed_steps += 1
            log.warning("saria: a step's forward did not wait for every layer it reloaded; its reloaded blocks are "
                        "recomputed (a full CUDA graph? layerwise needs piecewise graphs)")
        out = [(spec, ended[id(job[0])][job[1]] if type(job) is tuple else job.outcome(), missed)
               for spec, job in self._loads]
        self._reset()
        return out

    def abandon(self) -> list[LoadSpec]:
        """The data plane is closing: wait for the step's copies (never leave one running into
        memory being freed) and return its specs (the caller fails them)."""
        specs = [spec for spec, _ in self._loads]
        for step in self._steps:
            try:
                step.finish()
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("saria: layer-wise loads at close: %s", exc)
        self._reset()
        return specs


class _Failed:
    """A load that could not start: what of it did start (``job``) lands before its result, ``None``."""

    def __init__(self, job: Any = None):
        self.job = job

    def wait(self) -> None:
        if self.job is not None:
            self.job.wait()
        return None

    def wait_on(self, streams) -> None:
        if self.job is not None:
            self.job.wait_on(streams)

    def outcome(self) -> None:
        if self.job is not None:
            self.job.outcome()
        return None

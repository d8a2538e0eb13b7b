"""What a worker rank's ended reloads tell vLLM and the scheduler (:class:`LoadResults`).

* vLLM (``get_finished`` and the load-error hooks): the requests whose reload ended; of those, the
  requests that failed as a whole (vLLM recomputes them; under a hybrid model every failure is
  one, block ids being per group), and the blocks from the first chunk that did not arrive on
  (vLLM recomputes them).
* The scheduler (``build_connector_worker_meta``): one :class:`~.metadata.LoadReport` per reload,
  the objects that failed (for the control plane) and the cluster chunks missed. A reload failed
  as a whole after a fault reports the SSD copies it was to read: they are not vouched for.

With ``audit_kv`` each chunk that arrived is checked against what vLLM computed
(:class:`~.audit.KVAudit`).
"""

from __future__ import annotations

from saria.dataplane.transfer.engine import LoadResult
from saria.orders import Tier

from .audit import KVAudit
from .metadata import LoadReport, LoadSpec


class LoadResults:
    """The ended reloads of one worker rank, until they are reported (module docstring).
    ``hybrid``: the model has GDN/Mamba groups (block ids are per group)."""

    def __init__(self, hybrid: bool):
        self.hybrid = hybrid
        self.finished: set[str] = set()  # loads ended, for vLLM's next get_finished
        self.failed_requests: set[str] = set()  # of those, failed as a whole
        self.error_blocks: set[int] = set()
        self.reports: list[LoadReport] = []

    def ended(self, spec: LoadSpec, result: LoadResult, audit: KVAudit | None) -> bool:
        """Record a reload's result; whether every chunk of it arrived."""
        req_id = spec.req_id
        self.finished.add(req_id)
        missed = getattr(result, "cluster_failed", 0)
        self.reports.append(LoadReport(req_id, spec.plan.plan_id, result.failed, result.valid_chunks,
                                       cluster_failed=missed))
        if audit is not None:
            for c in range(min(result.valid_chunks, spec.plan.num_chunks)):
                audit.check(spec.plan.chunk_hashes[c], spec.kv_blocks[c], spec.skip_pages if c == 0 else 0,
                            from_ssd=spec.plan.kv_sources[c] is Tier.SSD,
                            served_as=spec.audit_names[c] if spec.audit_names else None)
        if not (result.failed or missed):
            return True
        if self.hybrid:  # block ids are per group: vLLM takes request-level failures
            self.failed_requests.add(req_id)
            return False
        self._error_from(spec, result.valid_chunks)  # from the first chunk that did not arrive: recomputed
        return False

    def ended_in_step(self, spec: LoadSpec, result: LoadResult | None, audit: KVAudit | None, unsure: bool) -> None:
        """Record a layer-wise reload (``spec.layerwise``: vLLM heard it as synchronous and ran the
        request in the same step). It is never reported finished; what did not arrive goes back as
        error blocks, so vLLM drops the step's output for the request and recomputes from there.
        ``result`` ``None``: it could not start (reported as a fault's load); ``unsure``: the
        forward may have read a layer before it landed, so every block it loaded is in error."""
        if result is not None and not unsure and audit is None and not result.failed \
                and not getattr(result, "cluster_failed", 0):  # the common case: all arrived, nothing to check
            req_id = spec.req_id
            self.reports.append(LoadReport(req_id, spec.plan.plan_id, (), result.valid_chunks))
            self.finished.discard(req_id)
            self.failed_requests.discard(req_id)
            return
        if result is None:
            self.fail_load(spec)
            self.finished.discard(spec.req_id)
            self.failed_requests.discard(spec.req_id)
            self._error_from(spec, 0)
            return
        if unsure:
            missed = getattr(result, "cluster_failed", 0)
            self.reports.append(LoadReport(spec.req_id, spec.plan.plan_id, result.failed, result.valid_chunks,
                                           cluster_failed=missed))
            self._error_from(spec, 0)
            return
        if not self.ended(spec, result, audit):
            self._error_from(spec, result.valid_chunks)
        self.finished.discard(spec.req_id)
        self.failed_requests.discard(spec.req_id)

    def _error_from(self, spec: LoadSpec, chunk: int) -> None:
        """Every block of ``spec`` from chunk ``chunk`` on (the first chunk's own leading pages aside)."""
        for c in range(chunk, len(spec.kv_blocks)):
            skip = spec.skip_pages if c == 0 else 0
            self.error_blocks.update(spec.kv_blocks[c][skip:])

    def fail_request(self, req_id: str) -> None:
        """vLLM hears that the request's load ended and failed: it recomputes the whole request."""
        self.finished.add(req_id)
        self.failed_requests.add(req_id)

    def fail_load(self, spec: LoadSpec) -> None:
        """Fail a load as a whole after a fault: the control plane drops the SSD copies it was to
        read (they are not vouched for); its DRAM copies are not to blame."""
        self.fail_request(spec.req_id)
        plan = spec.plan
        self.reports.append(LoadReport(spec.req_id, plan.plan_id, tuple(plan.keys_from(Tier.SSD)), 0,
                                       cluster_failed=len(spec.cluster)))

    def take_finished(self) -> set[str]:
        done, self.finished = self.finished, set()
        return done

    def take_error_blocks(self) -> set[int]:
        blocks, self.error_blocks = self.error_blocks, set()
        return blocks

    def take_failed_requests(self) -> set[str]:
        failed, self.failed_requests = self.failed_requests, set()
        return failed

    def take_reports(self) -> list[LoadReport]:
        reports, self.reports = self.reports, []
        return reports

"""``SariaConnector``: saria as a vLLM v1 KV connector.

    from vllm import LLM
    llm = LLM(model=..., kv_transfer_config={
        "kv_connector": "SariaConnector",
        "kv_connector_module_path": "saria.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"dram_gb": 64, "ssd_paths": ["/mnt/nvme0/saria"], "ssd_gb": 1500},
    })

vLLM builds one instance per role: in the scheduler process the control plane
(:class:`~saria.integrations.vllm.scheduler.SariaScheduler`), in each worker the data plane
(:class:`~saria.integrations.vllm.worker.SariaWorker`). They share only the per-step metadata.
Options: :mod:`saria.integrations.vllm.settings`.

No exception of saria's reaches vLLM through these hooks: the scheduler half runs behind
:class:`~saria.integrations.vllm.guard.SchedulerGuard`, the worker half's hooks are fail-safe
themselves; both count faults (:mod:`saria.integrations.vllm.faults`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from saria.dataplane.cluster.index import ClusterIndex

from .compat import (CacheHitSource, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorPromMetrics,
                     KVConnectorRole, KVConnectorStats, KVConnectorTransferResults, KVConnectorWorkerMetadata,
                     SupportsHMA, check_version, has_drafter_layers, uses_ubatching)
from .events import KVEvents, events_enabled
from .geometry import engine_geometry
from .guard import SchedulerGuard
from .layout import ParallelLayout, model_identity
from .logs import route_to_vllm
from .metrics import Deltas, SariaPromMetrics, SariaStats, worker_stats
from .resets import WeightsGeneration, reset_scheduler
from .scheduler import SariaScheduler, open_cluster_index
from .sealing import ChunkNames, announce, load_keyring, seal_scope
from .settings import LAYERWISE_DEFAULT, ConnectorSettings
from .worker import SariaWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger("saria.vllm")
route_to_vllm()  # saria's log lines through vLLM's handlers (scheduler and worker processes import this)

__all__ = ["SariaConnector", "SariaStats"]  # SariaStats lives in .metrics, still importable from here


def decide_layerwise(settings: ConnectorSettings, vllm_config: Any, hybrid: bool) -> bool:
    """Whether this engine's reloads and saves go layer by layer (:meth:`ConnectorSettings.layerwise_for`),
    with one warning where a speculative drafter or vLLM's micro-batching turns it off."""
    drafter = has_drafter_layers(vllm_config)
    ubatching = uses_ubatching(vllm_config)
    device_type = vllm_config.device_config.device_type
    layerwise = settings.layerwise_for(device_type, hybrid, drafter, ubatching)
    if drafter and settings.layerwise:
        log.warning("saria: layerwise is off beside a speculative drafter with attention layers (vLLM runs the "
                    "drafter after collecting the step's transfer results): reloads go whole")
    elif ubatching and settings.layerwise_for(device_type, hybrid, drafter):
        log.warning("saria: layerwise is off under vLLM's micro-batching (enable_dbo / ubatch_size: each layer "
                    "runs once per micro-batch, so a layer's saves and loads would be split): reloads go whole")
    return layerwise


class SariaConnector(KVConnectorBase_V1, SupportsHMA):
    """saria's KV connector (module docstring). Supports vLLM's hybrid allocator (``SupportsHMA``):
    a hybrid (GDN) model's states are saved and restored with its attention pages."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        check_version()  # another vLLM than 0.32 to 0.34: refused here, in one line (compat.py)
        super().__init__(vllm_config, role, kv_cache_config)
        route_to_vllm()  # again: vLLM has configured its logging by now (its level applies)
        self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        # a key file that cannot be used fails the start here, in each process, with its one line
        keyring = load_keyring(self.settings)
        geometry = engine_geometry(kv_cache_config, vllm_config.cache_config)
        model = model_identity(vllm_config)  # once: a rebuilt control plane names chunks alike
        # both halves decide alike: the scheduler reports loads as synchronous, the worker runs them per layer
        layerwise = decide_layerwise(self.settings, vllm_config, geometry.hybrid)
        self._scheduler: SchedulerGuard | None = None
        self._worker: SariaWorker | None = None
        self._cluster: ClusterIndex | None = None
        if role == KVConnectorRole.SCHEDULER:
            # A cache miss must never fail a request: vLLM reads this right after building us.
            self._kv_transfer_config.kv_load_failure_policy = self.settings.on_load_failure
            workers = ParallelLayout.of_server(vllm_config.parallel_config).shards
            chunk_tokens = self.settings.chunk_tokens_for(geometry.block_size, geometry.hybrid)
            scope = seal_scope(model, block_size=geometry.block_size, hash_tokens=geometry.hash_tokens,
                               chunk_tokens=chunk_tokens, kv_bytes_per_token=geometry.kv_bytes_per_token,
                               kv_element_bytes=geometry.kv_element_bytes, state_bytes=geometry.state_bytes)
            announce(self.settings, keyring)
            # vLLM's KV events for saria's tiers, only when vLLM publishes events (else nothing is kept)
            events = (KVEvents(chunk_tokens=chunk_tokens, block_size=geometry.block_size,
                               hash_tokens=geometry.hash_tokens, group=geometry.attention_group,
                               max_chunks=self.settings.kv_events_max_chunks)
                      if events_enabled(vllm_config) else None)
            self._cluster = open_cluster_index(self.settings, workers)  # outlives rebuilt control planes
            self._weights = WeightsGeneration()  # names follow the weights: reset_cache draws a new one (.resets)
            self._scheduler = SchedulerGuard(
                lambda: SariaScheduler(self.settings, geometry, workers=workers,
                                       # every control plane takes over the ranks' SSD objects: the first
                                       # a previous run's, one rebuilt after a fault this run's (after a
                                       # reset the ranks report none: they deleted them)
                                       recover=bool(self.settings.ssd_paths),
                                       cluster=self._cluster,
                                       names=ChunkNames(keyring, scope, self._weights.nonce),
                                       layerwise=layerwise, events=events),
                log_interval_s=self.settings.log_interval_s, events=events)
        else:
            self._worker = SariaWorker(self.settings, geometry, num_blocks=kv_cache_config.num_blocks,
                                       layout=ParallelLayout.of_this_worker(vllm_config.parallel_config),
                                       model=model, keyring=keyring, layerwise=layerwise)
        self._totals = Deltas()  # the scheduler half's counters reported to vLLM so far

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise reloads need vLLM's per-layer hooks, which a FULL CUDA graph replay skips:
        ask for piecewise graphs when ``layerwise`` is on (``auto``: as on CUDA; bad options: the
        connector's own start reports them)."""
        try:
            layerwise = ConnectorSettings.from_extra_config(extra_config).layerwise
        except ValueError:
            return False
        return LAYERWISE_DEFAULT["cuda"] if layerwise is None else layerwise  # CUDA graphs: a GPU

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never an error

    # --- worker side (SariaWorker's hooks never raise) -------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``layerwise``: the forward waits for this layer's reloaded pages (a device-side wait
        on CUDA); otherwise loads are asynchronous and a request is scheduled once its load finished."""
        self._worker.wait_for_layer_load(layer_name)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, before its forward: with ``layerwise`` the worker starts the step's
        stores that go layer by layer."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.before_forward(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """With ``layerwise``: the layer's pages of the step's layer-wise stores start their copy to
        host memory now; otherwise saves run per request in ``wait_for_save``, after the forward."""
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, loaded = self._worker.get_finished(finished_req_ids)
        return sent or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Held requests whose blocks saria no longer reads (``finished_sending``: vLLM frees them)
        and finished loads; a failed load (``failed_recving``: vLLM recomputes the whole request) is
        always also a finished one, as vLLM requires."""
        sent, loaded = self._worker.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=loaded | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_error_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What changed since the last call (:mod:`.metrics`): in a worker its data plane's
        counters (``SariaWorker.stats_delta``), in the scheduler the control plane's
        (``SchedulerGuard.totals``). vLLM adds the two up every step."""
        try:
            if self._worker is not None:
                data = worker_stats(self._worker.stats_delta())
            else:
                data = self._totals.take(self._scheduler.totals())
        except Exception as exc:  # stats are never worth a fault's consequences
            log.warning("saria: connector stats unavailable: %s", exc)
            return None
        stats = SariaStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return SariaStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """saria's Prometheus counters, ``vllm:saria_*`` (:mod:`.metrics`), served at ``/metrics``."""
        return SariaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33+: saria follows sleep mode (``unregister_kv_caches`` / ``restore_kv_caches``,
        and the ``reset_cache`` vLLM makes before it: :mod:`.resets`)."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+, before the KV cache's memory is released: every copy that touches it ends
        first, and none starts until :meth:`restore_kv_caches` (:func:`.resets.suspend`)."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+, once the KV cache's memory is back: page tables rebuilt where it moved."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._cluster is not None:
            self._cluster.close()

    # --- scheduler side (through SchedulerGuard, which never raises) ------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        tiers = {"dram": CacheHitSource.HOST, "ssd": CacheHitSource.DISK,
                 "cluster": CacheHitSource.EXTERNAL_UNSPECIFIED}  # a remote store: vLLM's name for it
        return {tiers[t]: n for t, n in self._scheduler.hit_sources(request, num_external_tokens).items()}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.holds_blocks()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def take_events(self) -> list:
        """vLLM's KV events for saria's DRAM (``CPU``) and SSD (``STORAGE``) tiers, published by
        vLLM's scheduler with its own (:mod:`.events`); none unless vLLM's KV events are enabled."""
        return self._scheduler.take_events() if self._scheduler is not None else []

    def reset_cache(self) -> bool:
        """vLLM resets the connector (``sleep``, ``pause_generation(clear_cache=True)``,
        ``reset_prefix_cache(reset_connector=True)``: the weights may change): nothing cached before
        is ever served again, in any tier (:mod:`.resets`). Always True (never fails vLLM's reset)."""
        if self._scheduler is None:
            return True
        return reset_scheduler(self._scheduler, self._weights)

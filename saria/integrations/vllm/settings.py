"""The connector's options: ``kv_transfer_config["kv_connector_extra_config"]``, validated.

Every key is optional. Unknown keys are an error (a typo must not silently fall back to a default).

============================  ==========================================================================
key                           meaning (default)
============================  ==========================================================================
``policy``                    preset: saria, full-duplicate, dram-only, gds-only, zero-promotion,
                              full-promotion, reuse-only, lmcache-plus (``saria``)
``theta_E``, ``theta_R``,     any :class:`saria.config.Policy` field, overriding the preset
``r``, ``p_tau_s``, ...
``dram_gb`` / ``dram_bytes``  DRAM tier size (8 GiB)
``ssd_paths``                 one directory per NVMe drive; empty: no SSD tier (``[]``)
``ssd_gb`` / ``ssd_bytes``    SSD tier size over all drives (64 GiB when ``ssd_paths`` is set)
``chunk_tokens``              tokens per cached chunk, a multiple of the block size (512; hybrid: one block)
``checkpoint_tokens``         hybrid models: tokens between kept GDN state checkpoints, besides the one at
                              each prompt's last chunk boundary; a multiple of ``chunk_tokens``
                              (16384 rounded to whole chunks: vLLM's hybrid block size depends on
                              the model and the hardware, 256 or 384 tokens on CPUs, for example)
``b_gpu_gbps``,               bandwidth estimates for Eq. 4 pacing and r* (48, 20 per drive, 48)
``b_disk_gbps``,
``b_dram_gbps``
``coordinator``               coordinated, overlap or serial (``coordinated``)
``durable``                   fdatasync SSD writes before they count (``true``)
``log_interval_s``            seconds between one-line summaries in the log; 0 turns them off (60)
``on_load_failure``           ``recompute``: a reload that fails (corrupt SSD object, I/O error)
                              makes vLLM recompute those tokens; ``fail``: the request fails.
                              Sets vLLM's ``kv_load_failure_policy`` (``recompute``)
============================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from saria.config import POLICY_PRESETS, Bandwidths, Capacity, ChunkSpec, Policy, SariaConfig

GiB = 1 << 30
DEFAULT_CHECKPOINT_TOKENS = 16_384
_POLICY_FIELDS = {f.name for f in dataclasses.fields(Policy)} - {"name"}
_KEYS = {"policy", "dram_gb", "dram_bytes", "ssd_paths", "ssd_gb", "ssd_bytes", "chunk_tokens",
         "checkpoint_tokens", "b_gpu_gbps", "b_disk_gbps", "b_dram_gbps", "coordinator", "durable",
         "log_interval_s", "on_load_failure"} | _POLICY_FIELDS


def _size(extra: Mapping[str, Any], name: str, default: int) -> int:
    gb, nbytes = extra.get(f"{name}_gb"), extra.get(f"{name}_bytes")
    if gb is not None and nbytes is not None:
        raise ValueError(f"give {name}_gb or {name}_bytes, not both")
    if nbytes is not None:
        value = nbytes
    elif gb is not None:
        if not isinstance(gb, (int, float)) or gb < 0:
            raise ValueError(f"{name}_gb must be a number >= 0, got {gb!r}")
        value = int(gb * GiB)
    else:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}_bytes must be an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class ConnectorSettings:
    policy: str = "saria"
    policy_overrides: Mapping[str, Any] = field(default_factory=dict)
    dram_bytes: int = 8 * GiB
    ssd_paths: tuple[str, ...] = ()
    ssd_bytes: int = 0
    chunk_tokens: int | None = None
    checkpoint_tokens: int | None = None  # None: DEFAULT_CHECKPOINT_TOKENS rounded to whole chunks
    bandwidth: Bandwidths = Bandwidths()
    coordinator: str = "coordinated"
    durable: bool = True
    log_interval_s: float = 60.0
    on_load_failure: str = "recompute"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ValueError(f"unknown saria connector option(s) {unknown}; known: {sorted(_KEYS)}")
        policy = extra.get("policy", "saria")
        if policy not in POLICY_PRESETS:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICY_PRESETS)}")
        paths = extra.get("ssd_paths", [])
        if isinstance(paths, str) or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"ssd_paths must be a list of directories, got {paths!r}")
        coordinator = extra.get("coordinator", "coordinated")
        if coordinator not in ("coordinated", "overlap", "serial"):
            raise ValueError(f"coordinator must be coordinated, overlap or serial, got {coordinator!r}")
        checkpoint_tokens = extra.get("checkpoint_tokens")
        if checkpoint_tokens is not None and (isinstance(checkpoint_tokens, bool)
                                              or not isinstance(checkpoint_tokens, int) or checkpoint_tokens < 1):
            raise ValueError(f"checkpoint_tokens must be a positive int, got {checkpoint_tokens!r}")
        chunk_tokens = extra.get("chunk_tokens")
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                         or chunk_tokens < 1):
            raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        defaults = Bandwidths()
        bandwidth = Bandwidths(gpu_gbps=float(extra.get("b_gpu_gbps", defaults.gpu_gbps)),
                               disk_gbps_per_drive=float(extra.get("b_disk_gbps", defaults.disk_gbps_per_drive)),
                               drives=max(1, len(paths)),
                               dram_gbps=float(extra.get("b_dram_gbps", defaults.dram_gbps)))
        durable = extra.get("durable", True)
        if not isinstance(durable, bool):
            raise ValueError(f"durable must be true or false, got {durable!r}")
        log_interval = extra.get("log_interval_s", 60.0)
        if not isinstance(log_interval, (int, float)) or log_interval < 0:
            raise ValueError(f"log_interval_s must be a number >= 0, got {log_interval!r}")
        on_load_failure = extra.get("on_load_failure", "recompute")
        if on_load_failure not in ("recompute", "fail"):
            raise ValueError(f"on_load_failure must be recompute or fail, got {on_load_failure!r}")
        overrides = {k: v for k, v in extra.items() if k in _POLICY_FIELDS}
        Policy.preset(policy, **overrides)  # validates the overrides now, with the field's name in the error
        return cls(policy=policy, policy_overrides=overrides, dram_bytes=_size(extra, "dram", 8 * GiB),
                   ssd_paths=tuple(paths), ssd_bytes=_size(extra, "ssd", 64 * GiB if paths else 0),
                   chunk_tokens=chunk_tokens, checkpoint_tokens=checkpoint_tokens,
                   bandwidth=bandwidth, coordinator=coordinator, durable=durable,
                   log_interval_s=float(log_interval), on_load_failure=on_load_failure)

    def chunk_tokens_for(self, block_size: int, hybrid: bool) -> int:
        """Tokens per chunk: the option, else one vLLM block for hybrid models (GDN states exist only
        at block boundaries where a step ended) and 512 tokens (whole blocks) for dense ones."""
        chunk_tokens = self.chunk_tokens or (block_size if hybrid else max(1, round(512 / block_size)) * block_size)
        if chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block size ({block_size})")
        if hybrid:
            self.checkpoint_tokens_for(chunk_tokens)
        return chunk_tokens

    def checkpoint_tokens_for(self, chunk_tokens: int) -> int:
        """Tokens between kept GDN checkpoints: the option, which must be a multiple of
        ``chunk_tokens``, else the default rounded to the nearest whole number of chunks (at least one)."""
        if self.checkpoint_tokens is None:
            return max(1, round(DEFAULT_CHECKPOINT_TOKENS / chunk_tokens)) * chunk_tokens
        if self.checkpoint_tokens % chunk_tokens:
            raise ValueError(f"checkpoint_tokens ({self.checkpoint_tokens}) must be a multiple of chunk_tokens "
                             f"({chunk_tokens})")
        return self.checkpoint_tokens

    def saria_config(self, *, block_size: int, kv_bytes_per_token: int, state_bytes: int = 0) -> SariaConfig:
        """The control plane's configuration for an engine with these page geometries. For hybrid
        models every chunk may carry a state object; which ones exist is decided per request (the
        connector captures states at ``checkpoint_tokens`` multiples and at each prompt's last
        chunk boundary)."""
        chunk_tokens = self.chunk_tokens_for(block_size, bool(state_bytes))
        policy = Policy.preset(self.policy, **self.policy_overrides)
        if not self.ssd_paths and policy.use_ssd:
            policy = dataclasses.replace(policy, use_ssd=False)  # no drives: no SSD tier
        return SariaConfig(dram=Capacity(nbytes=self.dram_bytes), ssd=Capacity(nbytes=self.ssd_bytes),
                           chunk=ChunkSpec(chunk_tokens=chunk_tokens, kv_bytes_per_token=kv_bytes_per_token,
                                           state_bytes=state_bytes,
                                           checkpoint_tokens=chunk_tokens),
                           bandwidth=self.bandwidth, policy=policy, ssd_paths=self.ssd_paths)

"""The connector's options: ``kv_transfer_config["kv_connector_extra_config"]``, validated.

Every key is optional. Unknown keys are an error (a typo must not silently fall back to a default).

============================  ==========================================================================
key                           meaning (default)
============================  ==========================================================================
``policy``                    preset: saria, paper, full-duplicate, dram-only, gds-only, zero-promotion,
                              full-promotion, reuse-only, lmcache-plus (``saria``); not ``oracle``
                              (nor ``admission=oracle``): it needs the future, which only a replay has
``theta_E``, ``theta_R``,     any :class:`saria.config.Policy` field, overriding the preset
``r``, ``p_tau_s``, ...
``dram_gb`` / ``dram_bytes``  DRAM tier size of the server, over all its ranks (8 GiB)
``ssd_paths``                 one directory per NVMe drive; empty: no SSD tier (``[]``). Each
                              worker rank keeps its own store in a subdirectory of every path
                              (:func:`~saria.integrations.vllm.layout.rank_directories`)
``ssd_gb`` / ``ssd_bytes``    SSD tier size of the server over all drives and ranks (64 GiB when
                              ``ssd_paths`` is set)
``ssd_dtype``                 how the SSD tier stores kv objects: ``auto`` (as the KV cache holds them,
                              bit-exact) or ``fp8`` (FP8 e4m3 with a float32 scale per 128 elements:
                              about half the SSD bytes written, read and held; DRAM copies and GDN
                              states stay exact; :mod:`saria.ssd_dtype`) (``auto``)
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
``audit_kv``                  check every reloaded page bit for bit against the KV vLLM computed
                              (:mod:`~saria.integrations.vllm.audit`; a copy and a hash per page:
                              tests, the demo, debugging) (``false``). With ``secret_file`` it is refused:
                              it keeps vLLM's block hashes of reloaded chunks in the workers and names
                              the digests it served by them, which a shared deployment must not
                              (docs/security.md), unless ``audit_kv_with_key``
``audit_kv_with_key``         a testing aid: allow ``audit_kv`` with ``secret_file`` (tests of sealed
                              tiers; never in a shared deployment) (``false``)
``cluster``                   the Mooncake master (``host:port``) of a cluster tier shared by every replica
                              (docs/cluster.md); empty: none (``""``). Dense (attention-only) models
``cluster_host``              this host's address as the Mooncake storage nodes reach it (``127.0.0.1``)
``cluster_admission``         what a replica puts into the cluster: ``all`` (every chunk it computes,
                              once its DRAM copy is stored) or ``evicted`` (a chunk when its DRAM copy
                              is dropped) (``all``)
``cluster_timeout_s``         deadline of a cluster get or put batch; past it, a miss (5)
``cluster_lookup_timeout_s``  the longest the scheduler waits for a cluster lookup (0.5)
``cluster_staging_gb`` /      host memory beside the DRAM tier that cluster reloads land in before they
``cluster_staging_bytes``     go to the GPU (256 MiB per rank)
``secret_file``               a saria key file (``saria keys new PATH``, mode 0400): every SSD and cluster
                              object is sealed (AES-256-GCM, bound to its name, store, tenant and
                              epoch) and named by a MAC, each request's ``cache_salt`` selecting its
                              tenant's keys (docs/security.md); empty: objects are neither sealed nor
                              authenticated, said once at start (``""``)
``cluster_insecure``          let the cluster tier run without ``secret_file`` (its objects then
                              unsealed: anyone who reaches the Mooncake master can plant or read
                              KV); without it a cluster tier without a key is refused (``false``)
``layerwise``                 reload layer by layer inside the step, overlapped with the forward pass
                              (vLLM's per-layer hooks; docs/vllm.md, "Layer-wise reloads"): ``true``,
                              ``false`` or ``auto`` (on for the devices whose measurements support it,
                              :data:`LAYERWISE_DEFAULT`). Hybrid (GDN) models always reload whole:
                              vLLM 0.32 cannot recompute a failed in-step load of a model with more
                              than one KV cache group (``auto``)
``layerwise_max_programs``    on a GPU, the most programs (CTAs) one layer's layer-wise copy kernel
                              launches, so the copies leave SMs to the forward; 0: no cap, one program
                              per tile (``auto``: :data:`saria.kernels.COPY_MAX_PROGRAMS`; the CPU and
                              Triton's interpreter ignore it)
``kv_events_max_chunks``      with vLLM's KV events enabled (``kv_events_config``): the most chunks whose
                              event payload (block hashes, tokens) the scheduler keeps to announce
                              saria's tiers to routers (:mod:`~saria.integrations.vllm.events`); a
                              chunk past it is not announced (65536)
``pin_bytes_per_tenant`` /    the most bytes one tenant's ``pin`` cache hints may hold in the SSD tier
``pin_gb_per_tenant``         (docs/vllm.md, "Cache hints"; a tenant: a ``cache_salt``); a pin past it
                              is refused, counted (``vllm:saria_pins_refused``) and warned about,
                              never an error; all tenants' pins together never pass half the SSD
                              tier (a tenth of the SSD tier)
``retain_bytes_per_tenant`` / the most bytes one tenant's chunks inside a ``retain_s`` retention may
``retain_gb_per_tenant``      hold in the SSD tier; a ``retain_s`` past it is refused whole, counted
                              (``vllm:saria_retains_refused``) and warned about, never an error; a chunk
                              the tenant already retains is extended at no charge (a tenth of the SSD
                              tier)
``on_load_failure``           ``recompute``: a reload that fails (corrupt SSD object, I/O error)
                              makes vLLM recompute those tokens; ``fail``: the request fails.
                              Sets vLLM's ``kv_load_failure_policy`` (``recompute``)
============================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from saria.config import POLICY_PRESETS, Bandwidths, Capacity, ChunkSpec, Policy, SariaConfig, admission_rules
from saria.ssd_dtype import SSD_DTYPES

GiB = 1 << 30
DEFAULT_CHECKPOINT_TOKENS = 16_384
_POLICY_FIELDS = {f.name for f in dataclasses.fields(Policy)} - {"name"}
_KEYS = {"policy", "dram_gb", "dram_bytes", "ssd_paths", "ssd_gb", "ssd_bytes", "chunk_tokens",
         "checkpoint_tokens", "b_gpu_gbps", "b_disk_gbps", "b_dram_gbps", "coordinator", "durable",
         "log_interval_s", "on_load_failure", "audit_kv", "audit_kv_with_key", "ssd_dtype", "cluster", "cluster_host", "cluster_admission",
         "cluster_timeout_s", "cluster_lookup_timeout_s", "cluster_staging_gb", "cluster_staging_bytes",
         "cluster_insecure", "secret_file", "layerwise", "layerwise_max_programs", "kv_events_max_chunks",
         "pin_bytes_per_tenant", "pin_gb_per_tenant", "retain_bytes_per_tenant", "retain_gb_per_tenant"} | _POLICY_FIELDS
CLUSTER_ADMISSIONS = ("all", "evicted")
# layerwise=auto, per device type: what the measurements support (docs/vllm.md, "Layer-wise reloads
# and saves", has them). CPU: bench/bench_layerwise_ttft.py, turn-2 TTFT whole / layer-wise 1.01x
# from DRAM and 1.03x from SSD (never slower beyond the rounds' spread), and every engine test
# then runs the in-step path the GPU's shares. CUDA: off until bench/bench_layerwise.py (a
# bench/gpu_check.sh step) has measured it on a GPU: its copy kernel has not run on one yet.
LAYERWISE_DEFAULT = {"cuda": False, "cpu": True}


MAX_BYTES = 1 << 60  # an exabyte: beyond any tier a machine could give
MAX_GBPS = 1e5  # 100 TB/s


def _number(extra: Mapping[str, Any], key: str, default: float, low: float, high: float, *,
            strict: bool = False) -> float:
    """``extra[key]`` (``default`` if absent): a finite number in ``[low, high]`` (``(low, high]``
    if ``strict``); booleans and strings are refused, not read as numbers."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r:.60}")
    if not (low < value <= high if strict else low <= value <= high):  # False for NaN
        raise ValueError(f"{key} must be {'>' if strict else '>='} {low:g} and <= {high:g}, got {value!r:.60}")
    return float(value)


def _positive_int(extra: Mapping[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 40):
        raise ValueError(f"{key} must be a positive int, got {value!r:.60}")
    return value


def _choice(extra: Mapping[str, Any], key: str, default: str, choices) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or value not in choices:
        known = ", ".join(choices[:-1]) + " or " + choices[-1]
        raise ValueError(f"unknown {key} {value!r:.60}: must be {known}")
    return value


def _size(extra: Mapping[str, Any], name: str, default: int) -> int:
    """``{name}_bytes`` (an int) or ``{name}_gb`` (a number of GiB), at most one of them."""
    if extra.get(f"{name}_gb") is not None and extra.get(f"{name}_bytes") is not None:
        raise ValueError(f"give {name}_gb or {name}_bytes, not both")
    if extra.get(f"{name}_gb") is not None:
        return int(_number(extra, f"{name}_gb", 0, 0.0, MAX_BYTES / GiB) * GiB)
    value = extra.get(f"{name}_bytes", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
        raise ValueError(f"{name}_bytes must be an int >= 0 and <= 2**60, got {value!r:.60}")
    return value


def _tenant_cap(extra: Mapping[str, Any], name: str) -> int | None:
    """``{name}_bytes_per_tenant`` or ``{name}_gb_per_tenant`` (``pin``, ``retain``), at most one of them;
    None when neither is given (saria.control.hints' default)."""
    gb, nbytes = f"{name}_gb_per_tenant", f"{name}_bytes_per_tenant"
    if extra.get(gb) is None and extra.get(nbytes) is None:
        return None
    try:
        return _size({(f"{name}_gb" if k == gb else f"{name}_bytes"): v for k, v in extra.items() if k in (gb, nbytes)},
                     name, 0)
    except ValueError as exc:
        raise ValueError(str(exc).replace(f"{name}_gb", gb).replace(f"{name}_bytes", nbytes)) from None


def _address(extra: Mapping[str, Any], key: str) -> str:
    """``host:port`` (a port in 1..65535), or ``""`` when absent."""
    value = extra.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"{key} must be host:port, got {value!r:.60}")
    if value:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{key} must be host:port (the Mooncake master's RPC address), got {value!r:.60}")
    return value


def _cluster_options(extra: Mapping[str, Any]) -> dict[str, Any]:
    host = extra.get("cluster_host", "127.0.0.1")
    if not isinstance(host, str) or not host or ":" in host:
        raise ValueError(f"cluster_host must be this host's address (no port), got {host!r:.60}")
    out = dict(cluster=_address(extra, "cluster"), cluster_host=host,
               cluster_admission=_choice(extra, "cluster_admission", "all", CLUSTER_ADMISSIONS),
               cluster_timeout_s=_number(extra, "cluster_timeout_s", 5.0, 0.0, 3600.0, strict=True),
               cluster_lookup_timeout_s=_number(extra, "cluster_lookup_timeout_s", 0.5, 0.0, 60.0, strict=True),
               cluster_staging_bytes=_size(extra, "cluster_staging", 256 << 20),
               cluster_insecure=_flag(extra, "cluster_insecure"))
    if not out["cluster"] and any(k.startswith("cluster_") for k in extra):
        raise ValueError(f"{sorted(k for k in extra if k.startswith('cluster_'))[0]} is set but cluster (the Mooncake "
                         "master's address) is not")
    return out


def _flag(extra: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r:.60}")
    return value


def _secret_file(extra: Mapping[str, Any], cluster: str, insecure: bool) -> str:
    """The key file's path (``""``: none), checked against the cluster options: a cluster tier needs
    a key unless ``cluster_insecure`` says to run it unsealed, and never both."""
    path = extra.get("secret_file", "")
    if not isinstance(path, str) or "\0" in path:
        raise ValueError("secret_file must be the path of a saria key file (saria keys new PATH)")
    if cluster and not path and not insecure:
        raise ValueError("the cluster tier needs a key: give secret_file (saria serve --secret-file PATH; make one with "
                         "saria keys new PATH), or cluster_insecure (--cluster-insecure) to share unsealed objects that "
                         "anyone who reaches the Mooncake master can read or replace")
    if path and insecure:
        raise ValueError("cluster_insecure with secret_file: the cluster tier is sealed with the key; drop "
                         "cluster_insecure")
    return path


@dataclass(frozen=True)
class ConnectorSettings:
    policy: str = "saria"
    policy_overrides: Mapping[str, Any] = field(default_factory=dict)
    dram_bytes: int = 8 * GiB
    ssd_paths: tuple[str, ...] = ()
    ssd_bytes: int = 0
    ssd_dtype: str = "auto"
    chunk_tokens: int | None = None
    checkpoint_tokens: int | None = None  # None: DEFAULT_CHECKPOINT_TOKENS rounded to whole chunks
    bandwidth: Bandwidths = Bandwidths()
    coordinator: str = "coordinated"
    durable: bool = True
    log_interval_s: float = 60.0
    on_load_failure: str = "recompute"
    audit_kv: bool = False
    audit_kv_with_key: bool = False  # a testing aid: audit_kv allowed with secret_file
    cluster: str = ""  # the Mooncake master, host:port; "" for no cluster tier
    cluster_host: str = "127.0.0.1"
    cluster_admission: str = "all"
    cluster_timeout_s: float = 5.0
    cluster_lookup_timeout_s: float = 0.5
    cluster_staging_bytes: int = 256 << 20
    cluster_insecure: bool = False  # a cluster tier without a key (unsealed objects)
    secret_file: str = ""  # the key file that seals SSD and cluster objects; "" for none
    layerwise: bool | None = None  # None: auto (LAYERWISE_DEFAULT for the device)
    layerwise_max_programs: int | None = None  # None: auto (saria.kernels.COPY_MAX_PROGRAMS on CUDA); 0: no cap
    kv_events_max_chunks: int = 65_536  # chunks whose KV event payload the scheduler keeps (events.py)
    pin_bytes_per_tenant: int | None = None  # None: a tenth of the SSD tier (saria.control.hints)
    retain_bytes_per_tenant: int | None = None  # None: a tenth of the SSD tier (saria.control.hints)

    def layerwise_for(self, device_type: str, hybrid: bool, drafter: bool = False, ubatching: bool = False) -> bool:
        """Whether reloads go layer by layer on this engine: never for a hybrid model (module
        docstring), nor beside a speculative drafter with attention layers of its own (``drafter``:
        vLLM runs the drafter's forward after it has asked for the step's transfer results, so its
        layers' waits would come after the step's loads were reported, and it runs once per
        proposed token), nor under vLLM's micro-batching (``ubatching``: dual-batch overlap runs each
        layer once per micro-batch, so a layer would be saved twice in a step, and each save would
        hold only its micro-batch's pages), else the option, or for ``auto``
        :data:`LAYERWISE_DEFAULT` of the device."""
        if hybrid or drafter or ubatching:
            return False
        return LAYERWISE_DEFAULT.get(device_type, False) if self.layerwise is None else self.layerwise

    @property
    def sealed(self) -> bool:
        """Whether SSD and cluster objects are sealed (a key file is set)."""
        return bool(self.secret_file)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorSettings":
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config must be a mapping of options, got {extra!r:.60}")
        extra = dict(extra or {})
        unknown = sorted(map(str, set(extra) - _KEYS))
        if unknown:
            raise ValueError(f"unknown saria connector option(s) {unknown}; known: {sorted(_KEYS)}")
        policy = _choice(extra, "policy", "saria", tuple(POLICY_PRESETS))
        paths = extra.get("ssd_paths", [])
        if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) and p for p in paths):
            raise ValueError(f"ssd_paths must be a list of directories, got {paths!r:.60}")
        coordinator = _choice(extra, "coordinator", "coordinated", ("coordinated", "overlap", "serial"))
        defaults = Bandwidths()
        bandwidth = Bandwidths(gpu_gbps=_number(extra, "b_gpu_gbps", defaults.gpu_gbps, 0.0, MAX_GBPS, strict=True),
                               disk_gbps_per_drive=_number(extra, "b_disk_gbps", defaults.disk_gbps_per_drive, 0.0,
                                                           MAX_GBPS, strict=True),
                               drives=max(1, len(paths)),
                               dram_gbps=_number(extra, "b_dram_gbps", defaults.dram_gbps, 0.0, MAX_GBPS, strict=True))
        durable = extra.get("durable", True)
        if not isinstance(durable, bool):
            raise ValueError(f"durable must be true or false, got {durable!r:.60}")
        audit_kv = extra.get("audit_kv", False)
        if not isinstance(audit_kv, bool):
            raise ValueError(f"audit_kv must be true or false, got {audit_kv!r:.60}")
        audit_kv_with_key = extra.get("audit_kv_with_key", False)
        if not isinstance(audit_kv_with_key, bool):
            raise ValueError(f"audit_kv_with_key must be true or false, got {audit_kv_with_key!r:.60}")
        layerwise = extra.get("layerwise", "auto")
        if layerwise not in (True, False, "auto") or isinstance(layerwise, int) and not isinstance(layerwise, bool):
            raise ValueError(f"layerwise must be true, false or \"auto\", got {layerwise!r:.60}")
        max_programs = extra.get("layerwise_max_programs", "auto")
        if max_programs != "auto" and (isinstance(max_programs, bool) or not isinstance(max_programs, int)
                                       or not 0 <= max_programs <= 2**31 - 1):
            raise ValueError(f"layerwise_max_programs must be \"auto\" or an int from 0 (no cap) to 2**31 - 1, got "
                             f"{max_programs!r:.60}")
        overrides = {k: v for k, v in extra.items() if k in _POLICY_FIELDS}
        resolved = Policy.preset(policy, **overrides)  # validates the overrides now, with the field's name in the error
        if "oracle" in admission_rules(resolved.admission):
            raise ValueError("admission=oracle (policy oracle) knows every chunk's next use, which only a replay of a "
                             "recorded trace can tell it; a serving engine cannot use it: choose an online policy "
                             "(saria, paper, ...) or evaluate the oracle with saria replay --policy oracle")
        pin_cap, retain_cap = _tenant_cap(extra, "pin"), _tenant_cap(extra, "retain")
        cluster = _cluster_options(extra)
        secret_file = _secret_file(extra, cluster["cluster"], cluster["cluster_insecure"])
        if audit_kv and secret_file and not audit_kv_with_key:
            raise ValueError("audit_kv with secret_file: the audit keeps vLLM's block hashes of reloaded chunks in "
                             "the workers and names what it served by them, not for a shared deployment; drop "
                             "audit_kv, or set audit_kv_with_key (a testing aid) to allow it in a test")
        return cls(policy=policy, policy_overrides=overrides, dram_bytes=_size(extra, "dram", 8 * GiB),
                   ssd_paths=tuple(paths), ssd_bytes=_size(extra, "ssd", 64 * GiB if paths else 0),
                   ssd_dtype=_choice(extra, "ssd_dtype", "auto", SSD_DTYPES),
                   chunk_tokens=_positive_int(extra, "chunk_tokens"),
                   checkpoint_tokens=_positive_int(extra, "checkpoint_tokens"),
                   bandwidth=bandwidth, coordinator=coordinator, durable=durable,
                   log_interval_s=_number(extra, "log_interval_s", 60.0, 0.0, 365 * 86_400.0),
                   on_load_failure=_choice(extra, "on_load_failure", "recompute", ("recompute", "fail")),
                   audit_kv=audit_kv, audit_kv_with_key=audit_kv_with_key, secret_file=secret_file, layerwise=None if layerwise == "auto" else layerwise,
                   layerwise_max_programs=None if max_programs == "auto" else max_programs,
                   kv_events_max_chunks=_positive_int(extra, "kv_events_max_chunks") or 65_536,
                   pin_bytes_per_tenant=pin_cap, retain_bytes_per_tenant=retain_cap, **cluster)

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

    def saria_config(self, *, block_size: int, kv_bytes_per_token: int, state_bytes: int = 0,
                     shards: int = 1, kv_element_bytes: int = 2) -> SariaConfig:
        """The configuration of one shard's cache for an engine with these page geometries (one
        rank's: ``kv_bytes_per_token`` and ``state_bytes`` are what one worker's pages hold).
        Under tensor and pipeline parallelism each of the ``shards`` worker ranks holds its shard of
        every object, so each gets ``1 / shards`` of the server's DRAM and SSD capacity, and the
        control plane, which counts one shard's bytes per object, the same. For hybrid models
        every chunk may carry a state object; which ones exist is decided per request (the
        connector captures states at ``checkpoint_tokens`` multiples and at each prompt's last
        chunk boundary)."""
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards must be a positive int, got {shards!r}")
        chunk_tokens = self.chunk_tokens_for(block_size, bool(state_bytes))
        policy = Policy.preset(self.policy, **self.policy_overrides)
        if not self.ssd_paths and policy.use_ssd:
            policy = dataclasses.replace(policy, use_ssd=False)  # no drives: no SSD tier
        return SariaConfig(dram=Capacity(nbytes=self.dram_bytes // shards), ssd=Capacity(nbytes=self.ssd_bytes // shards),
                           chunk=ChunkSpec(chunk_tokens=chunk_tokens, kv_bytes_per_token=kv_bytes_per_token,
                                           state_bytes=state_bytes, checkpoint_tokens=chunk_tokens,
                                           kv_element_bytes=kv_element_bytes),
                           bandwidth=self.bandwidth, policy=policy, ssd_paths=self.ssd_paths, ssd_dtype=self.ssd_dtype)

"""saria's typed configuration: capacities, chunk geometry, bandwidth estimates and policy.

Plain frozen dataclasses, validated on construction (a bad value raises ``ValueError`` naming the
field), no torch. The control plane reads :class:`SariaConfig`; the data plane and replay read the
same object.

```python
from saria.config import Capacity, Policy, SariaConfig, WriteBudget

cfg = SariaConfig()                                    # saria defaults: DRAM 1M, SSD 10M tokens, Qwen3-8B
cfg = SariaConfig.for_model("qwen3-next-80b-a3b")      # hybrid: 1024-token chunks, GDN state objects
cfg = SariaConfig(policy=Policy.preset("full-duplicate", p_tau_s=30.0))
cfg = SariaConfig(dram=Capacity(nbytes=64 << 30), ssd=Capacity(tokens=0))
cfg = SariaConfig(write_budget=WriteBudget(dwpd=1.0, auto=True))  # governor: theta_E tracks 1 DWPD
cfg = SariaConfig(ssd_dtype="fp8")                     # kv objects on SSD as FP8 e4m3 + scales (saria.ssd_dtype)
```

Capacities are in full-attention token equivalents (``tokens``, as the paper budgets them: one
token costs ``kv_bytes_per_token``) or in bytes (``nbytes``). Either way GDN state objects consume
their real bytes. The SSD capacity is bytes on the drives: with ``ssd_dtype="fp8"`` a kv object
takes ``SariaConfig.ssd_kv_bytes`` there (0.515625x for bf16), so the same SSD holds ~1.94x the kv
objects; DRAM copies and GDN state objects keep their full size everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Mapping

from saria.config_checks import ADMISSION_RULES, admission_rules, learned_join
from saria.config_checks import check_bool as _check_bool
from saria.config_checks import check_float as _check_float
from saria.config_checks import check_int as _check_int
from saria.models import DTYPE_BYTES, ModelSpec, get_model
from saria.ssd_dtype import check_ssd_dtype, ssd_kv_bytes

__all__ = ["ADMISSION_RULES", "Bandwidths", "COORDINATION_SATURATION", "Capacity", "ChunkSpec", "LOOKUP_MODES",
           "POLICY_PRESETS", "Policy", "SariaConfig", "WriteBudget", "admission_rules", "learned_join"]

# Qwen3-8B (saria.models): 36 full-attention layers x K and V x 8 KV heads x head dim 128 x bf16.
QWEN3_8B_KV_BYTES_PER_TOKEN = 36 * 2 * 8 * 128 * 2

LOOKUP_MODES = ("unified", "tier-prefix")

# Policy.prewrite_depth above this is refused: it is more DRAM objects than any host holds (2^30
# chunks of even one token of Qwen3-8B are 144 TiB), and a depth must fit the LRU walk's index.
MAX_PREWRITE_DEPTH = 1 << 30
MAX_THRESHOLD = 1_000_000  # theta_E / theta_R: a chunk evicted or reused a million times
MAX_DRIVES = 1024
# WriteBudget.theta_max above this is refused: the governor's theta_E is a float, and no chunk is
# evicted a million times.
MAX_GOVERNOR_THETA = 1_000_000


@dataclass(frozen=True)
class Capacity:
    """A tier's capacity: ``tokens`` (full-attention token equivalents) or ``nbytes``, exactly one."""

    tokens: int | None = None
    nbytes: int | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.nbytes is None):
            raise ValueError(f"Capacity needs exactly one of tokens= or nbytes=, got {self!r}")
        name, value = ("tokens", self.tokens) if self.tokens is not None else ("nbytes", self.nbytes)
        _check_int("Capacity", name, value, 0)

    def in_bytes(self, kv_bytes_per_token: int) -> int:
        return self.nbytes if self.nbytes is not None else self.tokens * kv_bytes_per_token


@dataclass(frozen=True)
class ChunkSpec:
    """What one chunk's objects weigh. A chunk is ``chunk_tokens`` tokens; its kv object holds
    every full-attention layer's K and V (``chunk_tokens * kv_bytes_per_token`` bytes). A hybrid
    model (``state_bytes > 0``) also keeps a state object (every GDN layer's checkpoint,
    ``state_bytes``) on the chunks that end a ``checkpoint_tokens`` boundary. ``kv_element_bytes``
    is the size of one element of the KV cache (2: bf16 or fp16), which ``ssd_dtype="fp8"`` needs
    to size a kv object's FP8 form."""

    chunk_tokens: int = 512
    kv_bytes_per_token: int = QWEN3_8B_KV_BYTES_PER_TOKEN
    state_bytes: int = 0
    checkpoint_tokens: int = 16_384
    kv_element_bytes: int = 2

    def __post_init__(self) -> None:
        _check_int("ChunkSpec", "chunk_tokens", self.chunk_tokens, 1)
        _check_int("ChunkSpec", "kv_bytes_per_token", self.kv_bytes_per_token, 1)
        _check_int("ChunkSpec", "state_bytes", self.state_bytes, 0)
        _check_int("ChunkSpec", "checkpoint_tokens", self.checkpoint_tokens, 1)
        _check_int("ChunkSpec", "kv_element_bytes", self.kv_element_bytes, 1, 8)
        if self.checkpoint_tokens % self.chunk_tokens:
            raise ValueError(f"ChunkSpec.checkpoint_tokens ({self.checkpoint_tokens}) must be a multiple of "
                             f"chunk_tokens ({self.chunk_tokens}): checkpoints sit at chunk boundaries")

    @classmethod
    def for_model(cls, model: str | ModelSpec, chunk_tokens: int | None = None,
                  checkpoint_tokens: int = 16_384) -> ChunkSpec:
        """Sizes from a :class:`saria.models.ModelSpec` (or its name); chunks default to 1024 tokens
        for hybrid models and 512 otherwise, as the paper. The element size is the spec's KV dtype's
        (2 bytes when the spec names none saria knows)."""
        spec = get_model(model) if isinstance(model, str) else model
        if chunk_tokens is None:
            chunk_tokens = 1024 if spec.hybrid else 512
        return cls(chunk_tokens=chunk_tokens, kv_bytes_per_token=spec.kv_bytes_per_token,
                   state_bytes=spec.state_bytes, checkpoint_tokens=checkpoint_tokens,
                   kv_element_bytes=DTYPE_BYTES.get(getattr(spec, "kv_dtype", None), 2))

    @property
    def hybrid(self) -> bool:
        return self.state_bytes > 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of one kv object."""
        return self.chunk_tokens * self.kv_bytes_per_token

    def ssd_kv_bytes(self, ssd_dtype: str) -> int:
        """Bytes of one kv object on SSD under ``ssd_dtype`` (:func:`saria.ssd_dtype.ssd_kv_bytes`);
        ``ValueError`` when fp8 does not apply to this cache (element size, whole groups)."""
        return ssd_kv_bytes(self.kv_bytes, ssd_dtype, self.kv_element_bytes)

    @property
    def checkpoint_chunks(self) -> int:
        """A chunk at depth ``d`` (0-based) carries a state object when ``(d + 1) % checkpoint_chunks == 0``
        (hybrid models only)."""
        return self.checkpoint_tokens // self.chunk_tokens


# Coordinated reloads (paper §4.5, Eq. 4) pace DRAM->GPU copies only while the SSDs leave GPU
# ingress room: at B_disk >= COORDINATION_SATURATION x B_GPU the SSD reads alone (nearly) saturate
# ingress, pacing gains nothing and its overhead costs (the paper's two-SSD case got 15.8% slower
# with coordination, §5.3), so coordination is off and DRAM and SSD simply overlap. Read by the data
# plane's coordinator (its default) and by the replay's timing model, which must agree.
COORDINATION_SATURATION = 0.95


@dataclass(frozen=True)
class Bandwidths:
    """Bandwidth estimates in GB/s (paper §5.1 defaults: shared GPU ingress 48, GDS 20 per drive,
    DRAM 48). The data plane's PCIe monitor may calibrate them; the control plane uses them for r*."""

    gpu_gbps: float = 48.0
    disk_gbps_per_drive: float = 20.0
    drives: int = 1
    dram_gbps: float = 48.0

    def __post_init__(self) -> None:
        _check_float("Bandwidths", "gpu_gbps", self.gpu_gbps, 0.0, strict=True)
        _check_float("Bandwidths", "disk_gbps_per_drive", self.disk_gbps_per_drive, 0.0, strict=True)
        _check_int("Bandwidths", "drives", self.drives, 1, MAX_DRIVES)
        _check_float("Bandwidths", "dram_gbps", self.dram_gbps, 0.0, strict=True)

    @property
    def disk_gbps(self) -> float:
        """B_disk: all drives together."""
        return self.disk_gbps_per_drive * self.drives

    @property
    def auto_promotion_ratio(self) -> float:
        """Paper Eq. 2: r* = 1 - B_disk / B_GPU, floored at 0 (SSDs alone saturate ingress)."""
        return max(0.0, 1.0 - self.disk_gbps / self.gpu_gbps)


@dataclass(frozen=True)
class Policy:
    """The control plane's decisions, one knob per field. Presets are settings of these knobs.

    * ``use_dram`` / ``use_ssd``: a disabled tier has capacity 0 whatever its configured size.
    * Admission (paper Eq. 1): a chunk is admitted to SSD when ``E_b >= theta_E or R_b >= theta_R``;
      ``None`` disables a branch; ``admit_all`` admits everything (full duplicate caching).
    * ``write_through``: new KV is written to SSD when it is stored (from HBM), not at eviction.
    * ``prewrite`` / ``prewrite_depth``: after each commit, the ``prewrite_depth`` least recently
      used DRAM objects are written early if they would be admitted with ``E_b + 1``.
    * ``r``: promotion ratio, the target DRAM share of a reload (paper Eq. 2); ``None`` = auto r*.
    * ``p_tau_s``: a DRAM object may be evicted to make room for a promotion only if its chunk was
      last reused at least ``p_tau_s`` seconds ago (paper §4.4).
    * ``lookup``: ``"unified"`` plans the longest prefix across DRAM and SSD in any interleaving;
      ``"tier-prefix"`` takes DRAM, then SSD, and stops where a chunk is only in DRAM again.
    * ``unified_metadata``: a state object shares its chunk's E_b / R_b; off, it keeps its own.
    * ``serial_loading``: plans ask the data plane to load tiers one after the other.
    * ``metadata_window_s``: a chunk's metadata is reclaimed after this long with no reuse or
      recomputation and nothing resident.
    * ``admission``: which admission rules decide SSD writes, joined by ``+`` (see
      :mod:`saria.control.admission`): ``eq1`` (Eq. 1 with theta_E / theta_R), refined by
      ``session`` (persist at the first eviction a chunk whose session is predicted to come back,
      with probability at least ``session_p``), ``prefix`` (never write a chunk whose parent has
      no copy left: it could not be reloaded) and ``cost`` (never write a chunk whose reload would
      not beat recomputing it at ``prefill_tps``); ``learned`` (a gradient-boosted tree model of
      the oracle's labels, :mod:`saria.control.learned`) is joined to ``eq1`` by ``&`` (both admit)
      or ``|`` (either admits): ``eq1&learned+deferred``; ``oracle`` alone knows the future (replay only).
    * ``learned_tau``: the ``learned`` rule admits a chunk at an eviction when the model's
      probability that a later request reuses it within the SSD's retention is at least this
      (None: the threshold the model file carries for the join, chosen on its training labels;
      0.5 if it carries none);
      ``learned_model``: the model file (None: the one shipped in :mod:`saria.control`);
      ``learned_retrain_s``: retrain the model online every that many seconds on the labels the
      traffic has settled since (None: never; needs the ``learn`` extra, LightGBM).
    * ``session_p``: the continuation probability the ``session`` rule needs.
    * ``prefill_tps``: the model's prefill throughput (tokens/s) the ``cost`` rule compares a
      reload with; ``reload_overhead_s`` the fixed cost of one reload (a plan's setup and first
      SSD read latency).
    * Prewarming (``ControlPlane.prewarm``): with ``prewarm`` on, a caller that predicts a session's
      next turn (``saria.control.prewarm.GapPredictor``) reloads the session's SSD-only prefix
      into free DRAM ``prewarm_lead_s`` seconds before it, at most ``prewarm_dram_fraction`` of
      the DRAM capacity per prewarm, with SSD reads paced at ``prewarm_gbps`` GB/s. Off by default.
    """

    name: str = "saria"
    use_dram: bool = True
    use_ssd: bool = True
    theta_E: int | None = 2
    theta_R: int | None = 8
    admit_all: bool = False
    write_through: bool = False
    prewrite: bool = True
    prewrite_depth: int = 16
    r: float | None = None
    p_tau_s: float = 60.0
    lookup: str = "unified"
    unified_metadata: bool = True
    serial_loading: bool = False
    metadata_window_s: float = 3600.0
    admission: str = "eq1+deferred"
    session_p: float = 0.5
    prefill_tps: float | None = None
    reload_overhead_s: float = 0.002
    learned_tau: float | None = None
    learned_model: str | None = None
    learned_retrain_s: float | None = None
    prewarm: bool = False
    prewarm_lead_s: float = 5.0
    prewarm_dram_fraction: float = 0.25
    prewarm_gbps: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Policy.name must be a non-empty string, got {self.name!r}")
        for flag in ("use_dram", "use_ssd", "admit_all", "write_through", "prewrite", "unified_metadata",
                     "serial_loading"):
            _check_bool("Policy", flag, getattr(self, flag))
        for threshold in ("theta_E", "theta_R"):
            value = getattr(self, threshold)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"Policy.{threshold} must be an int or None (branch off), got {value!r}")
                if not 1 <= value <= MAX_THRESHOLD:
                    raise ValueError(f"Policy.{threshold} must be from 1 to {MAX_THRESHOLD:,} (or None to disable "
                                     f"that admission branch), got {value}")
        _check_int("Policy", "prewrite_depth", self.prewrite_depth, 0, MAX_PREWRITE_DEPTH)
        if self.r is not None:
            _check_float("Policy", "r", self.r, 0.0, maximum=1.0)
        _check_float("Policy", "p_tau_s", self.p_tau_s, 0.0)
        if self.lookup not in LOOKUP_MODES:
            raise ValueError(f"Policy.lookup must be one of {LOOKUP_MODES}, got {self.lookup!r}")
        _check_float("Policy", "metadata_window_s", self.metadata_window_s, 0.0, strict=True)
        admission_rules(self.admission)
        _check_float("Policy", "session_p", self.session_p, 0.0, maximum=1.0)
        if self.prefill_tps is not None:
            _check_float("Policy", "prefill_tps", self.prefill_tps, 0.0, strict=True)
        _check_float("Policy", "reload_overhead_s", self.reload_overhead_s, 0.0)
        if self.learned_tau is not None:
            _check_float("Policy", "learned_tau", self.learned_tau, 0.0, strict=True)
            if self.learned_tau >= 1.0:
                raise ValueError(f"Policy.learned_tau must be a probability > 0 and < 1, got {self.learned_tau}")
        if self.learned_model is not None and (not isinstance(self.learned_model, str) or not self.learned_model):
            raise ValueError(f"Policy.learned_model must be a model file's path or None (the shipped model), "
                             f"got {self.learned_model!r}")
        if self.learned_retrain_s is not None:
            _check_float("Policy", "learned_retrain_s", self.learned_retrain_s, 0.0, strict=True)
        _check_bool("Policy", "prewarm", self.prewarm)
        _check_float("Policy", "prewarm_lead_s", self.prewarm_lead_s, 0.0)
        _check_float("Policy", "prewarm_dram_fraction", self.prewarm_dram_fraction, 0.0, maximum=1.0)
        _check_float("Policy", "prewarm_gbps", self.prewarm_gbps, 0.0, strict=True)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Policy:
        """The named preset (see :data:`POLICY_PRESETS`), with any field overridden."""
        try:
            settings = POLICY_PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown policy preset {name!r}; known: {', '.join(POLICY_PRESETS)}") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown Policy field(s) {unknown}; known: {sorted(known)}")
        return cls(**{"name": name, **settings, **overrides})


# Every preset is the one code path with these settings over the Policy defaults (= saria).
POLICY_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    # Persistence-aware admission (E2 or R8, reuse writes deferred until DRAM first evicts),
    # prewrite, mixed-source reload, r auto, P_tau 60 s.
    "saria": MappingProxyType({}),
    # The paper's algorithm exactly: Eq. 1 with E2 or R8, reuse writes at once.
    "paper": MappingProxyType({"admission": "eq1"}),
    # The offline ceiling (saria replay only): a chunk is written at DRAM eviction exactly when a
    # later request will reuse it while the SSD would still hold it; no reuse-branch writes.
    "oracle": MappingProxyType({"admission": "oracle", "theta_R": None}),
    # Admission off: every new chunk is written through; metadata and reload mechanisms kept.
    "full-duplicate": MappingProxyType({"admit_all": True, "write_through": True, "prewrite": False}),
    # No SSD tier.
    "dram-only": MappingProxyType({"use_ssd": False, "prewrite": False, "r": 0.0}),
    # SSD only: new KV written from HBM, reloads by GDS, nothing promoted.
    "gds-only": MappingProxyType({"use_dram": False, "admit_all": True, "write_through": True,
                                  "prewrite": False, "r": 0.0}),
    # saria without promotion (GDS reload path only).
    "zero-promotion": MappingProxyType({"r": 0.0}),
    # saria promoting every SSD hit, evicting whatever it takes.
    "full-promotion": MappingProxyType({"r": 1.0, "p_tau_s": 0.0}),
    # Popularity-gated admission only.
    "reuse-only": MappingProxyType({"theta_E": None}),
    # LMCache with optimized GDS: full duplicate, per-object metadata, tier-prefix lookup,
    # serial tier loading, no promotion.
    "lmcache-plus": MappingProxyType({"admit_all": True, "write_through": True, "prewrite": False,
                                      "unified_metadata": False, "lookup": "tier-prefix",
                                      "serial_loading": True, "r": 0.0}),
})


@dataclass(frozen=True)
class WriteBudget:
    """The SSD endurance budget (paper §2.2) and the online governor that can hold it.

    The budget is ``dwpd`` drive writes per day of ``capacity_bytes`` (``None``: the configured SSD
    cache capacity), i.e. ``dwpd * capacity / 86,400`` bytes per second. With ``auto`` the control
    plane runs :class:`saria.control.governor.EnduranceGovernor`: every ``interval_s`` seconds (of
    the caller's clock) it compares the recent write rate (averaged over ``window_s``) with the
    budget, corrected by the surplus or deficit so far paid back over ``payback_s``, and scales a
    fractional theta_E within ``[theta_min, theta_max]`` (a policy's theta_R moves by the same
    factor, so reuse-branch writes are governed too). Off (the default), the budget is only a
    yardstick (``saria replay`` reports writes against it)."""

    dwpd: float = 1.0
    capacity_bytes: int | None = None
    auto: bool = False
    interval_s: float = 900.0
    window_s: float = 10_800.0
    payback_s: float = 10_800.0
    theta_min: int = 1
    theta_max: int = 16

    def __post_init__(self) -> None:
        _check_float("WriteBudget", "dwpd", self.dwpd, 0.0, strict=True)
        if self.capacity_bytes is not None:
            _check_int("WriteBudget", "capacity_bytes", self.capacity_bytes, 1)
        _check_bool("WriteBudget", "auto", self.auto)
        _check_float("WriteBudget", "interval_s", self.interval_s, 0.0, strict=True)
        _check_float("WriteBudget", "window_s", self.window_s, 0.0, strict=True)
        _check_float("WriteBudget", "payback_s", self.payback_s, 0.0, strict=True)
        _check_int("WriteBudget", "theta_min", self.theta_min, 1, MAX_GOVERNOR_THETA)
        _check_int("WriteBudget", "theta_max", self.theta_max, self.theta_min, MAX_GOVERNOR_THETA)

    def bytes_per_s(self, ssd_capacity_bytes: int) -> float:
        """The budget's write rate, with ``ssd_capacity_bytes`` standing in for ``capacity_bytes=None``."""
        capacity = self.capacity_bytes if self.capacity_bytes is not None else ssd_capacity_bytes
        return self.dwpd * capacity / 86_400.0


@dataclass(frozen=True)
class SariaConfig:
    """The one configuration object: tier capacities, chunk geometry, bandwidths, policy, SSD paths,
    and ``ssd_dtype``, the SSD tier's element format (``"auto"``: kv objects as the cache holds them;
    ``"fp8"``: FP8 e4m3 with float32 scales, :mod:`saria.ssd_dtype`; state objects are never
    quantized). Everything on the SSD side (capacity use, bytes written and read, the write budget,
    ``ReloadPlan.ssd_bytes``) counts SSD bytes."""

    dram: Capacity = Capacity(tokens=1_000_000)
    ssd: Capacity = Capacity(tokens=10_000_000)
    chunk: ChunkSpec = ChunkSpec()
    bandwidth: Bandwidths = Bandwidths()
    policy: Policy = Policy()
    ssd_paths: tuple[str, ...] = ()
    write_budget: WriteBudget = WriteBudget()
    ssd_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name, kind in (("dram", Capacity), ("ssd", Capacity), ("chunk", ChunkSpec),
                           ("bandwidth", Bandwidths), ("policy", Policy), ("write_budget", WriteBudget)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"SariaConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.ssd_paths, tuple) or not all(isinstance(p, str) for p in self.ssd_paths):
            raise ValueError(f"SariaConfig.ssd_paths must be a tuple of str, got {self.ssd_paths!r}")
        check_ssd_dtype(self.ssd_dtype, "SariaConfig.ssd_dtype")
        try:
            self.chunk.ssd_kv_bytes(self.ssd_dtype)
        except ValueError as exc:
            raise ValueError(f"SariaConfig.ssd_dtype={self.ssd_dtype!r} does not fit this cache "
                             f"({self.chunk.kv_element_bytes}-byte elements, kv objects of {self.chunk.kv_bytes} "
                             f"bytes): {exc}") from None
        if self.write_budget.auto:
            policy = self.policy
            if policy.theta_E is None or policy.admit_all or not policy.use_ssd or self.ssd_bytes == 0:
                raise ValueError(f"SariaConfig.write_budget.auto governs theta_E (and theta_R with it), so it "
                                 f"needs eviction-based admission and an SSD tier; policy {policy.name!r} has "
                                 f"theta_E={policy.theta_E}, admit_all={policy.admit_all}, SSD {self.ssd_bytes} bytes")

    @classmethod
    def for_model(cls, model: str | ModelSpec, *, chunk_tokens: int | None = None,
                  checkpoint_tokens: int = 16_384, **changes: Any) -> SariaConfig:
        """A config whose object sizes come from a model in :mod:`saria.models`."""
        return cls(chunk=ChunkSpec.for_model(model, chunk_tokens, checkpoint_tokens), **changes)

    @classmethod
    def preset(cls, name: str, **changes: Any) -> SariaConfig:
        """``SariaConfig(policy=Policy.preset(name), **changes)``."""
        return cls(policy=Policy.preset(name), **changes)

    def with_policy(self, **overrides: Any) -> SariaConfig:
        return replace(self, policy=replace(self.policy, **overrides))

    @property
    def dram_bytes(self) -> int:
        """DRAM capacity in bytes (0 when the policy disables DRAM)."""
        return self.dram.in_bytes(self.chunk.kv_bytes_per_token) if self.policy.use_dram else 0

    @property
    def ssd_bytes(self) -> int:
        """SSD capacity in bytes (0 when the policy disables SSD)."""
        return self.ssd.in_bytes(self.chunk.kv_bytes_per_token) if self.policy.use_ssd else 0

    @property
    def ssd_kv_bytes(self) -> int:
        """Bytes of one kv object on SSD (``chunk.kv_bytes`` unless ``ssd_dtype`` shrinks it)."""
        return self.chunk.ssd_kv_bytes(self.ssd_dtype)

    def ssd_bytes_of(self, kv_objects: int, state_objects: int = 0) -> int:
        """SSD bytes of that many kv and state objects (what an order of them writes or reads there)."""
        return kv_objects * self.ssd_kv_bytes + state_objects * self.chunk.state_bytes

    @property
    def write_budget_bytes_per_s(self) -> float:
        """The endurance budget's write rate: ``write_budget.dwpd`` drive writes per day of
        ``write_budget.capacity_bytes``, or of the configured SSD capacity (even when the policy
        disables SSD, so that every policy of a comparison is measured against one budget)."""
        return self.write_budget.bytes_per_s(self.ssd.in_bytes(self.chunk.kv_bytes_per_token))

    @property
    def prewarm_max_bytes(self) -> int:
        """The most bytes one prewarm may bring into DRAM: ``policy.prewarm_dram_fraction`` of the
        DRAM capacity (0 when the policy disables DRAM)."""
        return int(self.policy.prewarm_dram_fraction * self.dram_bytes)

    @property
    def prewarm_bytes_per_s(self) -> float:
        """The SSD read rate prewarms may use: ``policy.prewarm_gbps``, never more than the drives'
        (of SSD bytes: an fp8 prewarm brings ~1.94x the kv objects in the same time)."""
        return min(self.policy.prewarm_gbps, self.bandwidth.disk_gbps) * 1e9

    @property
    def promotion_ratio(self) -> float:
        """r: the policy's, or r* = 1 - B_disk / B_GPU when it is None."""
        return self.bandwidth.auto_promotion_ratio if self.policy.r is None else float(self.policy.r)

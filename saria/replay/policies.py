"""Policy specs on the command line, and the :class:`SariaConfig` each one replays with.

A spec is a preset name with optional overrides of :class:`saria.config.Policy` fields:
``saria``, ``saria:theta_E=3,theta_R=none``, ``full-duplicate:r=0.5,p_tau_s=0``. Values are
``none`` (a disabled threshold, or automatic r), ``true``/``false``, numbers or words. One more
key, ``write_budget=auto|off``, turns the endurance governor on or off for that policy whatever
``--write-budget`` says. The spec as written is the policy's name in every report.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from saria.config import POLICY_PRESETS, Bandwidths, Capacity, ChunkSpec, Policy, SariaConfig, WriteBudget
from saria.models import get_model

__all__ = ["BaseSettings", "PolicySpec", "build_config", "governable", "parse_policy"]

_POLICY_FIELDS = {f.name for f in fields(Policy)} - {"name"}


@dataclass(frozen=True)
class PolicySpec:
    label: str
    preset: str
    overrides: tuple[tuple[str, object], ...]
    write_budget: bool | None  # None: follow --write-budget


@dataclass(frozen=True)
class BaseSettings:
    """What every policy of a run shares: model, capacities (full-attention tokens; the SSD's are
    bytes on the drives, ``ssd_tokens`` x the model's bf16 bytes per token, whatever ``ssd_dtype``),
    chunk and checkpoint sizes, bandwidths, the write budget (``auto``: govern every policy that
    can be) and the SSD tier's element format ``ssd_dtype`` (``auto`` or ``fp8``)."""

    model: str = "qwen3-8b"
    dram_tokens: int = 1_000_000
    ssd_tokens: int = 10_000_000
    chunk_tokens: int | None = None  # None: the model's default (512, hybrid 1024)
    checkpoint_tokens: int = 16_384
    bandwidth: Bandwidths = Bandwidths()
    write_budget: WriteBudget = WriteBudget()
    ssd_dtype: str = "auto"

    def chunk(self) -> ChunkSpec:
        """The chunk geometry (a dense model has no checkpoints, so any chunk size goes)."""
        spec = get_model(self.model)
        chunk_tokens = self.chunk_tokens or (1024 if spec.hybrid else 512)
        checkpoint = self.checkpoint_tokens if spec.hybrid else chunk_tokens
        return ChunkSpec.for_model(spec, chunk_tokens, checkpoint)


def _value(raw: str) -> object:
    low = raw.strip().lower()
    if low in ("none", "off", "null"):
        return None
    if low in ("true", "yes"):
        return True
    if low in ("false", "no"):
        return False
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return raw.strip()


def parse_policy(spec: str) -> PolicySpec:
    """Parse ``NAME[:key=value,...]``; raises ``ValueError`` naming what is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("a policy spec must be a preset name, optionally with :key=value,... overrides")
    name, _, rest = spec.strip().partition(":")
    if name not in POLICY_PRESETS:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_PRESETS)} "
                         f"(optionally NAME:key=value,... with keys {', '.join(sorted(_POLICY_FIELDS))}, "
                         f"write_budget)")
    overrides: dict[str, object] = {}
    budget: bool | None = None
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"policy {spec!r}: override {item!r} must be key=value")
        if key == "write_budget":
            if raw not in ("auto", "off"):
                raise ValueError(f"policy {spec!r}: write_budget must be auto or off, got {raw!r}")
            budget = raw == "auto"
            continue
        if key not in _POLICY_FIELDS:
            raise ValueError(f"policy {spec!r}: unknown setting {key!r}; known: "
                             f"{', '.join(sorted(_POLICY_FIELDS))}, write_budget")
        overrides[key] = _value(raw)
    Policy.preset(name, **overrides)  # validate now, with the field's own message
    return PolicySpec(spec.strip(), name, tuple(overrides.items()), budget)


def governable(policy: Policy) -> bool:
    """Whether the endurance governor can act on ``policy``: eviction-based admission (theta_E set:
    the governor's knob; a theta_R, if set, moves with it), not full duplicate, SSD on."""
    return policy.theta_E is not None and not policy.admit_all and policy.use_ssd


def build_config(spec: PolicySpec, base: BaseSettings) -> SariaConfig:
    """The config ``spec`` replays with. The governor runs when the spec says
    ``write_budget=auto``, or when ``base.write_budget.auto`` and the policy is governable."""
    policy = Policy.preset(spec.preset, **dict(spec.overrides))
    auto = spec.write_budget if spec.write_budget is not None else (base.write_budget.auto and governable(policy))
    if auto and not governable(policy):
        raise ValueError(f"policy {spec.label!r}: write_budget=auto needs eviction-based admission (theta_E set, "
                         f"not a full-duplicate policy) and an SSD tier")
    policy = replace(policy, name=spec.label)
    return SariaConfig(dram=Capacity(tokens=base.dram_tokens), ssd=Capacity(tokens=base.ssd_tokens),
                       chunk=base.chunk(), bandwidth=base.bandwidth, policy=policy,
                       write_budget=replace(base.write_budget, auto=auto), ssd_dtype=base.ssd_dtype)

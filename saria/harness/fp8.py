"""An emulation of ``ssd_dtype="fp8"`` reloads for engine runs, in this process: every kv object
read back from SSD is quantized and dequantized in its staging before it lands in vLLM's pages (by
the audit's torch reference of the SSD tier's FP8 format,
:func:`saria.integrations.vllm.audit.fp8_round_trip`), as an SSD tier that stored it as FP8 would
hand it back. ``bench/bench_fp8_accuracy.py`` holds the real option against it, byte for byte.

The emulation can also apply vLLM's own FP8 KV quantization instead (:func:`fp8_tensor_round_trip`:
e4m3 with one per-tensor scale, 1.0 when no calibrated scales exist): the same reloaded tokens
through the other format, which tells the formats apart from how many tokens each touches."""

from __future__ import annotations

from typing import Callable

import torch

from saria.integrations.vllm.audit import fp8_round_trip
from saria.orders import KV
from saria.ssd_dtype import FP8_MAX


def fp8_tensor_round_trip(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x`` through vLLM's FP8 KV cache format as its CPU attention stores it (``kv_cache_dtype
    fp8``, which is e4m3): ``x / scale`` rounded to e4m3fn (nearest even; clamped to [-448, 448]),
    decoded as ``code * scale`` and rounded back to ``x``'s dtype. ``scale`` is the layer's
    k_scale / v_scale: 1.0 unless the checkpoint has calibrated scales."""
    codes = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype)


ROUND_TRIPS = {"saria": fp8_round_trip, "vllm": fp8_tensor_round_trip}


def emulate_fp8_ssd_reloads(restore: Callable[[], None] | None = None, dtype: torch.dtype = torch.bfloat16,
                            fmt: str = "saria") -> Callable[[], None]:
    """Make every kv object the SSD -> GPU path reads (verified against its checksum) go through
    the FP8 round trip ``fmt`` (``saria``: :func:`fp8_round_trip`, the SSD tier's format;
    ``vllm``: :func:`fp8_tensor_round_trip`, vLLM's with scale 1.0) as ``dtype`` elements before it
    is unpacked into vLLM's pages; returns the undo (after ``restore``, if given). GDN state objects
    stay exact, as the format says."""
    from saria.dataplane.transfer.ssd_loads import SsdLoads

    if fmt not in ROUND_TRIPS:
        raise ValueError(f"fmt must be one of {', '.join(ROUND_TRIPS)}, got {fmt!r}")
    round_trip = ROUND_TRIPS[fmt]
    original = SsdLoads._arrived

    def arrived(self, batch, k, error):
        if error is None and batch.items[k].key.kind == KV:
            row = batch.row(k).view(dtype)
            row.copy_(round_trip(row))
        return original(self, batch, k, error)

    SsdLoads._arrived = arrived

    def undo() -> None:
        SsdLoads._arrived = original
        if restore is not None:
            restore()

    return undo

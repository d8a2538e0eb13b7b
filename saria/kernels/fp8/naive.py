"""The naive reference of the FP8 ops: saria/ssd_dtype.py's encoding one group at a time, the e4m3
rounding as a search for the nearest of the 127 e4m3 magnitudes (ties to the even code), with no
float8 cast, no bit tricks and no checks. The tests' oracle; too slow for anything else.

The object is :func:`~saria.kernels.pack_pages_naive`'s raw bytes, seen as the cache dtype.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ...ssd_dtype import FP8_GROUP, FP8_MAX
from ..pages.naive import pack_pages_naive, unpack_pages_naive


def _magnitudes() -> torch.Tensor:
    """float64 value of each e4m3fn code 0 to 126 (sign clear): exponent field e, mantissa m,
    ``m / 8 * 2**-6`` for e = 0 (subnormals), ``(1 + m / 8) * 2**(e - 7)`` otherwise."""
    values = []
    for code in range(127):
        e, m = code >> 3, code & 7
        values.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(values, dtype=torch.float64)


MAGNITUDES = _magnitudes()
NAN = float("nan")
NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}  # positive quiet NaN


def _code(q: float) -> int:
    """The e4m3fn code of float32 value ``q`` (finite): clamped to +-448, nearest magnitude, ties
    to the even code, sign bit from ``q`` (so -0.0 is 0x80)."""
    mag = min(abs(q), FP8_MAX)
    dist = (MAGNITUDES - mag).abs()
    best = dist.min()
    candidates = [c for c in range(127) if dist[c] == best]
    code = next((c for c in candidates if c % 2 == 0), candidates[0])
    return code | (0x80 if math.copysign(1.0, q) < 0 else 0)


def quantize_naive(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One object's raw bytes (uint8, 1-D) -> its FP8 form (uint8, 1-D)."""
    x = raw.cpu().view(dtype).to(torch.float32)
    groups = x.numel() // FP8_GROUP
    codes = torch.zeros(x.numel(), dtype=torch.uint8)
    scales = torch.zeros(groups, dtype=torch.float32)
    for g in range(groups):
        group = x[g * FP8_GROUP:(g + 1) * FP8_GROUP]
        if torch.isnan(group).any():
            scales[g] = NAN
            continue
        if torch.isinf(group).any():
            scales[g] = float("inf")
            continue
        scale = group.abs().max() / torch.tensor(FP8_MAX, dtype=torch.float32)  # float32 division
        scales[g] = scale
        if scale == 0:
            continue  # zeros (or values so small their scale underflows): codes 0
        for i, v in enumerate(group / scale):  # float32 divisions
            codes[g * FP8_GROUP + i] = _code(float(v))
    return torch.cat([codes, scales.view(torch.uint8)]).to(raw.device)


def _value(code: int) -> float:
    """The value of an e4m3fn code (0x7F and 0xFF are NaN)."""
    if code & 0x7F == 0x7F:
        return NAN
    return float(MAGNITUDES[code & 0x7F]) * (-1 if code & 0x80 else 1)


def dequantize_naive(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One FP8 object (uint8, 1-D) -> the raw bytes of its decoded elements in ``dtype``: each
    ``code * scale`` in float32, rounded to ``dtype``; NaN as the positive quiet NaN."""
    flat = stored.cpu()
    n = flat.numel() * FP8_GROUP // (FP8_GROUP + 4)
    scales = flat[n:].clone().view(torch.float32)
    out = torch.empty(n, dtype=dtype)
    word = torch.int32 if dtype == torch.float32 else torch.int16
    for i, code in enumerate(flat[:n].tolist()):
        y = torch.tensor(_value(code), dtype=torch.float32) * scales[i // FP8_GROUP]
        if torch.isnan(y):
            out.view(word)[i] = NAN_BITS[dtype]
        else:
            out[i] = y
    return out.view(torch.uint8).to(stored.device)


def _rows(staging: torch.Tensor, block_ids) -> list[torch.Tensor]:
    return [staging] if torch.as_tensor(block_ids).dim() == 1 else list(staging)


def pack_pages_fp8_naive(caches: Sequence[torch.Tensor], block_ids) -> torch.Tensor:
    """The FP8 objects of ``block_ids`` (1-D: one, returned 1-D; 2-D: one a row)."""
    raw = pack_pages_naive(caches, block_ids)
    dtype = caches[0].dtype
    return torch.stack([quantize_naive(r, dtype) for r in _rows(raw, block_ids)]).reshape(
        (-1,) if torch.as_tensor(block_ids).dim() == 1 else (raw.shape[0], -1))


def unpack_pages_fp8_naive(staging: torch.Tensor, caches: Sequence[torch.Tensor], block_ids, skip: int = 0) -> None:
    """Decode the FP8 objects in ``staging`` into the pages ``block_ids``; with ``skip`` (1-D ids),
    the object holds ``skip`` leading pages per tensor that are not written."""
    dtype = caches[0].dtype
    raw = torch.stack([dequantize_naive(r, dtype) for r in _rows(staging, block_ids)])
    if skip:
        per_chunk = len(block_ids) + skip
        parts, at = [], 0
        for cache in caches:
            page = cache[0].numel() * cache.element_size()
            parts.append(raw[0, at + skip * page:at + per_chunk * page])
            at += per_chunk * page
        raw = torch.cat(parts)[None]
    unpack_pages_naive(raw.reshape(-1), caches, block_ids)

"""The torch path of the FP8 ops (``backend="torch"``, and CPU tensors without the interpreter),
and the encoding on packed bytes, :func:`quantize_rows` / :func:`dequantize_rows`, that the data
plane runs on host objects (DRAM copies written to SSD, SSD objects prewarmed into DRAM).

The pack gathers the raw object with the pages' torch path and quantizes it; the unpack decodes the
object and scatters it (leading ``skip`` pages dropped). Same bytes as the kernel: the tests hold
both against :mod:`saria.kernels.fp8.naive`. Large objects are encoded a block of groups at a time,
so the float32 temporaries stay bounded.
"""

from __future__ import annotations

import torch

from ...ssd_dtype import FP8_GROUP, FP8_MAX
from ..page_table import PageTable
from ..pages.cpu import pack_pages_torch, unpack_pages_torch

BLOCK_GROUPS = 8192  # groups encoded per step (1 Mi elements: 4 MiB of float32 temporaries)
CANONICAL_NAN = 0x7FC00000  # the one NaN scale stored (float32 bits)
# The one NaN a decoded element is written as, per cache dtype: (bits, integer view).
NAN_BITS = {torch.bfloat16: (0x7FC0, torch.int16), torch.float16: (0x7E00, torch.int16),
            torch.float32: (CANONICAL_NAN, torch.int32)}


def _encode(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Groups ``x`` (float32 ``[groups, 128]``) into ``codes`` (uint8 ``[groups, 128]``) and
    ``scales`` (float32 ``[groups]``), as saria.ssd_dtype says. amax is NaN if the group holds a
    NaN, else inf if it holds an inf (torch's amax propagates NaN; the kernel takes an integer max of
    the magnitudes' bits, which orders them the same way); a group whose scale is not finite and
    positive gets codes 0."""
    amax = x.abs().amax(dim=1)  # a float max: ~4x faster on the CPU than the kernel's integer max
    scale = amax / FP8_MAX
    scale_bits = torch.where(torch.isnan(amax), CANONICAL_NAN, scale.view(torch.int32))
    scales.view(torch.int32).copy_(scale_bits)
    ok = (scale_bits > 0) & (scale_bits < 0x7F800000)
    q = x / torch.where(ok, scale, 1.0)[:, None]
    q = q.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes.copy_(q.masked_fill_(~ok[:, None], 0))


_VALUES: dict[torch.device, torch.Tensor] = {}


def _values(device: torch.device) -> torch.Tensor:
    """float32 value of each e4m3fn code (0x7F / 0xFF: NaN): a table lookup decodes ~1.5x faster on
    the CPU than torch's float8 cast."""
    if device not in _VALUES:
        _VALUES[device] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)
    return _VALUES[device]


def _decode(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (cache dtype ``[groups, 128]``) = ``codes * scale`` in float32, rounded to the cache
    dtype; a NaN comes out as the dtype's positive quiet NaN (one bit pattern, as in the kernel)."""
    y = _values(codes.device).index_select(0, codes.reshape(-1).int()).view(codes.shape) * scales[:, None]
    out.copy_(y)
    nan = torch.isnan(y)
    if nan.any():  # torch's own casts differ (fp32 NaN -> bf16 is 0xFFFF on the CPU in torch 2.13)
        bits, word = NAN_BITS[out.dtype]
        out.view(word).masked_fill_(nan, bits)


def _split(rows: torch.Tensor, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 object region ``[r, fp8 bytes]`` as (codes ``[r, elements]``, scale bytes
    ``[r, 4 * groups]``)."""
    return rows[:, :elements], rows[:, elements:]


@torch.no_grad()
def quantize_rows(raw: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """``raw``: uint8 ``[r, n * element size]`` (packed objects, one a row); ``out``: uint8
    ``[r, n + 4 n / 128]``. Trusts its input (checked by the public ops)."""
    rows, esize = raw.shape[0], torch.empty((), dtype=dtype).element_size()
    n = raw.shape[1] // esize
    groups = n // FP8_GROUP
    codes, scale_bytes = _split(out, n)
    for r in range(rows):
        x = raw[r].view(dtype).view(groups, FP8_GROUP)
        c = codes[r].view(groups, FP8_GROUP)
        s = torch.empty(groups, dtype=torch.float32, device=raw.device)
        for g in range(0, groups, BLOCK_GROUPS):
            _encode(x[g:g + BLOCK_GROUPS].to(torch.float32), c[g:g + BLOCK_GROUPS], s[g:g + BLOCK_GROUPS])
        scale_bytes[r].copy_(s.view(torch.uint8))


@torch.no_grad()
def dequantize_rows(stored: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """``stored``: uint8 ``[r, n + 4 n / 128]``; ``out``: uint8 ``[r, n * element size]``. Trusts its
    input. Scales are read through a copy, so ``stored`` may start at any byte."""
    n = out.shape[1] // torch.empty((), dtype=dtype).element_size()
    groups = n // FP8_GROUP
    codes, scale_bytes = _split(stored, n)
    for r in range(stored.shape[0]):
        c = codes[r].view(groups, FP8_GROUP)
        s = scale_bytes[r].clone().view(torch.float32)
        y = out[r].view(dtype).view(groups, FP8_GROUP)
        for g in range(0, groups, BLOCK_GROUPS):
            _decode(c[g:g + BLOCK_GROUPS], s[g:g + BLOCK_GROUPS], y[g:g + BLOCK_GROUPS])


@torch.no_grad()
def pack_pages_fp8_torch(table: PageTable, ids: torch.Tensor, out: torch.Tensor, chunks: int,
                         per_chunk: int) -> None:
    """Gather the raw objects (the pages' torch path), then quantize them into ``out``."""
    raw = torch.empty(chunks, table.staging_bytes(per_chunk), dtype=torch.uint8, device=table.device)
    pack_pages_torch(table, ids, raw, chunks, per_chunk)
    quantize_rows(raw, table.tensors[0].dtype, out.view(chunks, -1))


@torch.no_grad()
def unpack_pages_fp8_torch(table: PageTable, ids: torch.Tensor, staging: torch.Tensor, chunks: int,
                           per_chunk: int, skip: int) -> None:
    """Decode the objects in ``staging`` (``per_chunk`` pages each) and scatter slots ``skip`` onwards
    into the pages ``ids`` (``chunks * (per_chunk - skip)`` of them)."""
    raw = torch.empty(chunks, table.staging_bytes(per_chunk), dtype=torch.uint8, device=table.device)
    dequantize_rows(staging.view(chunks, -1), table.tensors[0].dtype, raw)
    if skip:
        raw = torch.cat([raw[:, off * per_chunk + skip * seg.page_bytes:(off + seg.page_bytes) * per_chunk]
                         for off, seg in zip(table.tensor_offsets, table.segments)], dim=1)
    unpack_pages_torch(table, ids, raw.contiguous(), chunks, per_chunk - skip)

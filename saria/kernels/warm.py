"""Warming every kernel variant the data plane can launch, on the thread that opens it (the
worker's ``register_kv_caches``: vLLM's main thread), before anything is served
(:mod:`saria.kernels.variants` says why and how a variant is keyed)."""

from __future__ import annotations

from typing import Sequence

import torch

from .backend import INTERPRETED
from .page_table import PageTable


def warm_kernels(kv_table: PageTable, pages_per_chunk: int, *, state_table: PageTable | None = None,
                 state_pages: int = 1, fp8: bool = False, layers: Sequence[Sequence[int]] | None = None,
                 max_programs: int | None = None) -> list[tuple]:
    """Compile every Triton variant the data plane launches for these tables, on this thread: pack
    and unpack of the kv table (and of the state table), the FP8 pack and unpack of the kv table
    with ``fp8`` (``ssd_dtype=fp8``), the layer-wise copies for ``layers`` (tensor indices per
    layer; None: no layer-wise path) capped at ``max_programs``, and on CUDA the checksum. Nothing
    on a device Triton does not run on (the CPU without the interpreter). Returns the variants'
    keys."""
    device = kv_table.device
    if not (device.type == "cuda" and not INTERPRETED or device.type == "cpu" and INTERPRETED):
        return []
    from .checksum import triton as checksum_triton
    from .fp8 import triton as fp8_triton
    from .pages import triton as pages_triton
    from .pages.layered import warm_layered

    # An address like a staging's (its int type, i64, is part of a variant): a host allocation's.
    staging_addr = torch.empty(16, dtype=torch.uint8).data_ptr()
    keys = pages_triton.warm(kv_table, pages_per_chunk, staging_addr)
    if state_table is not None:
        keys += pages_triton.warm(state_table, state_pages, staging_addr)
    if fp8:
        keys += fp8_triton.warm(kv_table, pages_per_chunk, staging_addr)
    if layers is not None:
        keys += warm_layered(kv_table, layers, max_programs)
    if device.type == "cuda":  # on the CPU the checksum runs on torch (saria.kernels.checksum)
        keys += checksum_triton.warm(device)
    return keys

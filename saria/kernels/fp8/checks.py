"""The argument checks of the FP8 ops (ssd_dtype=fp8), on top of :mod:`saria.kernels.checks`:
the element dtype (one across the table: bf16, fp16 or fp32), pages of whole 128-element groups,
FP8 objects and raw objects as uint8 rows, and ``skip``. Each raises one ``ValueError`` (``TypeError``
for a dtype argument that is not a ``torch.dtype``) before anything is written."""

from __future__ import annotations

import torch

from ..checks import PageTable, check_count, check_dense, check_memory

FP8_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp8_dtype(dtype) -> torch.dtype:
    """A cache element dtype that ``ssd_dtype=fp8`` quantizes (bf16, fp16, fp32)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (the cache's element dtype), got {type(dtype).__name__}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"ssd_dtype=fp8 quantizes bf16, fp16 or fp32 caches, got {dtype}")
    return dtype


def check_fp8_table(table: PageTable, group: int) -> torch.dtype:
    """The element dtype of a table whose objects can be stored as FP8: one dtype across the
    tensors (:func:`check_fp8_dtype`), every page a whole number of ``group``-element groups."""
    dtypes = [t.dtype for t in table.tensors]
    if table.element_dtype is None:
        other = next(i for i, d in enumerate(dtypes) if d != dtypes[0])
        raise ValueError(f"ssd_dtype=fp8 needs one element dtype across the table: {table.names[0]} is "
                         f"{dtypes[0]}, {table.names[other]} is {dtypes[other]}")
    check_fp8_dtype(dtypes[0])
    esize = table.tensors[0].element_size()
    for name, seg in zip(table.names, table.segments):
        if (seg.page_bytes // esize) % group:
            raise ValueError(f"{name} has pages of {seg.page_bytes // esize} elements ({seg.page_bytes} bytes); "
                             f"ssd_dtype=fp8 needs a multiple of {group} elements per page")
    return dtypes[0]


def check_fp8_rows(data, what: str, device: torch.device | None = None) -> torch.Tensor:
    """``data`` as ``[rows, bytes]``: a contiguous uint8 tensor, 1-D (one object, one row) or 2-D
    (one object a row), on ``device`` when given, in live memory."""
    check_dense(data, what)
    if data.dtype != torch.uint8:
        raise ValueError(f"{what} must be a uint8 tensor, got {data.dtype}")
    if device is not None and data.device != device:
        raise ValueError(f"{what} is on {data.device} but must be on {device}")
    if not data.is_contiguous() or data.dim() not in (1, 2):
        raise ValueError(f"{what} must be contiguous, 1-D (one object) or 2-D (one object a row), "
                         f"got shape {tuple(data.shape)}")
    check_memory(data, what)
    return data.view(1, -1) if data.dim() == 1 else data


def check_skip(skip, ids_dim: int, ids_per_chunk: int) -> int:
    """``skip`` leading pages of one object (1-D ids) not to unpack: ``pages_per_chunk`` is
    ``ids_per_chunk + skip``."""
    skip = check_count(skip, "skip")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    if skip and ids_dim != 1:
        raise ValueError("skip applies to one object (1-D block_ids); unpack a batch without it")
    if skip and not ids_per_chunk:
        raise ValueError(f"skip={skip} with no block_ids: nothing would be written")
    return skip

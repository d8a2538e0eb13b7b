"""``state_table`` / ``pack_state`` / ``unpack_state``: the public ops. A state object is packed
by the page machinery (:mod:`saria.kernels.pages`: its Triton kernel or its torch path, one
launch) over the table ``[conv_0, temporal_0, conv_1, temporal_1, ...]``, one page per slot."""

from __future__ import annotations

from typing import Sequence

import torch

from ..block_ids import BlockIds
from ..checks import check_state_tensors
from ..page_table import PageTable
from ..pages import pack_pages, unpack_pages


def state_table(temporal: torch.Tensor | Sequence[torch.Tensor],
                conv: torch.Tensor | Sequence[torch.Tensor]) -> PageTable:
    """Validate saria-format GDN state tensors and return their page table (one page = one slot)."""
    temporal, conv = check_state_tensors(temporal, conv)
    return PageTable([x for pair in zip(conv, temporal) for x in pair],
                     names=[f"{name}[{l}]" for l in range(len(conv)) for name in ("conv", "temporal")])


def pack_state(temporal: torch.Tensor | Sequence[torch.Tensor], conv: torch.Tensor | Sequence[torch.Tensor],
               slots: torch.Tensor | BlockIds, out: torch.Tensor | None = None, *,
               backend: str = "auto") -> torch.Tensor:
    """Pack the checkpoints in ``slots`` (1-D ids, or 2-D ``[checkpoints, slots_each]``) of every GDN
    layer into contiguous uint8 staging (layout in :mod:`saria.kernels.state`)."""
    return pack_pages(state_table(temporal, conv), slots, out, backend=backend)


def unpack_state(staging: torch.Tensor, temporal: torch.Tensor | Sequence[torch.Tensor],
                 conv: torch.Tensor | Sequence[torch.Tensor], slots: torch.Tensor | BlockIds, *,
                 backend: str = "auto") -> None:
    """Restore checkpoints packed by :func:`pack_state` into ``slots``, in place."""
    unpack_pages(staging, state_table(temporal, conv), slots, backend=backend)

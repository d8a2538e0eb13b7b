"""The naive reference of ``pack_state`` / ``unpack_state``: the pages' naive reference
(:mod:`saria.kernels.pages.naive`) over the layers in the documented order, conv then temporal
per layer, listed by hand rather than through :func:`~saria.kernels.state_table`. The tests'
oracle; checks nothing."""

from __future__ import annotations

from typing import Sequence

import torch

from ..pages.naive import pack_pages_naive, unpack_pages_naive


def _in_order(temporal, conv) -> list[torch.Tensor]:
    temporal = [temporal] if isinstance(temporal, torch.Tensor) else list(temporal)
    conv = [conv] if isinstance(conv, torch.Tensor) else list(conv)
    order = []
    for layer in range(len(conv)):
        order.append(conv[layer])
        order.append(temporal[layer])
    return order


def pack_state_naive(temporal: torch.Tensor | Sequence[torch.Tensor], conv: torch.Tensor | Sequence[torch.Tensor],
                     slots) -> torch.Tensor:
    """The staging bytes of ``slots`` (1-D: one checkpoint, returned 1-D; 2-D: one row each)."""
    return pack_pages_naive(_in_order(temporal, conv), slots)


def unpack_state_naive(staging: torch.Tensor, temporal: torch.Tensor | Sequence[torch.Tensor],
                       conv: torch.Tensor | Sequence[torch.Tensor], slots) -> None:
    """Write ``staging`` (as :func:`pack_state_naive` lays it out) into ``slots`` of every layer."""
    unpack_pages_naive(staging, _in_order(temporal, conv), slots)

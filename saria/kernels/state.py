"""``pack_state`` / ``unpack_state``: GDN (gated delta net) checkpoints in saria's own format.

For engines that keep recurrent state outside the paged KV cache. Per GDN layer ``l``:

* temporal state ``[slots, HV, V, K]``, fp32 or bf16;
* conv state ``[slots, conv_len, conv_dim]``, any float dtype.

A state object packs the given slots of every layer with the same machinery (and the same single
launch) as :func:`pack_pages`, the table being ``[conv_0, temporal_0, conv_1, temporal_1, ...]``:
conv then temporal per layer, the order of a vLLM GDN page. So for one slot the state object is
``cat_l(conv_l[slot] bytes, temporal_l[slot] bytes)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .page_table import PageTable
from .pages import pack_pages, unpack_pages

TEMPORAL_DTYPES = (torch.float32, torch.bfloat16)


def state_table(temporal: torch.Tensor | Sequence[torch.Tensor],
                conv: torch.Tensor | Sequence[torch.Tensor]) -> PageTable:
    """Validate saria-format GDN state tensors and return their page table (one page = one slot)."""
    temporal, conv = _layers(temporal, "temporal"), _layers(conv, "conv")
    if not temporal:
        raise ValueError("no GDN layers: temporal and conv must hold one tensor per layer")
    if len(temporal) != len(conv):
        raise ValueError(f"{len(temporal)} temporal state tensors but {len(conv)} conv state tensors: "
                         "pass one of each per GDN layer")
    slots = None
    for l, (t, c) in enumerate(zip(temporal, conv)):
        for name, x, dims in (("temporal", t, 4), ("conv", c, 3)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name}[{l}] is a {type(x).__name__}, not a torch.Tensor")
            if x.dim() != dims:
                layout = "[slots, HV, V, K]" if dims == 4 else "[slots, conv_len, conv_dim]"
                raise ValueError(f"{name}[{l}] must be {layout}, got shape {tuple(x.shape)}")
            if slots is None:
                slots = x.shape[0]
            elif x.shape[0] != slots:
                raise ValueError(f"{name}[{l}] has {x.shape[0]} slots, other state tensors {slots}")
        if t.dtype not in TEMPORAL_DTYPES:
            raise ValueError(f"temporal[{l}] has dtype {t.dtype}; GDN temporal state is float32 or bfloat16")
        if not c.dtype.is_floating_point:
            raise ValueError(f"conv[{l}] has dtype {c.dtype}; GDN conv state is a float tensor")
    return PageTable([x for pair in zip(conv, temporal) for x in pair],
                     names=[f"{name}[{l}]" for l in range(len(conv)) for name in ("conv", "temporal")])


def _layers(x, name: str) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    try:
        return list(x)
    except TypeError:
        raise ValueError(f"{name} must be a tensor or a sequence of tensors (one per GDN layer), "
                         f"got {type(x).__name__}") from None


def pack_state(temporal: torch.Tensor | Sequence[torch.Tensor], conv: torch.Tensor | Sequence[torch.Tensor],
               slots: torch.Tensor, out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Pack the checkpoints in ``slots`` (1-D ids, or 2-D ``[checkpoints, slots_each]``) of every GDN
    layer into contiguous uint8 staging (layout in the module docstring)."""
    return pack_pages(state_table(temporal, conv), slots, out, backend=backend)


def unpack_state(staging: torch.Tensor, temporal: torch.Tensor | Sequence[torch.Tensor],
                 conv: torch.Tensor | Sequence[torch.Tensor], slots: torch.Tensor, *,
                 backend: str = "auto") -> None:
    """Restore checkpoints packed by :func:`pack_state` into ``slots``, in place."""
    unpack_pages(staging, state_table(temporal, conv), slots, backend=backend)

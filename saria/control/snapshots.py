"""Read-only snapshots a control plane hands out: one chunk's metadata and the tiers' use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from saria.control.tree import STATUS_NAMES, CacheObject, Node

__all__ = ["ChunkInfo", "CopyInfo", "Usage", "chunk_info"]


@dataclass(frozen=True, slots=True)
class CopyInfo:
    """Where one object is: its DRAM and SSD copy status (``absent``, ``filling``, ``ready``,
    ``draining``, ``bad``) and pin counts."""

    nbytes: int
    dram: str
    ssd: str
    dram_pins: int
    ssd_pins: int


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """A snapshot of one chunk's metadata (``ControlPlane.chunk_info``)."""

    key: Hashable
    depth: int
    parent: Hashable | None
    E_b: int
    R_b: int
    last_reuse: float
    kv: CopyInfo
    state: CopyInfo | None


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes held per tier (the charges of every non-absent copy, whole slots / parts under a
    ``sizing``; on SSD also the recovered objects no request has reached yet) against capacity
    (what the tier holds), and bookkeeping sizes."""

    dram_used: int
    dram_capacity: int
    ssd_used: int
    ssd_capacity: int
    nodes: int
    live_plans: int
    orders_in_flight: int


def chunk_info(node: Node) -> ChunkInfo:
    return ChunkInfo(node.key, node.depth, None if node.parent is None else node.parent.key,
                     node.E_b, node.R_b, node.last_reuse, copy_info(node.kv),
                     None if node.state is None else copy_info(node.state))


def copy_info(obj: CacheObject) -> CopyInfo:
    return CopyInfo(obj.nbytes, STATUS_NAMES[obj.dram], STATUS_NAMES[obj.ssd], obj.dram_pins, obj.ssd_pins)

"""Lazy partial promotion arithmetic (paper Eqs. 2-3).

A reload that read D0 chunks from DRAM and S0 from SSD aims for a DRAM share ``r`` of its chunks,
so after prefill it promotes ``P_target = max(0, r (D0 + S0) - D0)`` of its SSD-hit chunks from HBM
into DRAM (rounded down). ``r`` defaults to ``r* = 1 - B_disk / B_GPU``: DRAM then supplies just
the ingress bandwidth the SSDs leave (see ``saria.config.Bandwidths.auto_promotion_ratio``).
:func:`promotion_groups` picks those chunks; how many of them DRAM can actually take (free space
plus LRU candidates idle for at least ``P_tau``) is ``Residency.promote``'s to cap.
"""

from __future__ import annotations

import math
from typing import Sequence

from saria.control.tree import ABSENT, CacheObject, Node
from saria.orders import SSD, Tier

# r (D0 + S0) is computed in floating point: 0.58 * 100 gives 57.99999999999999. Values this close
# below an integer count as that integer.
_ROUNDING_SLACK = 1e-9


def promotion_target(r: float, dram_chunks: int, ssd_chunks: int) -> int:
    """``P_target`` of paper Eq. 3, in whole chunks, never more than ``ssd_chunks``."""
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"promotion ratio r must be in [0, 1], got {r}")
    if dram_chunks < 0 or ssd_chunks < 0:
        raise ValueError(f"chunk counts must be >= 0, got D0={dram_chunks}, S0={ssd_chunks}")
    target = math.floor(r * (dram_chunks + ssd_chunks) - dram_chunks + _ROUNDING_SLACK)
    return min(max(0, target), ssd_chunks)


def promotion_groups(nodes: Sequence[Node], sources: Sequence[Tier], target: int,
                     loaded_state: CacheObject | None) -> tuple[list[list[CacheObject]], int]:
    """The first ``target`` chunks of a used prefix (``nodes``, read from ``sources``) that came
    from SSD and have no DRAM copy, each as the objects to promote (with ``loaded_state``, the
    checkpoint the plan read from SSD, beside its chunk when it has no DRAM copy either), and
    what they take of DRAM (their charges)."""
    chosen: list[list[CacheObject]] = []
    need = 0
    for node, source in zip(nodes, sources):
        if len(chosen) == target:
            break
        if source is not SSD or node.dram != ABSENT:  # a node is its kv object
            continue
        if loaded_state is not None and node.state is loaded_state and loaded_state.dram == ABSENT:
            chosen.append([node, loaded_state])
            need += node.dram_charge + loaded_state.dram_charge
        else:
            chosen.append([node])
            need += node.dram_charge
    return chosen, need

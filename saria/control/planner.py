"""Reload planning (paper §4.3): the longest reusable prefix and one source per object.

``unified`` lookup (saria): walk the request's chunks while each has a readable kv copy in DRAM
or SSD; each kv object reads from DRAM if it has a copy there, else from SSD, so sources may
alternate (DRAM-SSD-DRAM) and stay in request order.
``tier-prefix`` lookup (LMCache): take chunks from DRAM while DRAM has them, then from SSD while
SSD has them, and stop at the first chunk SSD lacks: a DRAM-only chunk after the switch ends the
prefix.
Hybrid models resume from a GDN checkpoint, so the prefix is then cut back to the deepest chunk
that ends a checkpoint interval and whose state object is readable (DRAM preferred, else SSD).
:func:`reload_plan` turns a prefix (or the part of one a caller still has to load) into a
:class:`ReloadPlan` with its totals.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

from saria.orders import DRAM, SSD, ReloadPlan, Tier
from saria.control.makers import frozen_maker
from saria.control.tree import DRAINING, READY, CacheObject, Node


class Prefix(NamedTuple):
    """``length`` chunks; ``kv_sources[i]`` for chunk i; the state object to load and its source."""

    length: int
    kv_sources: list[Tier]
    state: CacheObject | None
    state_source: Tier | None


def _dram_readable(status: int) -> bool:
    return status == READY or status == DRAINING


def find_prefix(nodes: Sequence[Node | None], *, tier_prefix: bool, hybrid: bool) -> Prefix:
    dram, ssd = DRAM, SSD
    sources: list[Tier] = []
    append = sources.append
    in_dram_phase = True
    state: CacheObject | None = None
    state_source: Tier | None = None
    state_length = 0
    for node in nodes:
        if node is None:
            break
        kv = node  # a node is its kv object
        if tier_prefix:
            if in_dram_phase and _dram_readable(kv.dram):
                append(dram)
            elif kv.ssd == READY:
                in_dram_phase = False
                append(ssd)
            else:
                break
        elif kv.dram == READY or kv.dram == DRAINING:
            append(dram)
        elif kv.ssd == READY:
            append(ssd)
        else:
            break
        if hybrid and node.state is not None:
            candidate = node.state
            if _dram_readable(candidate.dram):
                state, state_source, state_length = candidate, dram, len(sources)
            elif candidate.ssd == READY:
                state, state_source, state_length = candidate, ssd, len(sources)
    if not hybrid:
        return Prefix(len(sources), sources, None, None)
    del sources[state_length:]
    return Prefix(state_length, sources, state, state_source)


def find_and_pin(nodes: Sequence[Node | None], dram_lru: dict, ssd_lru: dict, *, tier_prefix: bool) -> tuple[Tier, ...]:
    """A dense model's plan in one walk: :func:`find_prefix` (``hybrid=False``) and each chunk of
    the prefix pinned in its source tier as it is found (``Residency.pin_all``; ``dram_lru`` and
    ``ssd_lru`` are the tiers' LRUs). Returns the prefix's kv sources."""
    dram, ssd = DRAM, SSD
    sources: list[Tier] = []
    append = sources.append
    in_dram_phase = True
    for node in nodes:
        if node is None:
            break
        status = node.dram
        if (status == READY or status == DRAINING) and (in_dram_phase or not tier_prefix):
            append(dram)
            if node.dram_pins == 0 and status == READY:
                del dram_lru[node]
            node.dram_pins += 1
        elif node.ssd == READY:
            in_dram_phase = False
            append(ssd)
            if node.ssd_pins == 0:
                del ssd_lru[node]
            node.ssd_pins += 1
        else:
            break
    return tuple(sources)


def reload_plan(plan_id: int, chunk_hashes: tuple[Hashable, ...], kv_sources: tuple[Tier, ...],
                state: CacheObject | None, state_source: Tier | None, *, kv_bytes: int, chunk_tokens: int,
                serial: bool, ssd_kv_bytes: int | None = None) -> ReloadPlan:
    """The plan that reads chunks ``chunk_hashes``' kv objects (``kv_bytes`` each in DRAM,
    ``ssd_kv_bytes`` on SSD; None: ``kv_bytes``) from ``kv_sources`` and ``state`` (a checkpoint at
    the last of them, or None) from ``state_source``, with its totals: the tokens of those chunks
    and the bytes read from each tier (SSD bytes as stored there: what the drives deliver)."""
    dram_chunks = kv_sources.count(DRAM)
    dram_bytes = dram_chunks * kv_bytes
    ssd_bytes = (len(kv_sources) - dram_chunks) * (kv_bytes if ssd_kv_bytes is None else ssd_kv_bytes)
    if state is not None:
        if state_source is DRAM:
            dram_bytes += state.nbytes
        else:
            ssd_bytes += state.ssd_nbytes
    return _make_plan(plan_id, chunk_hashes, kv_sources, None if state is None else state.node.key, state_source,
                      len(chunk_hashes) * chunk_tokens, dram_bytes, ssd_bytes, serial)


_make_plan = frozen_maker(ReloadPlan)  # ReloadPlan(...), without the frozen __init__'s per-field stores

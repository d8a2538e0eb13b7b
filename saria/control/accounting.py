"""Hit accounting of a committed request (:func:`count_request`): references, hits per tier,
misses and prewarm hits, into the control plane's :class:`~saria.control.counters.Counters`."""

from __future__ import annotations

from saria.control.counters import Counters
from saria.control.tree import CacheObject, Node
from saria.orders import DRAM, ReloadPlan


def count_request(counters: Counters, nodes: list[Node], plan: ReloadPlan | None, usable: int, kv_bytes: int,
                  state: CacheObject | None, prewarmed: set[CacheObject]) -> None:
    """Count one committed request of chunks ``nodes`` whose ``plan`` delivered its first
    ``usable`` chunks (0: none, a miss for every chunk): references, hits per tier (chunks and
    bytes; ``state``, the plan's checkpoint, when the plan reads one, for hybrid models where
    ``usable`` is the whole plan), misses, and prewarm hits (a chunk a plan reads from DRAM for
    the first time since a prewarm brought it: it leaves ``prewarmed``)."""
    counters.requests += 1
    counters.references += len(nodes)
    if not usable:
        counters.misses += len(nodes)
        return
    dram_hits = plan.kv_sources[:usable].count(DRAM)
    ssd_hits = usable - dram_hits
    counters.hits_dram_chunks += dram_hits
    counters.hits_ssd_chunks += ssd_hits
    counters.misses += len(nodes) - usable
    counters.hits_dram_bytes += dram_hits * kv_bytes
    counters.hits_ssd_bytes += ssd_hits * kv_bytes
    if prewarmed and dram_hits:
        for node, source in zip(nodes[:usable], plan.kv_sources):
            if source is DRAM and node in prewarmed:  # first read since a prewarm brought it
                prewarmed.discard(node)
                counters.prewarm_hits += 1
    if plan.state_source is not None:
        if plan.state_source is DRAM:
            counters.hits_dram_bytes += state.nbytes
        else:
            counters.hits_ssd_bytes += state.nbytes

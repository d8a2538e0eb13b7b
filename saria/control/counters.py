"""Counters of a control plane, as one plain dataclass (``dataclasses.asdict`` makes it JSON).

Units: ``*_chunks`` count chunks (a chunk's kv object decides where it hit), ``*_bytes`` count
payload bytes of every object involved (kv and state), other counts are objects unless named.
Reads and writes count completed payload only (a failed SSD read or write is not counted as bytes).
SSD-side bytes (``ssd_bytes_written``, ``ssd_useful_write_bytes``, ``ssd_bytes_read``,
``prewarm_bytes_read``) are bytes on the drives: a kv object's ``ssd_nbytes``, smaller than its
cache size under ``ssd_dtype="fp8"``. Every other byte count (hits per tier, stores, promotions,
prewarm bytes issued) is the cache's bytes, as the GPU and DRAM hold them: hits do not depend on
the SSD format.
``hits_dram_chunks + hits_ssd_chunks + misses == references`` always.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    # Requests committed and the chunks they referenced.
    requests: int = 0
    references: int = 0
    hits_dram_chunks: int = 0
    hits_ssd_chunks: int = 0
    misses: int = 0
    hits_dram_bytes: int = 0
    hits_ssd_bytes: int = 0
    # Plans handed out (committed or released).
    plans: int = 0
    # GPU -> DRAM copies of new KV after prefill.
    stores: int = 0
    store_bytes: int = 0
    stores_skipped: int = 0      # no DRAM room: everything else was pinned or draining
    stores_failed: int = 0
    # DRAM -> (SSD) eviction and SSD eviction.
    dram_evictions: int = 0
    ssd_evictions: int = 0
    # Write orders issued, by admission reason (objects).
    admissions_eviction: int = 0
    admissions_reuse: int = 0
    admissions_prewrite: int = 0
    admissions_write_through: int = 0
    writes_skipped: int = 0      # admitted, but no SSD room (everything pinned or being written)
    writes_failed: int = 0
    ssd_writes: int = 0          # completed ok
    ssd_bytes_written: int = 0
    ssd_useful_write_bytes: int = 0  # of those, SSD bytes a plan later read from SSD (each write counted once)
    # SSD reads of plans (committed or released).
    ssd_reads: int = 0
    ssd_bytes_read: int = 0
    ssd_read_failures: int = 0
    recovered: int = 0           # SSD objects of a previous run taken over at start (recover_ssd)
    recovered_adopted: int = 0   # of those, reached by a request: now in the context tree
    recovered_dropped: int = 0   # of those, dropped for room, or stale
    # Lazy partial promotion.
    promotions: int = 0          # chunks promoted (orders issued)
    promotion_bytes: int = 0
    promotions_failed: int = 0   # objects
    promotion_evictions: int = 0  # DRAM objects evicted to make room for promotions
    # Prewarming (ControlPlane.prewarm): SSD -> free DRAM ahead of a predicted turn.
    prewarm_orders: int = 0      # PromoteOrders (source SSD) issued
    prewarm_chunks: int = 0      # chunks whose objects they carry
    prewarm_bytes: int = 0       # bytes they carry (issued)
    prewarm_bytes_read: int = 0  # of those, read from SSD and landed in DRAM (completed ok), in SSD bytes
    prewarm_failed: int = 0      # objects
    prewarm_hits: int = 0        # chunks a committed plan read from DRAM, there by a prewarm and unread since
    prewarm_wasted: int = 0      # prewarmed chunks evicted from DRAM before any plan read them
    prewarm_evictions: int = 0   # DRAM objects evicted to make room for hinted prewarms (next_turn_s)
    # The learned admission rule (saria.control.learned): evictions it scored, of those it admitted,
    # those Eq. 1 decided alone while the features drifted off the model's training range, retrains.
    learned_scored: int = 0
    learned_admitted: int = 0
    learned_fallbacks: int = 0
    learned_retrains: int = 0
    # Metadata.
    nodes_created: int = 0
    nodes_reclaimed: int = 0

    @property
    def hits(self) -> int:
        return self.hits_dram_chunks + self.hits_ssd_chunks

    @property
    def admissions(self) -> int:
        return (self.admissions_eviction + self.admissions_reuse + self.admissions_prewrite
                + self.admissions_write_through)

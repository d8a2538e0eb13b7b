"""saria's control plane: what to keep where, what to reload from where, what to write and promote.

Pure Python (never imports torch), deterministic, time passed in by the caller (seconds on any
clock: wall time for an engine, the logical clock for a replay), safe to call from several
threads (one lock per instance). It never touches bytes: it hands out a :class:`ReloadPlan` per
request and orders (plain dataclasses) that the data plane executes, and takes completions back.

Request lifecycle::

    cp = ControlPlane(SariaConfig())                # or SariaConfig.preset("lmcache-plus"), ...
    plan = cp.plan(chunk_hashes, now)               # reusable prefix: plan.tokens, plan.kv_sources
    ... data plane loads plan's objects (pinned until commit or release) ...
    ... prefill computes the rest ...
    orders = cp.commit_prefill(chunk_hashes, now, plan=plan)
    for order in orders:                            # in list order; DropOrders need no completion
        ... execute ...
        follow_up = cp.complete(order.order_id, ok=True, now=later)   # may return DropOrders
    cp.release(plan, now)                           # instead of commit: request aborted / re-planned
    cp.counters()                                   # hits per tier, SSD bytes, admissions, ...

* ``chunk_hashes``: the prefix-chained hashes of the request's full chunks (``chunk_tokens`` each),
  in order. A sequence that contradicts what the tree already knows raises.
* ``plan(chunk_hashes, now) -> ReloadPlan``: the longest prefix whose every chunk has a kv copy in
  DRAM or SSD (``lookup="unified"``; ``"tier-prefix"`` stops at the first chunk found only in DRAM
  after switching to SSD), cut back for hybrid models to the deepest checkpoint boundary whose
  state object is there too. One source per object, DRAM if resident, else SSD. Every object read
  is pinned (not evictable) until the plan is released or committed. Nothing is counted yet:
  plan as often as you like, but release every plan you do not commit.
* ``commit_prefill(chunk_hashes, now, plan=None, failed=()) -> list[Order]``: the request ran;
  counts references and hits, bumps R_b of chunks seen before, releases the plan, stores the new
  KV (objects prefill computed) in DRAM (``StoreOrder``; LRU eviction may emit ``WriteOrder`` for
  admitted chunks and ``DropOrder``), issues write-through / reuse-path writes, lazy partial
  promotion of SSD hits (``PromoteOrder``) and prewrites. ``failed`` names SSD reads of the plan
  that failed: those copies are marked bad and dropped, and the chunks from there on count as
  recomputed (for hybrid models, the whole plan).
* ``complete(order_id, ok, now, failed=()) -> list[Order]``: a store, promotion or write ended;
  ``failed`` names the objects that failed when the rest succeeded. Returns the drops it causes.
* ``release(plan, now, failed=()) -> list[Order]``: unpin a plan that will not be committed.
* ``plan_from(plan, first) -> ReloadPlan``: the part of a live plan from chunk ``first`` on, with
  the totals of those chunks, for a caller that holds the chunks before it (the vLLM connector
  loads only what vLLM did not compute). The same ``plan_id``: release or commit the plan itself.
* ``prewarm(chunk_hashes, now, max_bytes=None) -> list[Order]``: ahead of a context's predicted
  next request (``saria.control.prewarm.GapPredictor``: last completion + EWMA of the session's past
  idle gaps), bring the chunks of its reusable prefix that a plan would read from SSD back into
  DRAM: from the first such chunk, only into free DRAM (never evicting), at most ``max_bytes``
  (None: ``config.prewarm_max_bytes``), stopping at the first that does not fit; hybrid models keep
  the planner's checkpoint rule (the prefix ends at the deepest readable checkpoint, whose state
  object comes along). Returns at most one ``PromoteOrder`` with ``source=Tier.SSD``: the same
  order type and completion path as lazy promotion, its DRAM slots reserved (not readable) and its
  SSD copies pinned until ``complete``. Counts nothing as a reference; ``Counters.prewarm_*``:
  orders, chunks, bytes (issued / read), failed, hits (chunks a committed plan first read from
  DRAM after a prewarm brought them), wasted (prewarmed chunks evicted unread).
* Cache hints from the application (:mod:`saria.control.hints`): ``commit_prefill(..., hints=Hints(...),
  tenant=...)`` applies a request's ``retain_s``, ``pin`` / unpin and ``done`` to its chunks;
  ``turn_ended(chunk_hashes, now, hints, tenant)`` schedules a ``next_turn_s`` prewarm, which
  ``hinted_prewarms(now)`` issues when due (``next_hinted_prewarm()`` says when);
  ``hint_counters()``, ``pins(tenant)``, ``pinned_bytes(tenant)``. Without hints nothing changes.
* ``counters() -> Counters``, ``usage() -> Usage``, ``chunk_info(hash) -> ChunkInfo | None``,
  ``audit() -> list[str]`` (every internal invariant, for tests).
* ``governor -> EnduranceGovernor | None``: with ``config.write_budget.auto`` the control plane
  moves theta_E (and theta_R with it) online to hold SSD writes at the DWPD budget
  (``governor.py``); it updates them at the end of every call from the time passed in and the
  completed write bytes.

Notes for callers:

* Replay (logical clock): per request ``plan`` -> hits per tier are ``plan.kv_sources`` (counted
  at commit); after prefill ``commit_prefill``; complete orders when the simulated transfers end
  (completions may come later and out of order; a slot stays taken until its completion).
* vLLM connector, scheduler side: ``get_num_new_matched_tokens`` -> ``plan(...).tokens`` (release
  the previous plan of a request that is planned again, and any plan of a request that is not
  scheduled); ``request_finished`` -> ``commit_prefill``. Worker side: load ``plan``'s objects
  (DRAM copies may be read while ``draining``), execute the orders. A ``WriteOrder`` with
  ``source=Tier.GPU``, a ``StoreOrder`` and a ``PromoteOrder`` read the request's HBM blocks, so
  the blocks must not be freed before they ran (``request_finished`` returns True until then),
  except a prewarm's ``PromoteOrder`` (``source=Tier.SSD``), which reads SSD, not HBM. The
  scheduler side issues prewarms by itself at each step (``saria.integrations.vllm.prewarm``).
* Hashes: one per full chunk (``chunk_tokens`` tokens), prefix-chained; any hashable works.
* Capacity: a control plane that drives a data plane is built with that data plane's layout,
  ``ControlPlane(config, sizing=saria.sizing.size_tiers(config, drives))`` (``TieredCache`` and the
  connector's scheduler do): each object is charged its whole host slots and SSD parts against
  what the host pool and the drive files hold, so everything it admits fits there. Without
  ``sizing`` (a replay) an object charges its size against the configured capacity.

Bad input (unknown or finished ids, a plan that does not begin the committed hashes, failures
naming objects the plan or order does not have, non-finite ``now``) raises
:class:`ControlPlaneError` (a ``ValueError``) before anything changes.

Modules, one job each: ``tree`` (context tree, evidence, metadata window), ``admission`` (Eq. 1
and the rules of ``Policy.admission``), ``sessions`` (sessions found in the chunk hashes, and the
learned return rates of evicted chunks), ``residency`` (tier capacity, LRU, eviction, pins, copy
states; what a call decided, as ``PendingChanges``), ``planner`` (reload prefix and sources, a
plan's totals), ``plans`` (live plans, their failed reads, ending them), ``placement`` (store,
writes, promotion and prewrite after prefill), ``promotion`` (Eqs. 2-3 and the chunks promoted),
``prewarm`` (the next-turn predictor and the chunks a prewarm reads), ``hints`` (the
application's cache hints), ``recovery`` (a previous
run's SSD objects), ``emission`` (ids, decisions into orders, orders in flight), ``governor``
(theta_E against a write budget), ``counters`` (and a request's hit accounting), ``checks``
(argument checks), ``snapshots`` (``ChunkInfo``, ``Usage``), ``audit``, and ``plane`` (the
:class:`ControlPlane` that runs a request through them). Plans and orders live in
:mod:`saria.orders`, the contract the data plane imports too; they are re-exported here.
"""

from saria.control.counters import Counters
from saria.control.governor import EnduranceGovernor
from saria.orders import (ControlPlaneError, DropOrder, ObjectKey, Order, PromoteOrder, ReloadPlan,
                                  StoreOrder, Tier, WriteOrder)
from saria.control.plane import ChunkInfo, ControlPlane, CopyInfo, Usage
from saria.control.promotion import promotion_target

__all__ = ["ChunkInfo", "ControlPlane", "ControlPlaneError", "CopyInfo", "Counters", "DropOrder", "EnduranceGovernor",
           "ObjectKey", "Order", "PromoteOrder", "ReloadPlan", "StoreOrder", "Tier", "Usage", "WriteOrder",
           "promotion_target"]

"""The connector's cluster tier on a worker rank: reloads from Mooncake Store and puts into it.

The scheduler looks up the chunks after a request's local plan in the cluster
(:class:`~saria.dataplane.cluster.index.ClusterIndex`) and sends them with the load
(``LoadSpec.cluster``); it names the chunks to share with the orders (``RequestOrders.share``).
This rank executes both with its :class:`~saria.dataplane.cluster.ClusterStore`, whose memory is
the host pool (registered once):

* **Reloads** (:class:`~.cluster_loads.ClusterLoad`, on this tier's store and staging budget): each
  chunk's object is fetched into *staging* slots, host slots beyond the DRAM tier's
  (``cluster_staging_bytes``) that the control plane never places objects in, verified part by
  part, then published under a key of its own in the DRAM index and reloaded by the DRAM path into
  the request's blocks, and dropped. With a ``sealer`` the store registers only its own ciphertext
  buffers with Mooncake, never the host pool: Mooncake lands the ciphertext there, and the staging
  slots receive the plaintext from the store's decryption alone (the tag verified first), so what
  is unpacked into vLLM's pages comes from private memory. The unpack starts from the caller's
  thread (``ready`` / ``wait``, which vLLM's hooks call), so it queues behind the caller's work
  like any reload. The leading chunks that arrived are valid; from the first miss on (absent,
  evicted, corrupt, timed out, the tier off, no staging room) vLLM recomputes. A miss is never an
  error: it is counted and reported as ``cluster_failed``, and the control plane never hears of it.
* **Puts** (``all``): once a store lands a chunk's object in DRAM, it is put from its slots (no
  copy, the store's per-slot checksums passed along). A DRAM drop of an object whose put is in
  flight waits for the put first (:meth:`WorkerCluster.before_drop`), so Mooncake never reads a
  freed slot (sealed: the store seals from the slots into its own buffers, and the same wait keeps
  a slot from being freed while it does). ``evicted``: a chunk is put when its DRAM copy is dropped, and the drop waits for it.
* A failed put is counted and forgotten: the object is simply not in the cluster.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Sequence

from saria.dataplane.cluster import ClusterStore, ClusterTimeout
from saria.dataplane.devices import bind_thread
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.transfer.engine import TransferEngine
from saria.orders import KV, ObjectKey
from saria.seal import Sealer

log = logging.getLogger("saria.vllm")

class WorkerCluster:
    """One rank's cluster tier (module docstring): its store, staging budget, puts in flight and
    counters. ``identity``: what this rank's objects are written for (its SSD identity without the
    SSD's storage form: cluster objects are the exact packed bytes of the DRAM tier). ``sealer``:
    seal every object (``Sealer(keyring, "cluster", identity)``, docs/cluster.md "Sealed objects");
    ``None``: plain objects."""

    def __init__(self, engine: TransferEngine, master: str, identity: str, *, staging_bytes: int,
                 local_hostname: str = "127.0.0.1", timeout_s: float = 5.0, setup_wait_s: float = 10.0,
                 store: ClusterStore | None = None, sealer: Sealer | None = None):
        self.engine = engine
        pool = engine.host_pool
        self.slots_per_object = pool.slots_for(engine.kv_bytes)
        self.staging_slots = staging_bytes // pool.slot_bytes
        self.timeout_s = timeout_s
        self.store = store or ClusterStore(master, identity, pool, local_hostname=local_hostname, timeout_s=timeout_s,
                                           setup_wait_s=setup_wait_s, sealer=sealer,
                                           device=engine.device)
        self._lock = threading.Lock()
        self._staged = 0  # staging slots taken
        self._puts: dict[ObjectKey, threading.Event] = {}  # objects whose put is in flight
        self.counts = dict(loads=0, chunks_asked=0, chunks_loaded=0, chunks_missed=0, no_staging=0, shares=0,
                           shared=0, share_failed=0, drop_waits=0)

    @property
    def layout_identity(self) -> str:
        return self.store.layout_identity

    @property
    def sealed(self) -> bool:
        """Whether this rank's cluster objects are sealed."""
        return self.store.sealed

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self.counts[name] += n

    # --- staging, for reloads (.cluster_loads) ----------------------------------------------------

    def _take_staging(self, objects: int) -> int:
        """Reserve staging for up to ``objects`` objects; how many it has room for."""
        with self._lock:
            n = min(objects, (self.staging_slots - self._staged) // self.slots_per_object)
            self._staged += n * self.slots_per_object
            return n

    def _return_budget(self, objects: int) -> None:
        with self._lock:
            self._staged -= objects * self.slots_per_object

    # --- puts ------------------------------------------------------------------------------------

    def share_after(self, keys: Sequence[ObjectKey], completion: Future) -> None:
        """Put ``keys`` once the store whose ``completion`` this is lands them in DRAM (objects it
        failed are skipped). Registered now, so a drop issued later waits for the put."""
        keys = [k for k in keys if k.kind == KV]
        if not keys:
            return
        events = self._register(keys)
        completion.add_done_callback(lambda f: self._put_landed(keys, events, f))

    def share_now(self, keys: Sequence[ObjectKey]) -> None:
        """Put the DRAM objects ``keys`` and wait until Mooncake no longer reads them (``evicted``:
        their drop follows)."""
        keys = [k for k in keys if k.kind == KV]
        if keys:
            events = self._register(keys)
            self._put(keys, events)
            for event in events.values():
                event.wait()

    def before_drop(self, keys: Sequence[ObjectKey]) -> None:
        """Wait until no put reads these objects' slots (their drop frees them)."""
        with self._lock:
            pending = [self._puts[k] for k in keys if k in self._puts]
        if pending:
            self._count(drop_waits=1)
        for event in pending:
            event.wait()

    def quiesce(self) -> None:
        """Wait for every put in flight (before dropping everything, or closing)."""
        with self._lock:
            pending = list(self._puts.values())
        for event in pending:
            event.wait()

    def _register(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, threading.Event]:
        events = {key: threading.Event() for key in keys}
        with self._lock:
            self._puts.update(events)
            self.counts["shares"] += len(keys)
        return events

    def _done(self, key: ObjectKey, event: threading.Event, ok: bool) -> None:
        with self._lock:
            if self._puts.get(key) is event:
                del self._puts[key]
            self.counts["shared" if ok else "share_failed"] += 1
        event.set()

    def _put_landed(self, keys: list[ObjectKey], events: dict[ObjectKey, threading.Event], done: Future) -> None:
        try:
            completion = done.result()
            failed = set(completion.failed)
            landed = [k for k in keys if k not in failed] if completion.ok or failed else []
        except BaseException:  # noqa: BLE001 - the store failed: nothing to put
            landed = []
        for key in keys:
            if key not in landed:
                self._done(key, events[key], False)
        if landed:
            self._put(landed, events)

    def _put(self, keys: list[ObjectKey], events: dict[ObjectKey, threading.Event]) -> None:
        """Put the DRAM objects ``keys``; each event is set once Mooncake no longer reads its slots."""
        dram = self.engine.dram
        names, views, sums, sent = [], [], [], []
        for key in keys:
            obj = dram.get(key)
            if obj is None:  # dropped already (by a drop that did not wait: never, but not served then)
                self._done(key, events[key], False)
                continue
            parts = dram.views(obj)
            names.append(object_key(key.chunk, key.kind))
            views.append(parts)
            sums.append(list(obj.checksums) if len(obj.checksums) == len(parts) and not self.store.sealed else None)
            sent.append(key)
        if not sent:
            return
        try:
            futures = self.store.put_many(names, views, sums)
        except Exception as exc:  # noqa: BLE001 - a put that cannot start shares nothing
            log.warning("saria: cluster put of %d object(s) not started: %s", len(sent), exc)
            for key in sent:
                self._done(key, events[key], False)
            return
        for key, future in zip(sent, futures):
            future.add_done_callback(lambda f, key=key: self._put_ended(key, events[key], f))

    def _put_ended(self, key: ObjectKey, event: threading.Event, future: Future) -> None:
        exc = future.exception()
        if isinstance(exc, ClusterTimeout):  # Mooncake may still read the slots: wait for its call
            threading.Thread(target=self._done_when, args=(exc.released, key, event),
                             daemon=True, name="saria-cluster-released").start()
            return
        self._done(key, event, exc is None)

    def _done_when(self, released: threading.Event, key: ObjectKey, event: threading.Event) -> None:
        bind_thread(self.engine.device)
        released.wait()
        self._done(key, event, False)

    # --- counters, closing -----------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        with self._lock:
            out = dict(self.counts, staged_slots=self._staged, puts_in_flight=len(self._puts))
        out["store"] = self.store.counters()
        out["on"] = self.store.on
        return out

    def close(self) -> None:
        self.quiesce()
        self.store.close()

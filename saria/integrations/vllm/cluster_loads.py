"""A rank's reloads from the cluster tier (:mod:`.cluster`): the cluster chunks of one reload
(:class:`ClusterLoad`: gets into staging slots, then one DRAM-path reload of what arrived) and a
reload of a local plan followed by cluster chunks (:class:`CombinedLoad`), as one job to wait on.

With a sealed store the staging slots are private memory (the store registers only its own
ciphertext buffers with Mooncake): a get resolves only once every part's tag verified and its
plaintext was written into the slots by the store's decryption, and only then are they published
and unpacked into vLLM's pages. A miss (an unauthentic object too) publishes nothing; a timed-out
get's slots are freed only once its call and its decryption ended (``released``)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from saria.dataplane.cluster import ClusterTimeout
from saria.dataplane.devices import bind_thread
from saria.dataplane.dram.host_pool import HostPoolFull
from saria.dataplane.dram.store import DramObject
from saria.dataplane.ssd.keys import object_key
from saria.orders import KV, ObjectKey, ReloadPlan, Tier

from .cluster import WorkerCluster

log = logging.getLogger("saria.vllm")

STAGED = "saria-cluster"  # staged objects live in the DRAM index as ObjectKey((STAGED, chunk), "kv")


def staged_key(chunk: Hashable) -> ObjectKey:
    return ObjectKey((STAGED, chunk), KV)


class ClusterLoad:
    """The cluster chunks of one reload (module docstring): gets into staging slots, then one
    DRAM-path reload of the leading chunks that arrived, started at once: ``chunks`` (in request
    order) for the pages ``blocks``, the first ``skip`` pages of the first chunk left out.
    ``ready()`` never blocks; ``wait()`` does. Both give the result once known: ``(valid,
    missed)``, the leading chunks now in their pages and how many of the chunks did not arrive."""

    def __init__(self, tier: WorkerCluster, chunks: Sequence[Hashable], blocks: Sequence[Sequence[int]],
                 skip: int = 0):
        chunks, blocks = list(chunks), [tuple(b) for b in blocks]
        if len(chunks) != len(blocks):
            raise ValueError(f"{len(chunks)} cluster chunks but {len(blocks)} block lists")
        self.tier = tier
        self.chunks = chunks
        self.blocks = blocks
        self.skip = skip
        self._slots: list[list[int]] = []
        self._futures: list[Future] = []
        self._job: Any = None
        self._published: list[Hashable] = []
        self._result: tuple[int, int] | None = None
        tier._count(loads=1, chunks_asked=len(chunks))
        self._start()

    def _start(self) -> None:
        tier, pool = self.tier, self.tier.engine.host_pool
        room = tier._take_staging(len(self.chunks))
        if room < len(self.chunks):
            tier._count(no_staging=1)
        try:
            for _ in range(room):
                self._slots.append(pool.allocate(tier.slots_per_object))
        except HostPoolFull:
            pass
        tier._return_budget(room - len(self._slots))
        if not self._slots:
            return
        nbytes = tier.engine.kv_bytes
        keys = [object_key(chunk, KV) for chunk in self.chunks[:len(self._slots)]]
        outs = [pool.views(slots, nbytes) for slots in self._slots]
        try:
            self._futures = tier.store.get_many(keys, outs)
        except Exception as exc:  # noqa: BLE001 - a get that cannot start loads nothing
            log.warning("saria: cluster get of %d object(s) not started: %s", len(keys), exc)
            self._release(range(len(self._slots)))
            self._slots = []

    def ready(self) -> bool:
        if self._result is not None:
            return True
        if not all(f.done() for f in self._futures):
            return False
        if self._job is None and not self._unpack():
            return True
        if not self._job.ready():
            return False
        self._finish()
        return True

    def wait(self) -> tuple[int, int]:
        if self._result is None:
            wait_futures(self._futures)
            if self._job is not None or self._unpack():
                self._job.wait()
                self._finish()
        return self._result

    def wait_on(self, streams) -> None:
        """Wait for the gets (network reads: host work), start the reload of what arrived and make
        ``streams``' current stream wait for it: the host never waits for the device."""
        if self._result is None:
            wait_futures(self._futures)
            if self._job is not None or self._unpack():
                self._job.wait_on(streams)

    def outcome(self) -> tuple[int, int]:
        """:meth:`wait` without waiting for the device (the caller's stream waits for the reload:
        :meth:`wait_on`): the result is known once the reload is issued; the staged objects are
        dropped once it ran (the engine's retire thread)."""
        if self._result is None:
            wait_futures(self._futures)
            if self._job is not None or self._unpack():
                result = self._job.outcome()
                published, self._published = self._published, []
                self._count_end(result.valid_chunks if result.failed else len(published))
                self.tier.engine.retire(self._job.events, lambda: self._drop_staged(published))
        return self._result

    def _unpack(self) -> bool:
        """Every get ended: reload the leading objects that arrived (from the caller's thread);
        whether a reload started (else the result is known)."""
        arrived = 0
        while arrived < len(self._futures) and self._futures[arrived].exception() is None:
            arrived += 1
        self._release(range(arrived, len(self._futures)))
        engine, dram = self.tier.engine, self.tier.engine.dram
        if arrived:
            for chunk, slots in zip(self.chunks, self._slots[:arrived]):
                dram.put(staged_key(chunk), DramObject(slots, engine.kv_bytes, ()))
                self._published.append(chunk)
            staged = tuple(staged_key(c).chunk for c in self._published)
            plan = ReloadPlan(-1, staged, (Tier.DRAM,) * arrived, None, None, 0, arrived * engine.kv_bytes, 0, False)
            try:
                self._job = engine.load(plan, self.blocks[:arrived], skip_pages=self.skip)
                return True
            except Exception as exc:  # noqa: BLE001 - the engine started nothing: every chunk is a miss
                log.warning("saria: cluster reload not started: %s", exc)
        self._end(0)
        return False

    def _finish(self) -> None:
        result = self._job.wait()
        self._end(result.valid_chunks if result.failed else len(self._published))

    def _end(self, valid: int) -> None:
        published, self._published = self._published, []
        self._drop_staged(published)
        self._count_end(valid)

    def _drop_staged(self, published: list[Hashable]) -> None:
        """The staged objects of ``published`` chunks go (nothing reads their slots any more)."""
        dram = self.tier.engine.dram
        for chunk in published:
            dram.drop(staged_key(chunk))
        self.tier._return_budget(len(published))

    def _count_end(self, valid: int) -> None:
        missed = len(self.chunks) - valid
        self.tier._count(chunks_loaded=valid, chunks_missed=missed)
        self._result = (valid, missed)

    def _release(self, indices) -> None:
        """Give back the staging of objects that will not be reloaded (after a timed-out get, once
        Mooncake's call returned: it may still write them until then)."""
        for i in indices:
            slots = self._slots[i]
            exc = self._futures[i].exception() if i < len(self._futures) else None
            if isinstance(exc, ClusterTimeout) and not exc.released.is_set():
                threading.Thread(target=self._release_later, args=(exc.released, slots), daemon=True,
                                 name="saria-cluster-released").start()
            else:
                self._free(slots)

    def _release_later(self, released: threading.Event, slots: list[int]) -> None:
        bind_thread(self.tier.engine.device)
        released.wait()
        self._free(slots)

    def _free(self, slots: list[int]) -> None:
        self.tier.engine.host_pool.free(slots)
        self.tier._return_budget(1)


@dataclass(frozen=True)
class LoadOutcome:
    """How a reload with cluster chunks ended: the local plan's failed objects (for the control
    plane), the leading chunks of the whole load in their pages, and the cluster chunks missed."""

    failed: tuple[ObjectKey, ...]
    valid_chunks: int
    cluster_failed: int


class CombinedLoad:
    """A reload of a local plan's chunks (``local``: the engine's job, ``None`` when the plan names
    none that vLLM lacks) followed by cluster chunks (``cluster``), as one job to wait on."""

    def __init__(self, local: Any, local_chunks: int, cluster: ClusterLoad):
        self.local = local
        self.local_chunks = local_chunks
        self.cluster = cluster

    def ready(self) -> bool:
        return (self.local is None or self.local.ready()) and self.cluster.ready()

    def wait(self) -> LoadOutcome:
        return self._combine(self.local.wait() if self.local is not None else None, self.cluster.wait())

    def wait_on(self, streams) -> None:
        """The caller's stream waits for both parts (:meth:`LoadJob.wait_on`, :meth:`ClusterLoad.wait_on`)."""
        if self.local is not None:
            self.local.wait_on(streams)
        self.cluster.wait_on(streams)

    def outcome(self) -> LoadOutcome:
        """:meth:`wait` without waiting for the device (the caller's stream waits for the copies)."""
        return self._combine(self.local.outcome() if self.local is not None else None, self.cluster.outcome())

    def _combine(self, local, cluster: tuple[int, int]) -> LoadOutcome:
        failed, valid = (), 0
        if local is not None:
            failed, valid = local.failed, local.valid_chunks
        loaded, missed = cluster
        if valid == self.local_chunks:  # the cluster chunks follow an intact local part
            valid += loaded
        return LoadOutcome(failed, valid, missed)

"""A sealed store's batches: the put and get protocols of sealed objects (docs/cluster.md "Sealed
objects"; the layout is :mod:`.sealed`).

Plaintext never enters memory Mooncake can read or write. A sealed store registers with Mooncake
only its workers' metadata arenas and ciphertext buffers, never the host memory the objects come
from and go to, so a get's destinations (the connector's staging slots) are private:

* **put**: one ``batch_is_exist`` of the metadata; an object whose metadata is there is checked
  before it is skipped (its parts would be new values, the old ones left behind): its metadata is
  fetched with the size this object's metadata has (``batch_get_into``, as a get does) and opened,
  and the parts it names must all exist. Only then is it not written again (``present``); metadata
  that does not open (junk, another key file's, an epoch this key file lacks), names other part
  lengths or parts that are gone is replaced: the object is written (``rewritten``), so junk under
  a name never blocks its chunk from being cached. Then the parts in runs that fill a
  ciphertext buffer: a run is sealed (``Sealer.seal_into``, from the source views into the buffer,
  on a verifier thread) while the previous run is on the wire (``batch_put_from`` from the
  buffer), the two buffers alternating; then one ``batch_upsert_from`` of the sealed metadata of
  the objects whose parts all went in (the commit).
* **get**: one ``batch_get_into`` of the metadata into the arena, each opened (a value that does
  not authenticate, names another key file or disagrees with its destination is a miss); then the
  parts' ciphertext in runs into the two buffers alternately, each run opened
  (``Sealer.open_into``: the GCM tag verified, the plaintext written into the destination) on a
  verifier thread while the next run is on the wire. No checksum is computed or verified: the tag
  is the check, one pass over the bytes.

A failed tag, a value of the wrong size, another key file's metadata: :class:`ObjectUnauthentic`
(``auth_failures``); an epoch the key file lacks: :class:`ObjectUnknownEpoch` (``unknown_epoch``).
Either way the object is a miss, its destination zeroed, never bytes; an unauthentic object (and
one of a retired epoch) is dropped from Mooncake. Messages name objects by their place in the
batch: an object key holds a chunk id.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from saria.dataplane.cluster.errors import (ClusterMiss, ClusterOff, ClusterWriteError, ObjectAbsent, ObjectCorrupt,
                                            ObjectUnauthentic, ObjectUnknownEpoch)
from saria.dataplane.cluster.jobs import BUFFER_OVERFLOW, OBJECT_NOT_FOUND, Batch, Workspace
from saria.dataplane.cluster.sealed import V2, TAG_BYTES, SealedMeta, epoch_of, new_write_id, sealed_meta_bytes
from saria.seal import SealedPart, SealError, SealFailure, Unauthentic, UnknownEpoch

Run = list[tuple[int, int, int]]  # (object, part, offset in the ciphertext buffer)


class SealedBatch(Batch):
    """A batch of a sealed store (module docstring)."""

    def name(self, i: int) -> str:
        return f"sealed object {i} of the batch"

    def _runs(self, parts: list[tuple[int, int]], workspace: Workspace) -> list[Run]:
        """``parts`` packed, in order, into runs that each fill one ciphertext buffer."""
        room = workspace.cipher[0].numel()
        runs: list[Run] = []
        off = room
        for i, j in parts:
            size = self.views[i][j].numel() + TAG_BYTES
            if off + size > room:
                runs.append([])
                off = 0
            runs[-1].append((i, j, off))
            off += size
        return runs

    def _unknown_epoch(self, i: int, epoch: int) -> ObjectUnknownEpoch:
        retired = epoch < min(self.store._sealer.keyring.epochs)
        return ObjectUnknownEpoch(f"{self.name(i)} was sealed under key epoch {epoch}, which the key file "
                                  f"{'no longer holds (retired)' if retired else 'does not hold'}", retired=retired)

    @staticmethod
    def _wait(pending: list[Future | None]) -> None:
        """Let the sealing or opening jobs still running end (they use this worker's buffers and the
        caller's views); their failures are the caller's to collect, not raised here."""
        wait_futures([f for f in pending if f is not None])

    # ------------------------------------------------------------------------ put

    def _seal_run(self, run: Run, buf: Any, write_ids: dict[int, bytes],
                  lengths: dict[int, int]) -> tuple[dict[tuple[int, int], SealedPart], dict[int, ClusterMiss]]:
        sealer, layout = self.store._sealer, self.store._layout
        data = buf.numpy()
        sealed: dict[tuple[int, int], SealedPart] = {}
        failed: dict[int, ClusterMiss] = {}
        for i, j, off in run:
            if i in failed:
                continue
            v = self.views[i][j]
            n = v.numel()
            ctx = layout.part_context(self.keys[i], j, len(self.views[i]), lengths[i], n)
            try:
                sealed[i, j] = sealer.seal_into(ctx, v.numpy(), data[off:off + n + TAG_BYTES])
            except SealError as exc:
                failed[i] = ClusterWriteError(f"sealing a part of {self.name(i)} failed: {exc}")
        return sealed, failed

    def _sound(self, client: Any, workspace: Workspace, found: list[int]) -> set[int] | None:
        """Which of the objects ``found`` (their metadata exists) are sound in the cluster: their
        metadata, fetched with the size theirs has, opens under this key file and names parts of
        their lengths that all exist. ``None`` when the master is unreachable."""
        store, layout = self.store, self.store._layout
        sizes = [layout.meta_bytes(len(self.views[i])) for i in found]
        offsets = list(itertools.accumulate(sizes, initial=0))
        arena = workspace.arena
        codes = client.batch_get_into([layout.meta_key(self.keys[i]) for i in found],
                                      [arena.data_ptr() + o for o in offsets[:-1]], sizes)
        if store._conn.check(codes, "batch_get_into"):
            return None
        values = arena.numpy()
        opened: dict[int, SealedMeta] = {}
        for n, (i, code) in enumerate(zip(found, codes)):
            if code not in (sizes[n], sealed_meta_bytes(len(self.views[i]), V2)):
                continue  # gone since, or junk of another size (a larger one is not even fetched)
            try:
                meta = layout.open_meta(store._sealer, self.keys[i], values[offsets[n]:offsets[n] + code])
            except SealFailure:
                continue
            if [p[0] for p in meta.parts] == [v.numel() for v in self.views[i]]:
                opened[i] = meta
        parts = [(i, pk) for i, meta in opened.items() for pk in layout.part_keys(self.keys[i], meta)]
        codes = client.batch_is_exist([pk for _, pk in parts]) if parts else []
        if store._conn.check(codes, "batch_is_exist"):
            return None
        sound = set(opened)
        for (i, _), code in zip(parts, codes):
            if code != 1:
                sound.discard(i)
        return sound

    def _put(self, client: Any, workspace: Workspace) -> None:
        store, layout = self.store, self.store._layout
        t0 = time.perf_counter()
        codes = client.batch_is_exist([layout.meta_key(k) for k in self.keys])
        if store._conn.check(codes, "batch_is_exist"):
            return self.fail_all(ClusterOff, "master unreachable during put", -900)
        found = [i for i, code in enumerate(codes) if code == 1]
        sound = self._sound(client, workspace, found) if found else set()
        if sound is None:
            return self.fail_all(ClusterOff, "master unreachable during put", -900)
        if len(sound) < len(found):
            store._counters.add(rewritten=len(found) - len(sound))
        todo = []
        for i in range(len(self.keys)):
            if i in sound:  # there already, and sound (a get that finds it wrong drops it)
                if self.settle(i, sum(v.numel() for v in self.views[i])):
                    store._counters.add(present=1)
            else:
                todo.append(i)
        if not todo:
            return
        write_ids = {i: new_write_id() for i in todo}
        lengths = {i: sum(v.numel() for v in self.views[i]) for i in todo}
        runs = self._runs([(i, j) for i in todo for j in range(len(self.views[i]))], workspace)
        sealed: dict[tuple[int, int], SealedPart] = {}
        bad: dict[int, ClusterMiss] = {}
        pending: Future | None = store._verifier.submit(self._seal_run, runs[0], workspace.cipher[0], write_ids,
                                                       lengths)
        try:
            for k, run in enumerate(runs):
                done, failures = pending.result()
                pending = None
                sealed.update(done)
                for i, miss in failures.items():
                    bad.setdefault(i, miss)
                if k + 1 < len(runs):  # sealed into the other buffer while this run is on the wire
                    pending = store._verifier.submit(self._seal_run, runs[k + 1], workspace.cipher[(k + 1) % 2],
                                                     write_ids, lengths)
                buf = workspace.cipher[k % 2]
                keys, ptrs, sizes, owner = [], [], [], []
                for i, j, off in run:
                    if i not in bad:
                        keys.append(layout.part_key(self.keys[i], j, write_ids[i]))
                        ptrs.append(buf.data_ptr() + off)
                        sizes.append(self.views[i][j].numel() + TAG_BYTES)
                        owner.append(i)
                if not keys:
                    continue
                codes = client.batch_put_from(keys, ptrs, sizes)
                if store._conn.check(codes, "batch_put_from"):
                    return self.fail_all(ClusterOff, "master unreachable during put", -900)
                for i, code in zip(owner, codes):
                    if code != 0:
                        bad.setdefault(i, ClusterWriteError(f"Mooncake refused a part of {self.name(i)}", code))
        finally:
            self._wait([pending])
        for i, miss in bad.items():
            self.settle(i, miss=miss)
        good = [i for i in todo if i not in bad]
        with self.lock:
            if self.timed_out or not good:
                return
        arena = workspace.arena.numpy()
        mkeys, mptrs, msizes, committed, off = [], [], [], [], 0
        for i in good:
            meta = SealedMeta(lengths[i], write_ids[i],
                              tuple((v.numel(), sealed[i, j].epoch, sealed[i, j].nonce) for j, v in enumerate(self.views[i])))
            size = layout.meta_bytes(len(meta.parts))
            try:
                layout.seal_meta(store._sealer, self.keys[i], meta, arena[off:off + size])
            except SealError as exc:
                self.settle(i, miss=ClusterWriteError(f"sealing the metadata of {self.name(i)} failed: {exc}"))
                continue
            mkeys.append(layout.meta_key(self.keys[i]))
            mptrs.append(workspace.arena.data_ptr() + off)
            msizes.append(size)
            committed.append(i)
            off += size
        codes = client.batch_upsert_from(mkeys, mptrs, msizes) if mkeys else []
        store._counters.add(put_seconds=time.perf_counter() - t0)
        if store._conn.check(codes, "batch_upsert_from"):
            return self.fail_all(ClusterOff, "master unreachable during put", -900)
        for i, code in zip(committed, codes):
            if code != 0:
                self.settle(i, miss=ClusterWriteError(f"Mooncake refused the metadata of {self.name(i)}", code))
            elif self.settle(i, lengths[i]):
                store._counters.add(puts=1, put_bytes=lengths[i])

    # ------------------------------------------------------------------------ get

    def _open_meta(self, i: int, value: Any) -> SealedMeta | ClusterMiss:
        layout, sealer = self.store._layout, self.store._sealer
        try:
            meta = layout.open_meta(sealer, self.keys[i], value)
        except UnknownEpoch:
            return self._unknown_epoch(i, epoch_of(value))  # the clear epoch
        except Unauthentic as exc:
            return ObjectUnauthentic(f"{self.name(i)}: {exc}")
        if [p[0] for p in meta.parts] != [v.numel() for v in self.views[i]]:
            return ObjectCorrupt(f"{self.name(i)}: its part lengths are not its destination's")
        return meta

    def _open_run(self, run: Run, buf: Any, metas: dict[int, SealedMeta]) -> dict[int, ClusterMiss]:
        """Open each part of ``run`` (ciphertext in ``buf``) into its destination; the objects that
        fail (their parts' destinations are left zeroed by ``open_into``). Last part first: the
        bytes that arrived last are the likeliest to be in the cache still (a quarter less CPU
        measured with 32 MiB runs)."""
        sealer, layout = self.store._sealer, self.store._layout
        data = buf.numpy()
        failed: dict[int, ClusterMiss] = {}
        for i, j, off in reversed(run):
            if i in failed:
                continue
            meta = metas[i]
            n, epoch, nonce = meta.parts[j]
            ctx = layout.part_context(self.keys[i], j, len(meta.parts), meta.length, n)
            try:
                sealer.open_into(ctx, SealedPart(epoch, nonce, b""), data[off:off + n + TAG_BYTES],
                                 self.views[i][j].numpy())
            except UnknownEpoch:
                failed[i] = self._unknown_epoch(i, epoch)
            except Unauthentic:
                failed[i] = ObjectUnauthentic(f"part {j} of {self.name(i)} fails authentication")
        return failed

    def _get(self, client: Any, workspace: Workspace) -> None:
        store, layout = self.store, self.store._layout
        t0 = time.perf_counter()
        mkeys = [layout.meta_key(k) for k in self.keys]
        msizes = [layout.meta_bytes(len(v)) for v in self.views]
        offsets = list(itertools.accumulate(msizes, initial=0))
        arena = workspace.arena
        codes = client.batch_get_into(mkeys, [arena.data_ptr() + o for o in offsets[:-1]], msizes)
        if store._conn.check(codes, "batch_get_into"):
            return self.fail_all(ClusterOff, "master unreachable during get", -900)
        values = arena.numpy()
        metas: dict[int, SealedMeta] = {}
        failed: dict[int, ClusterMiss] = {}  # settled last, after the objects found wrong are dropped
        for i, code in enumerate(codes):
            if code == OBJECT_NOT_FOUND:
                failed[i] = ObjectAbsent(f"no {self.name(i)} in the cluster", code)
            elif code in (msizes[i], sealed_meta_bytes(len(self.views[i]), V2)):  # version 3, or 2 (older saria's)
                opened = self._open_meta(i, values[offsets[i]:offsets[i] + code])
                if isinstance(opened, ClusterMiss):
                    failed[i] = opened
                else:
                    metas[i] = opened
            elif code == BUFFER_OVERFLOW or code >= 0:
                failed[i] = ObjectUnauthentic(f"{self.name(i)}: its metadata is not the size its destination "
                                              f"implies ({code})", code)
            else:
                failed[i] = ClusterMiss(f"Mooncake get of the metadata of {self.name(i)} failed", code)
        runs = self._runs([(i, j) for i in metas for j in range(len(metas[i].parts))], workspace) if metas else []
        pending: list[Future | None] = [None, None]
        try:
            for k, run in enumerate(runs):
                slot = k % 2
                if pending[slot] is not None:  # the run opened from this buffer two runs ago
                    for i, miss in pending[slot].result().items():
                        failed.setdefault(i, miss)
                    pending[slot] = None
                buf = workspace.cipher[slot]
                run = [(i, j, off) for i, j, off in run if i not in failed]
                if not run:
                    continue
                sizes = [self.views[i][j].numel() + TAG_BYTES for i, j, _ in run]
                codes = client.batch_get_into([layout.part_key(self.keys[i], j, metas[i].write_id) for i, j, _ in run],
                                              [buf.data_ptr() + off for _, _, off in run], sizes)
                if store._conn.check(codes, "batch_get_into"):
                    return self.fail_all(ClusterOff, "master unreachable during get", -900)
                for (i, j, _), code, size in zip(run, codes, sizes):
                    if i in failed or code == size:
                        continue
                    if code == OBJECT_NOT_FOUND:
                        failed[i] = ObjectAbsent(f"part {j} of {self.name(i)} is gone from the cluster (evicted)", code)
                    elif code == BUFFER_OVERFLOW or code >= 0:
                        failed[i] = ObjectUnauthentic(f"part {j} of {self.name(i)} is not the size its metadata "
                                                      f"says ({code}, expected {size})", code)
                    else:
                        failed[i] = ClusterMiss(f"Mooncake get of part {j} of {self.name(i)} failed", code)
                arrived = [(i, j, off) for i, j, off in run if i not in failed]
                pending[slot] = store._verifier.submit(self._open_run, arrived, buf, metas)
        finally:
            self._wait(pending)
        for f in pending:
            if f is not None:
                for i, miss in f.result().items():
                    failed.setdefault(i, miss)
        with self.lock:
            if self.timed_out:
                return
        store._counters.add(get_seconds=time.perf_counter() - t0)
        for i in failed:
            if i in metas:  # its other parts may hold plaintext: a miss leaves no bytes of the object
                for v in self.views[i]:
                    v.zero_()
        self._finish_get(client, failed, metas)

    def _evidence(self, miss: ClusterMiss) -> bool:
        """A failed tag is evidence; so is a retired epoch (never readable again); a newer epoch is
        left for the servers that hold it."""
        return isinstance(miss, (ObjectCorrupt, ObjectUnauthentic)) or (isinstance(miss, ObjectUnknownEpoch)
                                                                        and miss.retired)

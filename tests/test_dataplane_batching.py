"""Batched reloads against their source pages (differential): random mixes of DRAM and SSD objects,
skipped leading pages, batch sizes from one object to all of them, the CPU zero-copy path and the
gather path, serial plans, hybrid state objects, and failures injected into chosen objects (SSD
payload bytes flipped, DRAM copies missing). Exactly the injected objects fail; every other object's
pages are byte-identical to the pages it was packed from; failed and skipped pages are untouched."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_cases import gdn_pages, vllm_layers
from saria.config import SariaConfig
from saria.control import DropOrder, ObjectKey, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import Coordinator, HostPool, LoadItem, LoadJob, SSDStore, TransferEngine, object_key
from saria.dataplane.dram.staging import StagingPool
from saria.kernels import PageTable
from ssd_cases import flip_byte

PAGES = 2
NB = 40
SLOT = 4096
MAX_CHUNKS = 5
TARGET = 20  # target pages start here; sources are pages 0 .. 2 * MAX_CHUNKS
STATE_SRC, STATE_DST = 12, 36


class Rig:
    """One engine over real pages, a real host pool and a real SSD store on two drives; KV objects
    of 2 pages x 2 layers x 2 KiB = 8 KiB, i.e. two host slots / SSD parts each."""

    def __init__(self, root):
        self.caches = vllm_layers(NB, 16, 2, 16, torch.bfloat16, layers=2, seed=21)  # 4 KiB per page id
        self.gdn = gdn_pages(NB, 768, 600, seed=22)
        self.pool = HostPool(64 * SLOT, SLOT)
        drives = [root / "d0", root / "d1"]
        for d in drives:
            d.mkdir()
        self.store = SSDStore(drives, 4096 + 40 * (4096 + SLOT), SLOT)
        self.engine = TransferEngine(PageTable(self.caches), host_pool=self.pool,
                                     coordinator=Coordinator(SariaConfig().bandwidth), pages_per_chunk=PAGES,
                                     ssd=self.store, state_table=PageTable(self.gdn), state_pages=1)
        self.ids = itertools.count()

    def reset(self):
        """Start an example from an empty DRAM tier and SSD store, whatever the last one left (a
        failed example must not fail the next ones by filling the pool)."""
        for key in self.engine.dram.keys():
            self.engine.dram.drop(key)
        for key in self.store.keys():
            self.store.delete(key)
        assert self.pool.free_slots == self.pool.num_slots, "slots leaked: held by no DRAM object"

    def close(self):
        self.engine.close()
        self.store.close()
        self.pool.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig(tmp_path_factory.mktemp("batching"))
    yield r
    r.close()


def src_blocks(i):
    return [PAGES * i, PAGES * i + 1]


def dst_blocks(i):
    return [TARGET + PAGES * i, TARGET + PAGES * i + 1]


def page_bytes(tables, block):
    return [t[block].view(torch.uint8).clone() for t in tables]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batched_reload_is_byte_identical_and_fails_exactly_the_injected_objects(rig, data):
    engine, store = rig.engine, rig.store
    n = data.draw(st.integers(1, MAX_CHUNKS), label="chunks")
    tiers = data.draw(st.lists(st.sampled_from([Tier.DRAM, Tier.SSD]), min_size=n, max_size=n), label="tiers")
    skip = data.draw(st.integers(0, PAGES - 1), label="skip_pages")
    state_tier = data.draw(st.sampled_from([None, Tier.DRAM, Tier.SSD]), label="state")
    engine.batch_bytes = data.draw(st.sampled_from([1, 2 * engine.kv_bytes, 1 << 30]), label="batch_bytes")
    engine._dram_loads.zero_copy = engine.device.type == "cpu" and data.draw(st.booleans(), label="zero_copy")
    serial = data.draw(st.booleans(), label="serial")
    filler = data.draw(st.booleans(), label="fragment the pool")
    broken = data.draw(st.sets(st.integers(0, n - 1)), label="broken chunks")
    state_broken = state_tier is not None and data.draw(st.booleans(), label="state broken")

    rig.reset()
    tag = next(rig.ids)
    chunks = [f"e{tag}-c{i}" for i in range(n)]
    src = {c: src_blocks(i) for i, c in enumerate(chunks)}
    state_chunk = chunks[-1] if state_tier is not None else None
    if filler:  # a stored-then-dropped object leaves a hole: the next objects' slots are not adjacent
        assert engine.store(StoreOrder(1, (f"e{tag}-filler",), (), 0), {f"e{tag}-filler": src_blocks(0)}).result().ok
    dram = tuple(c for c, t in zip(chunks, tiers) if t is Tier.DRAM)
    ssd = tuple(c for c, t in zip(chunks, tiers) if t is Tier.SSD)
    state_dram = (state_chunk,) if state_tier is Tier.DRAM else ()
    state_ssd = (state_chunk,) if state_tier is Tier.SSD else ()
    state_src = {state_chunk: [STATE_SRC]} if state_chunk is not None else {}
    runs = engine.execute([StoreOrder(2, dram, state_dram, 0),
                           WriteOrder(3, ssd, state_ssd, 0, Tier.GPU, "write-through")], src, state_src)
    assert all(r.completion.result().ok for r in runs)
    assert rig.pool.used_slots == engine.dram.held_slots()  # every slot taken is owned by a DRAM object
    if filler:
        engine.drop(DropOrder(4, (f"e{tag}-filler",), (), 0, Tier.DRAM))

    expected_failed = set()
    for i in broken:  # inject: an SSD object's payload flipped, a DRAM object gone
        key = ObjectKey(chunks[i], "kv")
        if tiers[i] is Tier.SSD:
            path, offset, length = store.part_extents(object_key(key.chunk, key.kind))[-1]
            flip_byte(path, offset + length // 2)
        else:
            engine.drop(DropOrder(5, (key.chunk,), (), 0, Tier.DRAM))
        expected_failed.add(key)
    if state_broken:
        key = ObjectKey(state_chunk, "state")
        if state_tier is Tier.SSD:
            path, offset, length = store.part_extents(object_key(state_chunk, "state"))[0]
            flip_byte(path, offset + 7)
        else:
            engine.drop(DropOrder(6, (), (state_chunk,), 0, Tier.DRAM))
        expected_failed.add(key)

    for c in rig.caches:  # fresh targets: a marker byte pattern the reload must overwrite (or keep)
        c[TARGET:TARGET + PAGES * MAX_CHUNKS].view(torch.uint8).fill_(0xA5)
    rig.gdn[0][STATE_DST].view(torch.uint8).fill_(0xA5)
    marker = page_bytes(rig.caches, TARGET)

    plan = ReloadPlan(100 + tag, tuple(chunks), tuple(tiers), state_chunk, state_tier, n * 8, 0, 0, serial)
    timeline = []
    result = engine.load(plan, [dst_blocks(i) for i in range(n)], [STATE_DST] if state_chunk else None,
                         skip_pages=skip, timeline=timeline).wait(timeout=60)

    assert set(result.failed) == expected_failed
    kv_failed = [i for i in range(n) if ObjectKey(chunks[i], "kv") in expected_failed]
    valid = 0 if state_broken else min(kv_failed, default=n)
    assert result.valid_chunks == valid
    for i in range(n):
        for j, (s, d) in enumerate(zip(src_blocks(i), dst_blocks(i))):
            got = page_bytes(rig.caches, d)
            if i in kv_failed or (i == 0 and j < skip):
                assert same(got, marker), f"chunk {i} page {j} was written"
            else:
                assert same(got, page_bytes(rig.caches, s)), f"chunk {i} page {j} differs from its source"
    if state_chunk is not None:
        got, want = page_bytes(rig.gdn, STATE_DST), page_bytes(rig.gdn, STATE_SRC)
        assert same(got, want) != state_broken
    assert sum(nb for p, _, nb in timeline if p == "ssd") == sum(
        engine.kv_bytes for i in range(n) if tiers[i] is Tier.SSD and i not in broken) + (
        engine.state_bytes if state_tier is Tier.SSD and not state_broken else 0)

    engine.drop(DropOrder(7, tuple(chunks), (state_chunk,) if state_chunk else (), 0, Tier.DRAM))
    engine.drop(DropOrder(8, tuple(chunks), (state_chunk,) if state_chunk else (), 0, Tier.SSD))
    assert engine.dram_objects() == 0 and rig.pool.free_slots == rig.pool.num_slots


def test_one_unpack_launch_per_batch(tmp_path, monkeypatch):
    """Four DRAM objects and four SSD objects read together: one launch for the DRAM batch (zero-copy
    run of fresh, adjacent slots, or gathered staging), and at most one per SSD object (fewer when
    several arrive together)."""
    from saria.dataplane.transfer import tables as tables_module
    rig = Rig(tmp_path)
    engine = rig.engine
    calls = []
    real = tables_module.unpack_pages
    monkeypatch.setattr(tables_module, "unpack_pages", lambda s, t, ids, **kw: calls.append(ids.dim()) or real(
        s, t, ids, **kw))
    engine.batch_bytes = 1 << 30
    chunks = [f"launch-{i}" for i in range(8)]
    src = {c: src_blocks(i % 4) for i, c in enumerate(chunks)}
    assert engine.store(StoreOrder(1, tuple(chunks[:4]), (), 0), src).result().ok
    assert engine.write(WriteOrder(2, tuple(chunks[4:]), (), 0, Tier.GPU, "write-through"), src).result().ok
    for zero_copy in {engine.device.type == "cpu", False}:  # CUDA: always staged
        engine._dram_loads.zero_copy = zero_copy
        calls.clear()
        plan = ReloadPlan(7, tuple(chunks[:4]), (Tier.DRAM,) * 4, None, None, 32, 0, 0, False)
        assert engine.load(plan, [dst_blocks(i) for i in range(4)]).wait().ok
        assert calls == [2]  # the gathered batch, or the run of adjacent fresh slots: one launch
    calls.clear()
    plan = ReloadPlan(8, tuple(chunks[4:]), (Tier.SSD,) * 4, None, None, 32, 0, 0, False)
    assert engine.load(plan, [dst_blocks(i) for i in range(4)]).wait().ok
    assert 1 <= len(calls) <= 4
    for i in range(4):
        assert same(page_bytes(rig.caches, dst_blocks(i)[0]), page_bytes(rig.caches, src_blocks(i)[0]))
    rig.close()


def test_duplicate_target_pages_fail_only_the_objects_that_clash(rig):
    """A batch the kernel refuses (two objects naming one page) is retried object by object."""
    rig.reset()
    engine = rig.engine
    engine._dram_loads.zero_copy = False
    engine.batch_bytes = 1 << 30
    chunks = ["dup-a", "dup-b", "dup-c"]
    src = {c: src_blocks(i) for i, c in enumerate(chunks)}
    assert engine.store(StoreOrder(1, tuple(chunks), (), 0), src).result().ok
    plan = ReloadPlan(9, tuple(chunks), (Tier.DRAM,) * 3, None, None, 24, 0, 0, False)
    result = engine.load(plan, [dst_blocks(0), dst_blocks(1), [dst_blocks(2)[0], dst_blocks(2)[0]]]).wait()
    assert result.failed == (ObjectKey("dup-c", "kv"),) and result.valid_chunks == 2
    assert same(page_bytes(rig.caches, dst_blocks(1)[1]), page_bytes(rig.caches, src_blocks(1)[1]))
    engine.drop(DropOrder(2, tuple(chunks), (), 0, Tier.DRAM))


# --- LoadJob and StagingPool on their own ---------------------------------------------------------

def _item(i, tier=Tier.DRAM, kind="kv"):
    return LoadItem(i, ObjectKey(f"c{i}", kind), tier, None, torch.tensor([i]), 10)


def test_load_job_finishes_marks_and_defers():
    items = [_item(0), _item(1, Tier.SSD), _item(2, Tier.SSD)]
    timeline = []
    job = LoadJob(ReloadPlan(1, ("c0", "c1", "c2"), (Tier.DRAM, Tier.SSD, Tier.SSD), None, None, 24, 0, 0, True),
                  items, timeline)
    started = []
    assert not job.deferred
    job.then(lambda j, deferred: started.append((j, deferred)), items[1:])
    assert job.deferred
    job.start_deferred()
    assert not job.deferred
    job.start_deferred()  # each held-back part starts once
    assert started == [(job, items[1:])]
    job.mark("dram", 10)
    job.finish(items[0])
    assert not job.done()
    job.finish(items[1:], error=RuntimeError("x"))
    assert job.done()
    result = job.wait(timeout=1)
    assert result.failed == (ObjectKey("c1", "kv"), ObjectKey("c2", "kv")) and result.valid_chunks == 1
    assert result.dram_bytes == 10 and result.ssd_bytes == 20 and [p for p, _, _ in timeline] == ["dram"]
    with pytest.raises(RuntimeError, match="pending"):
        job.finish(items[0])


def test_load_job_waiters_before_and_after_the_last_finish():
    """The job's "issued" event is made only for a caller that waits before the last object is
    finished: waiters that came before wake, those after never block, a timeout still times out."""
    import threading

    items = [_item(0), _item(1)]
    job = LoadJob(ReloadPlan(1, ("c0", "c1"), (Tier.DRAM, Tier.DRAM), None, None, 16, 0, 0, False), items, None)
    with pytest.raises(TimeoutError):
        job.outcome(timeout=0.01)
    with pytest.raises(RuntimeError, match="in flight"):
        job.result()
    got = []
    waiters = [threading.Thread(target=lambda: got.append(job.wait(timeout=5))) for _ in range(3)]
    for w in waiters:
        w.start()
    job.finish(items[0])
    assert not job.done() and not job.ready()
    job.finish(items[1], error=RuntimeError("x"))
    for w in waiters:
        w.join()
    assert job.done() and job.ready() and len(got) == 3 and all(r.valid_chunks == 1 for r in got)
    assert job.outcome(timeout=0).failed == (ObjectKey("c1", "kv"),)
    empty = LoadJob(ReloadPlan(2, (), (), None, None, 0, 0, 0, False), [], None)
    assert empty.done() and empty.wait(timeout=0).ok


def test_staging_pool_reuses_aligned_buffers():
    pool = StagingPool(torch.device("cpu"), keep=2)
    handle, t = pool.take(5000)
    assert t.numel() == 5000 and t.data_ptr() % 4096 == 0
    pool.give(handle)
    handle2, t2 = pool.take(3000)
    assert t2.data_ptr() == t.data_ptr()  # the same buffer again
    handles = [pool.take(10 << 20)[0] for _ in range(3)] + [handle2]
    for h in handles:
        pool.give(h)
    assert pool.cached_bytes() <= 2 * (10 << 20)

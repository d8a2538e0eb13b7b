"""Transfer engine and TieredCache on real tensors, a real host pool and a real SSD store in a temp
dir (kernels under Triton's interpreter on CPU): every reloaded page is compared byte for byte."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from kernel_cases import fresh_like, gdn_pages, vllm_layers
from saria.integrations.cache import TieredCache
from saria.config import Capacity, ChunkSpec, SariaConfig
from saria.control import DropOrder, ObjectKey, PromoteOrder, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import Coordinator, HostPool, SSDStore, TransferEngine, object_key
from saria.dataplane.ssd.format import Geometry
from saria.kernels import PageTable
from ssd_cases import drive_file, flip_byte

BLOCK_TOKENS = 4
PAGES = 2  # pages per chunk: 8-token chunks
NB = 48
SLOT = 4096


def layers(seed=0):
    return vllm_layers(NB, BLOCK_TOKENS, 2, 8, torch.bfloat16, layers=3, seed=seed)  # 768 B per page id


def same_pages(caches, a, b) -> bool:
    return all(torch.equal(c[a].view(torch.uint8), c[b].view(torch.uint8)) for c in caches)


def blocks_of(i, base=0):
    return [base + PAGES * i, base + PAGES * i + 1]


@contextlib.contextmanager
def engine_rig(caches, drives, ssd_slots: int):
    """A transfer engine over ``caches`` with a 16-slot host pool and an SSD store of
    ``ssd_slots`` slots over ``drives`` (made here): ``(caches, engine, store, pool)``, closed after."""
    pool = HostPool(16 * SLOT, SLOT)
    for d in drives:
        d.mkdir()
    store = SSDStore(drives, 4096 + ssd_slots * (4096 + SLOT), SLOT)
    engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                            pages_per_chunk=PAGES, ssd=store)
    try:
        yield caches, engine, store, pool
    finally:
        engine.close()
        store.close()
        pool.close()


@pytest.fixture
def engine_parts(tmp_path):
    with engine_rig(layers(), [tmp_path / "d0", tmp_path / "d1"], 16) as parts:
        yield parts


def plan(chunks, sources, *, serial=False, plan_id=1):
    return ReloadPlan(plan_id, tuple(chunks), tuple(sources), None, None, len(chunks) * 8, 0, 0, serial)


def test_dram_then_ssd_then_dram_plan_reloads_every_page(engine_parts):
    caches, engine, store, pool = engine_parts
    chunks = ["a", "b", "c"]
    src = {c: blocks_of(i) for i, c in enumerate(chunks)}
    assert engine.store(StoreOrder(1, ("a", "c"), (), 0), src).result().ok
    assert engine.write(WriteOrder(2, ("b",), (), 0, Tier.GPU, "write-through"), src).result().ok
    assert store.contains(object_key("b", "kv")) and engine.dram_object("b") is None
    job = engine.load(plan(chunks, [Tier.DRAM, Tier.SSD, Tier.DRAM]), [blocks_of(i, 20) for i in range(3)])
    result = job.wait()
    assert result.ok and result.valid_chunks == 3 and result.ssd_bytes == engine.kv_bytes
    for i in range(3):
        for a, b in zip(blocks_of(i), blocks_of(i, 20)):
            assert same_pages(caches, a, b)


def test_write_from_dram_slots_then_reload_from_ssd(engine_parts):
    caches, engine, store, pool = engine_parts
    src = {"x": blocks_of(0)}
    engine.store(StoreOrder(1, ("x",), (), 0), src).result()
    obj = engine.dram_object("x")
    assert engine.write(WriteOrder(2, ("x",), (), 0, Tier.DRAM, "eviction"), {}).result().ok
    assert store.info(object_key("x", "kv")).parts[0].checksum == obj.checksums[0]  # checksum from pack time
    engine.drop(DropOrder(3, ("x",), (), 0, Tier.DRAM))
    assert engine.dram_object("x") is None and pool.free_slots == pool.num_slots
    assert engine.load(plan(["x"], [Tier.SSD]), [blocks_of(0, 30)]).wait().ok
    assert same_pages(caches, 0, 30) and same_pages(caches, 1, 31)
    engine.drop(DropOrder(4, ("x",), (), 0, Tier.SSD))
    assert not store.contains(object_key("x", "kv"))


def test_corrupt_ssd_object_fails_the_load_and_is_dropped(engine_parts):
    caches, engine, store, pool = engine_parts
    src = {c: blocks_of(i) for i, c in enumerate("pq")}
    engine.write(WriteOrder(1, ("p", "q"), (), 0, Tier.GPU, "write-through"), src).result()
    part = store.info(object_key("q", "kv")).parts[0]
    directory = store.paths[part.drive].parent
    flip_byte(drive_file(directory), Geometry.for_capacity(4096 + 16 * (4096 + SLOT), SLOT).payload_offset(part.slot) + 5)
    result = engine.load(plan(["p", "q"], [Tier.SSD, Tier.SSD]), [blocks_of(0, 36), blocks_of(1, 36)]).wait()
    assert result.failed == (ObjectKey("q", "kv"),) and result.valid_chunks == 1
    assert same_pages(caches, 0, 36)  # the good chunk arrived
    assert not store.contains(object_key("q", "kv"))  # the bad copy is dropped
    assert store.counters()["verification_failures"] == 1


def test_corrupt_object_leaves_its_target_pages_untouched(tmp_path):
    caches = layers()
    target = fresh_like(caches)
    (tmp_path / "d").mkdir()
    with HostPool(4 * SLOT, SLOT) as pool, SSDStore([tmp_path / "d"], 4096 + 8 * (4096 + SLOT), SLOT) as store:
        writer = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store)
        writer.write(WriteOrder(1, ("k",), (), 0, Tier.GPU, "write-through"), {"k": blocks_of(0)}).result()
        part = store.info(object_key("k", "kv")).parts[0]
        flip_byte(drive_file(tmp_path / "d"), Geometry.for_capacity(4096 + 8 * (4096 + SLOT), SLOT).payload_offset(part.slot))
        reader = TransferEngine(PageTable(target), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store)
        result = reader.load(plan(["k"], [Tier.SSD]), [blocks_of(0)]).wait()
        assert not result.ok and result.valid_chunks == 0
        assert all(not t.view(torch.uint8).any() for t in target)  # nothing unverified was unpacked
        writer.close()
        reader.close()


def test_host_pool_full_names_the_objects_that_did_not_fit(tmp_path):
    caches = layers()
    with HostPool(2 * SLOT, SLOT) as pool:
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES)
        src = {c: blocks_of(i) for i, c in enumerate("uvw")}
        done = engine.store(StoreOrder(7, ("u", "v", "w"), (), 0), src).result()
        assert done.order_id == 7 and done.ok and done.failed == (ObjectKey("w", "kv"),)
        assert engine.counters()["engine"]["host_pool_full"] == 1
        assert engine.dram_object("u") is not None and engine.dram_object("w") is None
        engine.close()


def test_serial_plan_reads_ssd_only_after_dram(engine_parts):
    caches, engine, store, pool = engine_parts
    chunks = list("abcd")
    src = {c: blocks_of(i) for i, c in enumerate(chunks)}
    engine.store(StoreOrder(1, ("a", "b"), (), 0), src).result()
    engine.write(WriteOrder(2, ("c", "d"), (), 0, Tier.GPU, "write-through"), src).result()
    timeline = []
    sources = [Tier.DRAM, Tier.DRAM, Tier.SSD, Tier.SSD]
    result = engine.load(plan(chunks, sources, serial=True), [blocks_of(i, 20) for i in range(4)],
                         timeline=timeline).wait()
    assert result.ok
    paths = [p for p, _, _ in timeline]
    assert paths == ["dram", "dram", "ssd", "ssd"]
    assert all(same_pages(caches, a, b) for i in range(4) for a, b in zip(blocks_of(i), blocks_of(i, 20)))


def test_hybrid_state_objects_travel_with_their_chunk(tmp_path):
    fa = layers()
    gdn = gdn_pages(NB, 768, 600, seed=3) + gdn_pages(NB, 768, 520, seed=4)
    (tmp_path / "d").mkdir()
    with HostPool(16 * SLOT, SLOT) as pool, SSDStore([tmp_path / "d"], 4096 + 16 * (4096 + SLOT), SLOT) as store:
        engine = TransferEngine(PageTable(fa), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store, state_table=PageTable(gdn), state_pages=1)
        assert engine.state_bytes == 1120
        src = {c: blocks_of(i) for i, c in enumerate("st")}
        engine.store(StoreOrder(1, ("s", "t"), ("t",), 0), src, {"t": [5]}).result()
        engine.write(WriteOrder(2, (), ("t",), 0, Tier.DRAM, "eviction"), {}).result()
        engine.drop(DropOrder(3, (), ("t",), 0, Tier.DRAM))
        hybrid = ReloadPlan(9, ("s", "t"), (Tier.DRAM, Tier.DRAM), "t", Tier.SSD, 16, 0, 0, False)
        assert engine.load(hybrid, [blocks_of(0, 20), blocks_of(1, 20)], [40]).wait().ok
        assert all(torch.equal(g[40].view(torch.uint8), g[5].view(torch.uint8)) for g in gdn)
        assert same_pages(fa, 2, 22) and same_pages(fa, 3, 23)
        with pytest.raises(ValueError, match="no block ids given for the state object"):
            engine.load(hybrid, [blocks_of(0, 20), blocks_of(1, 20)], None)
        engine.close()


def test_bad_input_is_refused_before_anything_moves(engine_parts, tmp_path):
    caches, engine, store, pool = engine_parts
    with pytest.raises(ValueError, match="2 chunks but 1 block lists"):
        engine.load(plan(["a", "b"], [Tier.DRAM, Tier.DRAM]), [blocks_of(0)])
    with pytest.raises(ValueError, match="needs 2 block ids"):
        engine.load(plan(["a"], [Tier.DRAM]), [[1, 2, 3]])
    with pytest.raises(ValueError, match="no block ids"):
        engine.store(StoreOrder(1, ("zz",), (), 0), {})
    with pytest.raises(ValueError, match="state_table"):
        engine.store(StoreOrder(1, (), ("zz",), 0), {}, {"zz": [1]})
    with pytest.raises(ValueError, match="expected DRAM or SSD"):
        engine.drop(DropOrder(1, ("a",), (), 0, Tier.GPU))
    with HostPool(4 * 8192, 8192) as other, pytest.raises(ValueError, match="same size"):
        TransferEngine(PageTable(caches), host_pool=other, ssd=store, pages_per_chunk=PAGES,
                       coordinator=Coordinator(SariaConfig().bandwidth))
    result = engine.load(plan(["never-stored"], [Tier.DRAM]), [blocks_of(0, 20)]).wait()
    assert result.failed == (ObjectKey("never-stored", "kv"),)  # a missing object is a failed load


# --- TieredCache: the control plane and the engine together --------------------------------------

def small_config(preset="saria", dram_chunks=3, ssd_chunks=40, **policy):
    """Tiers that hold ``dram_chunks`` and ``ssd_chunks`` of these 1,536-byte chunks, each in a
    4 KiB slot (saria.sizing: a host slot each; on the drive a superblock, then a header and a
    part per object)."""
    cfg = SariaConfig.preset(preset, chunk=ChunkSpec(chunk_tokens=8, checkpoint_tokens=64),
                             dram=Capacity(nbytes=dram_chunks * SLOT),
                             ssd=Capacity(nbytes=4096 + ssd_chunks * (4096 + SLOT)))
    return cfg.with_policy(**policy) if policy else cfg


def test_tiered_cache_reloads_from_ssd_when_dram_is_too_small(tmp_path):
    caches = layers()
    with TieredCache(small_config("full-duplicate", dram_chunks=2), caches, block_tokens=BLOCK_TOKENS,
                     ssd_paths=[str(tmp_path)]) as cache:
        hashes = [f"h{i}" for i in range(5)]
        blocks = {h: blocks_of(i) for i, h in enumerate(hashes)}
        cache.commit(hashes, blocks, plan=cache.lookup(hashes))
        cache.drain()
        again = cache.lookup(hashes)
        assert again.num_chunks == 5 and again.ssd_chunks >= 3
        result = cache.load(again, [blocks_of(i, 20) for i in range(5)]).wait()
        assert result.ok
        assert all(same_pages(caches, a, b) for i in range(5) for a, b in zip(blocks_of(i), blocks_of(i, 20)))
        cache.commit(hashes, blocks, plan=again, failed=result.failed)
        cache.drain()
        counters = cache.counters()
        assert counters["control"]["hits_ssd_chunks"] >= 3
        assert counters["data"]["engine"]["ssd_to_gpu_bytes"] >= 3 * cache.engine.kv_bytes


def test_tiered_cache_sessions_from_several_threads(tmp_path):
    caches = layers(seed=5)
    errors = []
    with TieredCache(small_config("saria", dram_chunks=6, ssd_chunks=40, theta_E=1), caches,
                     block_tokens=BLOCK_TOKENS, ssd_paths=[str(tmp_path)]) as cache:
        def session(s):
            try:
                hashes = [f"s{s}-{i}" for i in range(3)]
                own = {h: blocks_of(i, 6 * s) for i, h in enumerate(hashes)}
                for turn in range(3):
                    p = cache.lookup(hashes)
                    target = [blocks_of(i, 24 + 6 * s) for i in range(p.num_chunks)]
                    result = cache.load(p, target).wait()
                    for i in range(result.valid_chunks):
                        if not same_pages(caches, own[hashes[i]][0], target[i][0]):
                            errors.append(f"session {s} turn {turn} chunk {i}: wrong bytes")
                    cache.commit(hashes, own, plan=p, failed=result.failed)
                    cache.drain()
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=session, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert not cache.control.audit()
        counters = cache.counters()["control"]
        assert counters["hits_dram_chunks"] + counters["hits_ssd_chunks"] > 0


def test_tiered_cache_refuses_ssd_policy_without_paths():
    with pytest.raises(ValueError, match="ssd_paths"):
        TieredCache(small_config("full-duplicate"), layers(), block_tokens=BLOCK_TOKENS, ssd_paths=[])
    with pytest.raises(ValueError, match="whole number"):
        TieredCache(small_config("dram-only"), layers(), block_tokens=3)


def test_skip_pages_leaves_the_engines_own_leading_pages_alone(engine_parts):
    caches, engine, store, pool = engine_parts
    src = {c: blocks_of(i) for i, c in enumerate("mn")}
    engine.store(StoreOrder(1, ("m",), (), 0), src).result()
    engine.write(WriteOrder(2, ("n",), (), 0, Tier.GPU, "write-through"), src).result()
    marker = [c[20].clone() for c in caches]  # block 20: the engine's own first page of chunk m
    job = engine.load(plan(["m", "n"], [Tier.DRAM, Tier.SSD]), [blocks_of(0, 20), blocks_of(1, 20)], skip_pages=1)
    assert job.wait().ok
    assert all(torch.equal(m.view(torch.uint8), c[20].view(torch.uint8)) for m, c in zip(marker, caches))
    assert same_pages(caches, 1, 21) and same_pages(caches, 2, 22) and same_pages(caches, 3, 23)
    with pytest.raises(ValueError, match="skip_pages"):
        engine.load(plan(["m"], [Tier.DRAM]), [blocks_of(0, 20)], skip_pages=2)


def test_prepacked_state_is_stored_and_a_missing_one_fails(tmp_path):
    from saria.kernels import pack_pages

    fa = layers()
    gdn = gdn_pages(NB, 768, 600, seed=3)
    with HostPool(16 * SLOT, SLOT) as pool:
        engine = TransferEngine(PageTable(fa), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, state_table=PageTable(gdn))
        snapshot = pack_pages(gdn, torch.tensor([7]))  # captured earlier; page 7 changes afterwards
        gdn[0][7].fill_(1)
        done = engine.store(StoreOrder(1, ("a",), ("a", "b"), 0), {"a": blocks_of(0)},
                            prepacked={ObjectKey("a", "state"): snapshot}).result()
        assert done.ok and done.failed == (ObjectKey("b", "state"),)
        stored = engine.dram_object("a", "state")
        assert torch.equal(pool.views(stored.slots, stored.nbytes)[0], snapshot.cpu())  # host slots vs device
        with pytest.raises(ValueError, match="prepacked"):
            engine.store(StoreOrder(2, (), ("c",), 0), {}, prepacked={ObjectKey("c", "state"): snapshot[:-1]})
        engine.close()


def test_prewarm_reads_ssd_into_dram_and_the_dram_copy_reloads_every_page(engine_parts):
    caches, engine, store, pool = engine_parts
    src = {c: blocks_of(i) for i, c in enumerate("uvw")}
    assert engine.write(WriteOrder(1, ("u", "v", "w"), (), 0, Tier.GPU, "write-through"), src).result().ok
    # w's copy is corrupted on the drive: the store's verification fails it, alone.
    part = store.info(object_key("w", "kv")).parts[0]
    flip_byte(drive_file(store.paths[part.drive].parent),
              Geometry.for_capacity(4096 + 16 * (4096 + SLOT), SLOT).payload_offset(part.slot) + 5)
    free = pool.free_slots
    (run,) = engine.execute([PromoteOrder(2, ("u", "v", "w", "gone"), (), 0, source=Tier.SSD)])
    assert run.released.is_set()  # reads no pages
    done = run.completion.result()
    assert done.ok and set(done.failed) == {ObjectKey("w", "kv"), ObjectKey("gone", "kv")}
    assert engine.dram_object("u") is not None and engine.dram_object("v") is not None
    assert engine.dram_object("w") is None and pool.free_slots == free - 2 * pool.slots_for(engine.kv_bytes)
    assert engine.counters()["engine"]["ssd_to_dram_bytes"] == 2 * engine.kv_bytes
    # The DRAM copies reload bit for bit.
    result = engine.load(plan(["u", "v"], [Tier.DRAM, Tier.DRAM]), [blocks_of(i, 30) for i in range(2)]).wait()
    assert result.ok and result.valid_chunks == 2
    for i in range(2):
        for a, b in zip(blocks_of(i), blocks_of(i, 30)):
            assert same_pages(caches, a, b)
    # store() refuses an SSD-sourced promotion (it would pack HBM pages that hold nothing of it).
    with pytest.raises(ValueError, match="prewarm"):
        engine.store(PromoteOrder(3, ("u",), (), 0, source=Tier.SSD), src)


def test_counter_snapshots_are_detached_copies_of_every_field():
    """The snapshots vLLM's stats read twice a step are shallow copies (not dataclasses.asdict): every
    field, as numbers, and later counting does not change a snapshot taken before."""
    import dataclasses

    from saria.dataplane.dram.host_pool import HostPoolCounters
    from saria.dataplane.transfer.coordinator import CoordinatorCounters
    from saria.dataplane.transfer.results import EngineCounters

    for cls in (EngineCounters, HostPoolCounters, CoordinatorCounters):
        counters = cls()
        for i, f in enumerate(dataclasses.fields(cls)):
            setattr(counters, f.name, i + 1)
        snap = counters.snapshot()
        assert snap == dataclasses.asdict(counters) and list(snap) == [f.name for f in dataclasses.fields(cls)]
        first = dataclasses.fields(cls)[0].name
        setattr(counters, first, 1000)
        assert snap[first] == 1

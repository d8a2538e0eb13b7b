"""The transfer engine with ``ssd_dtype="fp8"``: kv objects live on SSD in their FP8 form, on real
tensors, a real host pool and a real SSD store in a temp dir (kernels under Triton's interpreter).

Each path is held against the kernels composed by hand (the kernels' own tests hold those against
a naive oracle): what a reload from SSD writes into the pages is exactly
``dequantize_staging(quantize_staging(pack_pages(pages)))``, whichever way the object reached the
SSD (packed from the pages, or quantized from its DRAM copy) and whichever way it comes back (into
the pages, or prewarmed into DRAM); DRAM reloads and GDN states stay bit-exact."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from kernel_cases import gdn_pages
from saria.config import Capacity, ChunkSpec, SariaConfig
from saria.integrations.cache import TieredCache
from saria.control import ObjectKey, PromoteOrder, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import Coordinator, HostPool, SSDStore, TransferEngine, object_key
from saria.kernels import PageTable, dequantize_staging, pack_pages, quantize_staging
from saria.sizing import size_tiers
from saria.ssd_dtype import fp8_bytes
from ssd_cases import drive_file, flip_byte

BLOCK_TOKENS = 4
PAGES = 2  # pages per chunk
NB = 32
SLOT = 4096


def layers(seed=0, dtype=torch.bfloat16, layers=3, head_dim=16):
    """vLLM-like per-layer [NB, BS, 2, H, D] caches of finite values spread over magnitudes
    (256 elements per page and layer: whole 128-element groups)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        x = torch.randn((NB, BLOCK_TOKENS, 2, 2, head_dim), generator=g)
        x *= torch.exp2(torch.randint(-6, 6, (NB, BLOCK_TOKENS, 2, 2, 1), generator=g).float())
        out.append(x.to(dtype))
    return out


def blocks_of(i, base=0):
    return [base + PAGES * i, base + PAGES * i + 1]


def plan(chunks, sources, *, plan_id=1):
    return ReloadPlan(plan_id, tuple(chunks), tuple(sources), None, None, len(chunks) * 8, 0, 0, False)


@contextlib.contextmanager
def rig(tmp_path, caches, *, ssd_dtype="fp8", ssd_slots=16, state=None, part=SLOT):
    pool = HostPool(16 * SLOT, SLOT)
    drive = tmp_path / "d0"
    drive.mkdir(exist_ok=True)
    store = SSDStore([drive], 4096 + ssd_slots * (4096 + part), part)
    engine = None
    try:
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store, ssd_dtype=ssd_dtype,
                                state_table=PageTable(state) if state else None, state_pages=1)
        yield engine, store
    finally:
        if engine is not None:
            engine.close()
        store.close()
        pool.close()


def fp8_round_trip(caches, ids) -> torch.Tensor:
    """The bytes a reload from an FP8 SSD object writes for pages ``ids``: the kernels by hand."""
    return dequantize_staging(quantize_staging(pack_pages(caches, torch.tensor(ids)), caches[0].dtype),
                              caches[0].dtype)


def test_object_reaches_ssd_in_fp8_and_reloads_as_the_kernels_say(tmp_path):
    caches = layers()
    table = PageTable(caches)
    with rig(tmp_path, caches) as (engine, store):
        raw = table.staging_bytes(PAGES)
        assert engine.kv_ssd_bytes == fp8_bytes(raw, 2) < 0.52 * raw
        src = {"a": blocks_of(0), "b": blocks_of(1)}
        expected = {c: fp8_round_trip(caches, ids) for c, ids in src.items()}
        # a: from the pages (write-through, quantized inside the pack); b: from its DRAM copy
        assert engine.write(WriteOrder(1, ("a",), (), 0, Tier.GPU, "write-through"), src).result().ok
        assert engine.store(StoreOrder(2, ("b",), (), 0), src).result().ok
        assert engine.write(WriteOrder(3, ("b",), (), 0, Tier.DRAM, "eviction")).result().ok
        for c in src:
            assert store.info(object_key(c, "kv")).length == engine.kv_ssd_bytes
        assert engine.counters()["engine"]["ssd_write_bytes"] == 2 * engine.kv_ssd_bytes
        # the DRAM copy is untouched: still exact
        assert torch.equal(torch.cat(engine.dram.views(engine.dram_object("b"))), pack_pages(caches, torch.tensor(src["b"])))
        job = engine.load(plan(["a", "b"], [Tier.SSD, Tier.SSD]), [blocks_of(0, 16), blocks_of(1, 16)])
        result = job.wait()
        assert result.ok and result.ssd_bytes == 2 * engine.kv_ssd_bytes
        for i, c in enumerate(src):
            assert torch.equal(pack_pages(caches, torch.tensor(blocks_of(i, 16))), expected[c])


def test_write_through_and_dram_source_store_the_same_bytes(tmp_path):
    caches = layers(seed=3)
    with rig(tmp_path, caches) as (engine, store):
        src = {"x": blocks_of(0)}
        assert engine.write(WriteOrder(1, ("x",), (), 0, Tier.GPU, "write-through"), src).result().ok
        gpu_form = torch.empty(engine.kv_ssd_bytes, dtype=torch.uint8)
        store.read(object_key("x", "kv"), gpu_form).result()
        assert engine.store(StoreOrder(2, ("x",), (), 0), src).result().ok
        store.delete(object_key("x", "kv"))
        assert engine.write(WriteOrder(3, ("x",), (), 0, Tier.DRAM, "eviction")).result().ok
        dram_form = torch.empty(engine.kv_ssd_bytes, dtype=torch.uint8)
        store.read(object_key("x", "kv"), dram_form).result()
        assert torch.equal(gpu_form, dram_form)
        assert torch.equal(gpu_form, quantize_staging(pack_pages(caches, torch.tensor(src["x"])), torch.bfloat16))


def test_dram_reloads_stay_bit_exact(tmp_path):
    caches = layers(seed=5)
    with rig(tmp_path, caches) as (engine, _):
        assert engine.store(StoreOrder(1, ("a",), (), 0), {"a": blocks_of(0)}).result().ok
        assert engine.load(plan(["a"], [Tier.DRAM]), [blocks_of(0, 16)]).wait().ok
        for a, b in zip(blocks_of(0), blocks_of(0, 16)):
            assert all(torch.equal(c[a], c[b]) for c in caches)


def test_prewarm_dequantizes_into_dram_and_that_copy_reloads(tmp_path):
    caches = layers(seed=7)
    with rig(tmp_path, caches) as (engine, _):
        src = {"p": blocks_of(2)}
        expected = fp8_round_trip(caches, src["p"])
        assert engine.write(WriteOrder(1, ("p",), (), 0, Tier.GPU, "write-through"), src).result().ok
        done = engine.execute([PromoteOrder(2, ("p",), (), 0, source=Tier.SSD)])[0].completion.result()
        assert done.ok
        obj = engine.dram_object("p")
        assert obj.nbytes == engine.kv_bytes and torch.equal(torch.cat(engine.dram.views(obj)), expected)
        assert engine.load(plan(["p"], [Tier.DRAM]), [blocks_of(0, 16)]).wait().ok
        assert torch.equal(pack_pages(caches, torch.tensor(blocks_of(0, 16))), expected)


def test_skip_pages_and_a_mixed_plan(tmp_path):
    caches = layers(seed=9)
    with rig(tmp_path, caches) as (engine, _):
        src = {c: blocks_of(i) for i, c in enumerate("abc")}
        expected = {c: fp8_round_trip(caches, ids) for c, ids in src.items()}
        assert engine.write(WriteOrder(1, ("a", "c"), (), 0, Tier.GPU, "write-through"), src).result().ok
        assert engine.store(StoreOrder(2, ("b",), (), 0), src).result().ok
        target = [blocks_of(i, 16) for i in range(3)]
        keep = [c[target[0][0]].clone() for c in caches]
        job = engine.load(plan(list("abc"), [Tier.SSD, Tier.DRAM, Tier.SSD]), target, skip_pages=1)
        assert job.wait().ok
        assert all(torch.equal(c[target[0][0]], k) for c, k in zip(caches, keep))  # page 0 of chunk a untouched
        page_bytes = PageTable(caches).bytes_per_page
        got_a = pack_pages(caches, torch.tensor(target[0][1:]))
        want_a = torch.cat([expected["a"].view(len(caches), PAGES, -1)[i, 1] for i in range(len(caches))])
        assert got_a.numel() == page_bytes and torch.equal(got_a, want_a)
        assert torch.equal(pack_pages(caches, torch.tensor(target[1])), pack_pages(caches, torch.tensor(src["b"])))
        assert torch.equal(pack_pages(caches, torch.tensor(target[2])), expected["c"])


def test_hybrid_state_objects_stay_exact_on_an_fp8_ssd(tmp_path):
    caches = layers(seed=11)
    state = gdn_pages(NB, 1024, 1000, seed=4)
    with rig(tmp_path, caches, state=state) as (engine, store):
        src, st = {"a": blocks_of(0)}, {"a": [5]}
        assert engine.write(WriteOrder(1, ("a",), ("a",), 0, Tier.GPU, "write-through"), src, st).result().ok
        assert store.info(object_key("a", "state")).length == engine.state_bytes
        job = engine.load(ReloadPlan(1, ("a",), (Tier.SSD,), "a", Tier.SSD, 8, 0, 0, False), [blocks_of(0, 16)], [9])
        assert job.wait().ok
        assert torch.equal(state[0][9], state[0][5])


def test_a_corrupt_fp8_object_is_a_failed_load_not_wrong_kv(tmp_path):
    caches = layers(seed=13)
    with rig(tmp_path, caches) as (engine, store):
        assert engine.write(WriteOrder(1, ("a",), (), 0, Tier.GPU, "write-through"), {"a": blocks_of(0)}).result().ok
        before = [c[blocks_of(0, 16)].clone() for c in caches]
        flip_byte(drive_file(tmp_path / "d0"), 8192 + 100)  # slot 0's payload
        result = engine.load(plan(["a"], [Tier.SSD]), [blocks_of(0, 16)]).wait()
        assert result.failed == (ObjectKey("a", "kv"),) and result.valid_chunks == 0
        assert all(torch.equal(c[blocks_of(0, 16)], b) for c, b in zip(caches, before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_cache_dtypes(tmp_path, dtype):
    caches = layers(seed=17, dtype=dtype)
    with rig(tmp_path, caches, ssd_slots=8) as (engine, _):
        assert engine.kv_ssd_bytes == fp8_bytes(engine.kv_bytes, dtype.itemsize)
        assert engine.write(WriteOrder(1, ("a",), (), 0, Tier.GPU, "write-through"), {"a": blocks_of(0)}).result().ok
        assert engine.load(plan(["a"], [Tier.SSD]), [blocks_of(0, 16)]).wait().ok
        assert torch.equal(pack_pages(caches, torch.tensor(blocks_of(0, 16))), fp8_round_trip(caches, blocks_of(0)))


def test_caches_fp8_cannot_take_are_refused_at_build(tmp_path):
    with rig(tmp_path, layers(head_dim=8)) as (engine, _):  # 4 x 2 x 2 x 8 = 128 elements per page: one group
        assert engine.kv_ssd_bytes == fp8_bytes(engine.kv_bytes, 2)
    with pytest.raises(ValueError, match="128"):  # 4 x 2 x 3 = 24 elements per page
        with rig(tmp_path, [torch.zeros(NB, 4, 2, 3, dtype=torch.bfloat16)]):
            pass
    with pytest.raises(ValueError, match="dtype|bf16|element"):  # vLLM's own fp8 cache: bytes already
        with rig(tmp_path, [torch.zeros(NB, 4, 2, 2, 16, dtype=torch.uint8)]):
            pass
    with pytest.raises(ValueError, match="ssd_dtype"):
        with rig(tmp_path, layers(), ssd_dtype="int4"):
            pass


def test_tiered_cache_with_fp8_holds_more_chunks_and_reloads_them(tmp_path):
    """Control and data plane together (open_data_plane sizes SSD parts for the FP8 objects): SSD
    bytes for 5 bf16 chunks hold all 7 chunks of a prompt in FP8, the counters are in stored
    bytes, and every chunk reloaded from SSD is the FP8 round trip of what was committed (from
    DRAM: exact)."""
    caches = layers(seed=19, head_dim=64)  # 12 KiB chunks: slots of 12 KiB, FP8 parts of 8 KiB
    kv_bytes = PageTable(caches).staging_bytes(PAGES)
    ssd_bytes = 4096 + 7 * (4096 + (8 << 10))  # the drive file: a superblock, 7 slots (header + FP8 part)
    config = SariaConfig.preset("full-duplicate", chunk=ChunkSpec(chunk_tokens=8, checkpoint_tokens=64),
                                dram=Capacity(nbytes=2 * kv_bytes), ssd=Capacity(nbytes=ssd_bytes), ssd_dtype="fp8")
    hashes = [f"h{i}" for i in range(7)]
    own = {h: blocks_of(i) for i, h in enumerate(hashes)}
    with TieredCache(config, caches, block_tokens=BLOCK_TOKENS, ssd_paths=[str(tmp_path)]) as cache:
        engine = cache.engine
        assert engine.kv_ssd_bytes == fp8_bytes(kv_bytes, 2) and engine.ssd.total_parts == 7
        assert size_tiers(dataclasses.replace(cache.config, ssd_dtype="auto"), 1).ssd.units == 5  # bf16: 5 chunks
        assert engine.ssd.part_bytes < engine.host_pool.slot_bytes  # parts sized for the FP8 objects
        exact = {h: pack_pages(caches, torch.tensor(own[h])) for h in hashes}
        rounded = {h: fp8_round_trip(caches, own[h]) for h in hashes}
        cache.commit(hashes, own, plan=cache.lookup(hashes))
        cache.drain()
        again = cache.lookup(hashes)
        assert again.num_chunks == 7 and again.ssd_chunks >= 5
        target = [blocks_of(i, 16) for i in range(7)]
        assert cache.load(again, target).wait().ok
        for h, source, pages in zip(hashes, again.kv_sources, target):
            assert torch.equal(pack_pages(caches, torch.tensor(pages)), rounded[h] if source is Tier.SSD else exact[h])
        cache.commit(hashes, own, plan=again)
        cache.drain()
        counters = cache.counters()
        assert counters["control"]["ssd_bytes_written"] == 7 * engine.kv_ssd_bytes
        assert counters["data"]["engine"]["ssd_write_bytes"] == 7 * engine.kv_ssd_bytes
        assert counters["data"]["engine"]["ssd_to_gpu_bytes"] == again.ssd_chunks * engine.kv_ssd_bytes

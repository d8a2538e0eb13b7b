"""Layer-wise reloads (saria.dataplane.transfer.layerwise) on real tensors, a real host pool and a
real SSD store: held against whole reloads of the same plans (differential, hypothesis over plans,
tiers, skipped pages and slot layouts), layer by layer (a layer's pages are final once its wait
returns), with failed objects that leave every layer of their pages untouched."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kernel_cases import fresh_like, vllm_layers
from saria.config import SariaConfig
from saria.control import ObjectKey, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import Coordinator, HostPool, SSDStore, TransferEngine, object_key
from saria.dataplane.ssd.format import Geometry
from saria.kernels import PageTable
from ssd_cases import drive_file, flip_byte

# Examples of the random-step hunt; SARIA_LAYERWISE_EXAMPLES=500 for a longer one.
EXAMPLES = int(os.environ.get("SARIA_LAYERWISE_EXAMPLES", "25"))

PAGES = 2  # pages per chunk
NB = 80


def caches_of(bs: int, h: int, d: int, layers: int = 3, seed: int = 0) -> list[torch.Tensor]:
    return vllm_layers(NB, bs, h, d, torch.bfloat16, layers=layers, seed=seed)


@contextlib.contextmanager
def rig(tmp_path, caches, slot: int, *, slots: int = 24, ssd_slots: int = 24, layers=None):
    """An engine over ``caches`` with a host pool of ``slots`` slots and an SSD store:
    ``(engine, engine, store)`` (objects are stored from the pages ``[2i, 2i + 1]`` and reloaded
    into pages from 20 on, of the same tensors)."""
    (tmp_path / "d").mkdir(exist_ok=True)
    with HostPool(slots * slot, slot) as pool, \
            SSDStore([tmp_path / "d"], 4096 + ssd_slots * (4096 + slot), slot) as store:
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store)
        engine.layerwise(layers)
        try:
            yield engine, engine, store
        finally:
            engine.close()


def plan(chunks, sources, plan_id=1):
    return ReloadPlan(plan_id, tuple(chunks), tuple(sources), None, None, len(chunks) * 8, 0, 0, False)


def put(src: TransferEngine, chunks, tiers):
    """Store (DRAM) or write (SSD) chunk ``c`` from the source pages ``[2i, 2i + 1]``."""
    blocks = {c: [PAGES * i, PAGES * i + 1] for i, c in enumerate(chunks)}
    dram = tuple(c for c, t in zip(chunks, tiers) if t is Tier.DRAM)
    ssd = tuple(c for c, t in zip(chunks, tiers) if t is Tier.SSD)
    if dram:
        assert src.store(StoreOrder(1, dram, (), 0), blocks).result().ok
    if ssd:
        assert src.write(WriteOrder(2, ssd, (), 0, Tier.GPU, "write-through"), blocks).result().ok
    return blocks


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bf16 bytes hold NaNs, which torch.equal never calls equal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_dram_and_ssd_chunks_land_layer_by_layer_as_a_whole_reload_would(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        chunks = ["a", "b", "c", "d"]
        tiers = [Tier.DRAM, Tier.SSD, Tier.DRAM, Tier.SSD]
        put(src, chunks, tiers)
        targets = [[40 + PAGES * i, 41 + PAGES * i] for i in range(4)]
        step = dst.load_layers([(plan(chunks, tiers), targets, 0)])
        for layer in range(3):
            step.wait_layer(layer)
            for i in range(4):  # this layer's pages are final now
                for a, b in zip([PAGES * i, PAGES * i + 1], targets[i]):
                    assert torch.equal(caches[layer][a].view(torch.uint8), dst.kv_table.tensors[layer][b].view(torch.uint8))
        (result,) = step.finish()
        assert result.ok and result.valid_chunks == 4
        counters = dst.counters()["engine"]
        assert counters["layerwise_steps"] == 1 and counters["layer_waits"] == 3 and counters["layerwise_objects"] == 4


def test_objects_over_several_host_slots_and_skipped_pages(tmp_path):
    caches = caches_of(16, 4, 32)  # 8 KiB per tensor page: an object is 48 KiB, three 16 KiB slots
    with rig(tmp_path, caches, 16384) as (src, dst, store):
        assert dst.layerwise().capable
        put(src, ["x", "y"], [Tier.DRAM, Tier.SSD])
        targets = [[10, 11], [20, 21]]
        before = [t[10].clone() for t in dst.kv_table.tensors]
        step = dst.load_layers([(plan(["x", "y"], [Tier.DRAM, Tier.SSD]), targets, 1)])
        step.wait_all()
        (result,) = step.finish()
        assert result.ok
        for t, tensor in enumerate(dst.kv_table.tensors):
            assert same(tensor[10], before[t])  # the engine's own page is left alone
            assert same(tensor[11], caches[t][1])
            assert same(tensor[20], caches[t][2]) and same(tensor[21], caches[t][3])


def test_the_cta_cap_bounds_each_layers_launch_and_the_bytes_still_land(tmp_path, monkeypatch):
    """One step's copies are prepared once (one LayeredCopy per path and step) and each layer's
    launch honours the cap (max_programs: None the default, none on the CPU; 0 none)."""
    caches = caches_of(16, 4, 32)
    with rig(tmp_path, caches, 16384) as (src, dst, store):
        paths = dst.layerwise()
        assert paths.max_programs is None  # the CPU: no cap by default
        put(src, ["x", "y"], [Tier.DRAM, Tier.SSD])
        prepared = []
        prepare = paths.prepare
        monkeypatch.setattr(paths, "prepare", lambda *a, **k: prepared.append(prepare(*a, **k)) or prepared[-1])
        monkeypatch.setattr(paths, "max_programs", 2)
        step = dst.load_layers([(plan(["x", "y"], [Tier.DRAM, Tier.SSD]), [[10, 11], [20, 21]], 0)])
        step.wait_all()
        (result,) = step.finish()
        assert result.ok and len(prepared) == 2  # one per path, for every layer
        for copy in prepared:
            assert len(copy) == 3 and all(0 < p <= 2 for p in copy.programs) or copy.backend == "torch"
        for t, tensor in enumerate(dst.kv_table.tensors):
            assert same(tensor[10], caches[t][0]) and same(tensor[11], caches[t][1])
            assert same(tensor[20], caches[t][2]) and same(tensor[21], caches[t][3])
        assert dst.counters()["engine"]["layer_copies"] == 6  # one launch per layer and path


def test_pages_that_straddle_host_slots_refuse_layer_by_layer(tmp_path):
    caches = caches_of(4, 3, 32)  # 1,536 B pages: the third page of a 4 KiB slot runs into the next one
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        assert not dst.layerwise().capable
        put(src, ["s"], [Tier.DRAM])
        assert not dst.layerwise_ok(plan(["s"], [Tier.DRAM]))
        with pytest.raises(ValueError, match="reload it whole"):
            dst.load_layers([(plan(["s"], [Tier.DRAM]), [[30, 31]], 0)])
        assert dst.load(plan(["s"], [Tier.DRAM]), [[30, 31]]).wait().ok  # the whole reload still works


def test_a_corrupt_ssd_object_fails_and_no_layer_of_its_pages_is_written(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        put(src, ["p", "q", "r"], [Tier.DRAM, Tier.SSD, Tier.SSD])
        part = store.info(object_key("q", "kv")).parts[0]
        flip_byte(drive_file(tmp_path / "d"), Geometry.for_capacity(4096 + 24 * (4096 + 4096), 4096).payload_offset(part.slot) + 3)
        targets = [[40, 41], [42, 43], [44, 45]]
        before = [t[42:44].clone() for t in dst.kv_table.tensors]
        step = dst.load_layers([(plan(["p", "q", "r"], [Tier.DRAM, Tier.SSD, Tier.SSD]), targets, 0)])
        step.wait_all()
        (result,) = step.finish()
        assert result.failed == (ObjectKey("q", "kv"),) and result.valid_chunks == 1
        for tensor, was in zip(dst.kv_table.tensors, before):
            assert same(tensor[42:44], was)  # every layer of the failed chunk untouched
        assert not store.contains(object_key("q", "kv"))


def test_one_step_of_several_plans_fails_only_the_plans_whose_objects_failed(tmp_path):
    """A step's plans are one job (StepJob): a corrupt SSD object of one plan and a missing DRAM
    object of another fail those plans only, from their own chunk on; the other plans of the step
    arrive whole, bit for bit, with their own byte counts."""
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        chunks = ["a", "b", "c", "d", "e", "f"]
        tiers = [Tier.DRAM, Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM, Tier.SSD]
        put(src, chunks, tiers)
        part = store.info(object_key("c", "kv")).parts[0]
        flip_byte(drive_file(tmp_path / "d"), Geometry.for_capacity(4096 + 24 * (4096 + 4096), 4096).payload_offset(part.slot) + 3)
        dst.dram.drop(ObjectKey("d", "kv"))
        loads = [(plan(["a", "b"], [Tier.DRAM, Tier.SSD], 1), [[40, 41], [42, 43]], 0),  # arrives
                 (plan(["c", "e"], [Tier.SSD, Tier.DRAM], 2), [[44, 45], [46, 47]], 0),  # c corrupt: nothing valid
                 (plan(["e", "d", "f"], [Tier.DRAM, Tier.DRAM, Tier.SSD], 3), [[48, 49], [50, 51], [52, 53]], 0),
                 (plan(["f"], [Tier.SSD], 4), [[54, 55]], 0)]  # arrives
        before = [t[44:46].clone() for t in dst.kv_table.tensors]
        step = dst.load_layers(loads)
        step.wait_all()
        first, second, third, fourth = step.finish(timeout=30)
        assert [r.plan_id for r in (first, second, third, fourth)] == [1, 2, 3, 4]
        assert first.ok and first.valid_chunks == 2 and fourth.ok and fourth.valid_chunks == 1
        assert second.failed == (ObjectKey("c", "kv"),) and second.valid_chunks == 0
        assert third.failed == (ObjectKey("d", "kv"),) and third.valid_chunks == 1
        kv = dst.kv_bytes
        assert (first.dram_bytes, first.ssd_bytes, third.dram_bytes, third.ssd_bytes, fourth.ssd_bytes) == \
            (kv, kv, 2 * kv, kv, kv)
        src_pages = {c: [PAGES * i, PAGES * i + 1] for i, c in enumerate(chunks)}
        for (_, targets, _), names in zip(loads, (["a", "b"], None, ["e"], ["f"])):
            for name, pages in zip(names or (), targets):
                assert all(same(t[pages], c[src_pages[name]]) for t, c in zip(dst.kv_table.tensors, caches))
        for tensor, was in zip(dst.kv_table.tensors, before):
            assert same(tensor[44:46], was)  # the corrupt object's pages untouched at every layer


def test_a_missing_dram_object_fails_its_chunk_and_the_others_land(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        put(src, ["m", "n"], [Tier.DRAM, Tier.DRAM])
        dst.dram.drop(ObjectKey("n", "kv"))
        step = dst.load_layers([(plan(["m", "n"], [Tier.DRAM, Tier.DRAM]), [[40, 41], [42, 43]], 0)])
        step.wait_all()
        (result,) = step.finish()
        assert result.failed == (ObjectKey("n", "kv"),) and result.valid_chunks == 1
        assert all(same(t[40], c[0]) for t, c in zip(dst.kv_table.tensors, caches))


def test_a_path_that_fails_part_way_fails_each_object_once_and_no_wait_hangs(tmp_path, monkeypatch):
    """The DRAM path fails one object (missing), then faults at its first layer (the pacer raises):
    the other object fails with the fault, neither is finished twice (a job refuses that), every
    layer's wait returns and the next step runs as usual."""
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        put(src, ["m", "n"], [Tier.DRAM, Tier.DRAM])
        dst.dram.drop(ObjectKey("n", "kv"))

        def fault(nbytes):
            raise RuntimeError("injected pacing fault")

        monkeypatch.setattr(dst.coordinator, "acquire", fault)
        step = dst.load_layers([(plan(["m", "n"], [Tier.DRAM, Tier.DRAM]), [[40, 41], [42, 43]], 0)])
        done = threading.Event()
        threading.Thread(target=lambda: (step.wait_all(), done.set()), daemon=True).start()
        assert done.wait(30), "a layer's wait hung after its path failed"
        (result,) = step.finish(timeout=30)
        assert set(result.failed) == {ObjectKey("m", "kv"), ObjectKey("n", "kv")} and result.valid_chunks == 0
        monkeypatch.undo()
        step = dst.load_layers([(plan(["m"], [Tier.DRAM]), [[44, 45]], 0)])
        done = threading.Event()
        threading.Thread(target=lambda: (step.wait_all(), done.set()), daemon=True).start()
        assert done.wait(30), "the path's thread did not survive the fault"
        (result,) = step.finish(timeout=30)
        assert result.ok and all(same(t[44], c[0]) for t, c in zip(dst.kv_table.tensors, caches))


def test_a_closed_ssd_store_fails_the_ssd_objects_and_no_wait_hangs(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        put(src, ["u", "v"], [Tier.DRAM, Tier.SSD])
        store.close()
        step = dst.load_layers([(plan(["u", "v"], [Tier.DRAM, Tier.SSD]), [[40, 41], [42, 43]], 0)])
        done = threading.Event()
        threading.Thread(target=lambda: (step.wait_all(), done.set()), daemon=True).start()
        assert done.wait(30), "a layer's wait hung after its path failed"
        (result,) = step.finish(timeout=30)
        assert result.failed == (ObjectKey("v", "kv"),) and result.valid_chunks == 1


def test_bad_requests_are_refused_before_anything_moves(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        put(src, ["a"], [Tier.DRAM])
        with pytest.raises(ValueError, match="block lists"):
            dst.load_layers([(plan(["a"], [Tier.DRAM]), [], 0)])
        with pytest.raises(ValueError, match="outside"):
            dst.load_layers([(plan(["a"], [Tier.DRAM]), [[NB, NB + 1]], 0)])
        state_plan = ReloadPlan(3, ("a",), (Tier.DRAM,), "a", Tier.DRAM, 8, 0, 0, False)
        with pytest.raises(ValueError, match="reload it whole"):
            dst.load_layers([(state_plan, [[40, 41]], 0)])
        with pytest.raises(ValueError, match="layers must group"):
            TransferEngine(PageTable(caches), host_pool=dst.host_pool, coordinator=dst.coordinator,
                           pages_per_chunk=PAGES).layerwise([[0], [0, 1]])
        assert dst.counters()["engine"]["layerwise_steps"] == 0
        step = dst.load_layers([(plan(["a"], [Tier.DRAM]), [[40, 41]], 0)])
        with pytest.raises(ValueError, match="not one of"):
            step.wait_layer(3)
        step.finish()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_layerwise_writes_exactly_the_planned_pages_over_random_steps(tmp_path_factory, data):
    """Random steps (1-3 plans of 1-4 chunks from DRAM or SSD, a skipped leading part, layers of
    one or two tensors, objects in one or several host slots, layers waited for in any order):
    each planned page holds its chunk's source page, every other page is untouched (the spec, page
    by page), and a whole reload of the same plans writes the same bytes (differential), with
    either backend of the step-wide copies."""
    tmp_path = tmp_path_factory.mktemp("lw")
    multi = data.draw(st.booleans(), label="objects over several host slots")
    caches = caches_of(16, 4, 32, layers=4) if multi else caches_of(4, 2, 8, layers=4)
    layers = [[0, 1], [2, 3]] if data.draw(st.booleans(), label="two tensors per layer") else None
    with rig(tmp_path, caches, 16384 if multi else 4096, slots=40, ssd_slots=40, layers=layers) as (_, eng, store):
        # The Triton kernel (interpreted here) or the torch twin: the same step-wide preparation.
        eng.layerwise().backend = data.draw(st.sampled_from(["auto", "torch"]), label="backend")
        loads, expect, c = [], {}, 0
        free = list(range(20, 44))
        for p in range(data.draw(st.integers(1, 3), label="plans")):
            n = data.draw(st.integers(1, 4), label="chunks")
            tiers = data.draw(st.lists(st.sampled_from([Tier.DRAM, Tier.SSD]), min_size=n, max_size=n), label="tiers")
            chunks, targets = [], []
            for tier in tiers:
                chunk, source = f"c{c}", [PAGES * (c % 10), PAGES * (c % 10) + 1]
                c += 1
                if tier is Tier.DRAM:
                    assert eng.store(StoreOrder(c, (chunk,), (), 0), {chunk: source}).result().ok
                else:
                    assert eng.write(WriteOrder(c, (chunk,), (), 0, Tier.GPU, "write-through"), {chunk: source}).result().ok
                chunks.append(chunk)
                targets.append([free.pop(0), free.pop(0)])
                expect.update(zip(targets[-1], source))
            skip = data.draw(st.integers(0, PAGES - 1), label="skip")
            for page in targets[0][:skip]:
                del expect[page]
            loads.append((plan(chunks, tiers, plan_id=p + 1), targets, skip))
        before = [t.clone() for t in eng.kv_table.tensors]
        step = eng.load_layers(loads)
        for layer in data.draw(st.permutations(range(len(eng.layerwise().layers))), label="wait order"):
            step.wait_layer(layer)
        assert all(r.ok for r in step.finish())
        for t, was in zip(eng.kv_table.tensors, before):
            for page in range(NB):
                assert same(t[page], was[expect[page]] if page in expect else was[page]), page
        layerwise = [t.clone() for t in eng.kv_table.tensors]
        shift = 24  # the same plans reloaded whole into pages 24 further on
        for p, targets, skip in loads:
            assert eng.load(p, [[b + shift for b in blocks] for blocks in targets], skip_pages=skip).wait().ok
        for t, got in zip(eng.kv_table.tensors, layerwise):
            for page in expect:
                assert same(t[page + shift], got[page])


def _slot_places_per_tensor(host_pool, page_offsets, slots, ids, keep=None):
    """slot_places as it was written first (tensor after tensor): the reference for the vectorized one."""
    slot_bytes = host_pool.slot_bytes
    parts = max(len(s) for s in slots)
    segments = {}
    seg_of = torch.zeros(len(slots), parts, dtype=torch.int64)
    start_of = torch.zeros(len(slots), parts, dtype=torch.int64)
    for o, held in enumerate(slots):
        for k, slot in enumerate(held):
            segment, start = host_pool.locate(slot)
            segments.setdefault(segment.data_ptr(), segment)
            seg_of[o, k], start_of[o, k] = segment.data_ptr(), start
    if keep is None:
        keep = torch.ones_like(ids, dtype=torch.bool)
    rows = torch.arange(len(slots)).unsqueeze(1)
    out = []
    for offsets in page_offsets:
        part, inner = offsets // slot_bytes, offsets % slot_bytes
        where = (start_of[rows, part] + inner)[keep]
        seg = seg_of[rows, part][keep]
        chosen = ids[keep]
        if len(segments) == 1:
            out.append([(next(iter(segments.values())), where, chosen)])
        else:
            out.append([(segment, where[seg == address], chosen[seg == address])
                        for address, segment in segments.items() if bool((seg == address).any())])
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_slot_layout_finds_every_page_where_the_per_tensor_reference_does(data):
    """slot_layout (one pass over every tensor of a step, for prepare_layered)
    against the first, tensor-by-tensor version: per tensor and pool segment the same offsets and
    ids, in the same order, whatever the objects' slots (one or several segments) and the pages kept."""
    from saria.dataplane.transfer.layerwise import slot_layout

    slot = 4096
    pool = HostPool(16 * slot, slot, segment_bytes=4 * slot)  # four segments
    tensors, pages = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 6))
    sizes = [data.draw(st.sampled_from([64, 512, 1024, 2048])) for _ in range(tensors)]
    per_object = pages * sum(sizes)
    parts = -(-per_object // slot)
    objects = data.draw(st.integers(1, max(1, 16 // parts)))
    free = data.draw(st.permutations(range(16)))
    slots = [free[o * parts:(o + 1) * parts] for o in range(objects)]
    start, page_offsets = 0, []
    for size in sizes:  # the packed layout: tensor after tensor, each its pages back to back
        page_offsets.append(start + torch.arange(pages, dtype=torch.int64) * size)
        start += pages * size
    ids = torch.tensor(data.draw(st.lists(st.integers(0, 99), min_size=objects * pages, max_size=objects * pages)),
                       dtype=torch.int64).view(objects, pages)
    keep = None if data.draw(st.booleans()) else torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=objects * pages, max_size=objects * pages))).view(objects, pages)
    buffers, chosen, where, places = slot_layout(pool, page_offsets, slots, ids, keep)
    want = _slot_places_per_tensor(pool, page_offsets, slots, ids, keep)
    assert len(want) == tensors and where.shape == places.shape == (tensors, chosen.numel())
    for t, w in enumerate(want):
        # the same pages per segment, in the same order (empty segments aside)
        got = [(buffers[b], places[t][where[t] == b], chosen[where[t] == b]) for b in range(len(buffers))]
        got = [g for g in got if g[1].numel()]
        w = [x for x in w if x[1].numel()]
        assert [g.data_ptr() for g, _, _ in got] == sorted((x.data_ptr() for x, _, _ in w),
                                                          key=[g.data_ptr() for g in buffers].index)
        by_segment = {x.data_ptr(): (a, c) for x, a, c in w}
        for g, a, c in got:
            assert torch.equal(a, by_segment[g.data_ptr()][0]) and torch.equal(c, by_segment[g.data_ptr()][1])
    pool.close()


def test_a_plan_of_a_step_job_is_a_job_of_its_own_for_a_cluster_load(tmp_path):
    """PlanLoad (what a cluster plan's CombinedLoad wraps in a layer-wise step): its outcome and
    wait are its own plan's result of the step job, a failure of another plan never shows in it,
    and CombinedLoad combines it with the cluster part as it did a plan's own job."""
    from saria.dataplane.transfer.load_job import PlanLoad
    from saria.integrations.vllm.cluster_loads import CombinedLoad

    class Fetched:  # the cluster part's outcome as ClusterLoad reports it: (chunks loaded, missed)
        def ready(self):
            return True

        def wait_on(self, streams):
            pass

        def outcome(self):
            return (1, 0)

        wait = outcome

    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        put(src, ["g", "h"], [Tier.DRAM, Tier.SSD])
        step = dst.load_layers([(plan(["g", "h"], [Tier.DRAM, Tier.SSD], 7), [[40, 41], [42, 43]], 0),
                                (plan(["missing"], [Tier.DRAM], 8), [[44, 45]], 0)])
        mine, other = PlanLoad(step.job, 0), PlanLoad(step.job, 1)
        mine.wait_on(dst.layerwise().streams)
        step.wait_all()
        results = step.end(timeout=30)
        assert mine.done() and mine.outcome() == results[0] and other.outcome() == results[1]
        assert mine.outcome().ok and mine.outcome().plan_id == 7 and mine.plan.plan_id == 7
        assert other.outcome().failed == (ObjectKey("missing", "kv"),)
        combined = CombinedLoad(mine, 2, Fetched())
        outcome = combined.outcome()
        assert (outcome.failed, outcome.valid_chunks, outcome.cluster_failed) == ((), 3, 0)
        failed = CombinedLoad(other, 1, Fetched())
        assert (failed.outcome().failed, failed.outcome().valid_chunks) == ((ObjectKey("missing", "kv"),), 0)
        assert mine.wait(timeout=30).ok and other.wait(timeout=30).plan_id == 8
        step.finish(timeout=30)


_id_value = st.one_of(st.integers(40, NB - 1), st.integers(40, NB - 1), st.integers(40, NB - 1),
                      st.sampled_from([-1, NB]), st.booleans(), st.just(41.0), st.just("41"), st.just(2 ** 64))
_block_list = st.one_of(
    st.lists(st.integers(40, NB - 1), min_size=PAGES, max_size=PAGES),  # the usual case
    st.lists(st.integers(40, NB - 1), min_size=PAGES, max_size=PAGES).map(tuple),
    st.lists(st.sampled_from([-2, -1, 40, 41, 42, 60, NB - 1, NB, NB + 1]), min_size=PAGES, max_size=PAGES),  # edges
    st.lists(_id_value, min_size=PAGES - 1, max_size=PAGES + 1),
    st.tuples(st.lists(st.integers(40, NB - 1), min_size=PAGES, max_size=PAGES), st.integers(0, PAGES - 1),
              st.sampled_from([True, 41.0, "41", -1, NB, 2 ** 64, None])).map(
        lambda t: t[0][:t[1]] + [t[2]] + t[0][t[1] + 1:]),  # one bad id in a good list
    st.lists(st.integers(40, NB - 1), min_size=PAGES, max_size=PAGES).map(lambda v: torch.tensor(v)),
    st.none(),
)


def _refusal_one_by_one(engine: TransferEngine, loads) -> str | None:
    """What load_layers must refuse, checked plan by plan and id list by id list as a reload of
    each plan alone checks them (Tables.ids): the first error's message, or None."""
    for p, kv_blocks, skip in loads:
        if len(kv_blocks) != p.num_chunks:
            return f"plan {p.plan_id} has {p.num_chunks} chunks but {len(kv_blocks)} block lists"
        for i, blocks in enumerate(kv_blocks):
            try:
                engine._tables.ids("kv", f"the kv object of chunk {i} of plan {p.plan_id}", blocks)
            except ValueError as exc:
                return str(exc)
        if not 0 <= skip < PAGES or (skip and not p.num_chunks):
            return f"skip_pages must be in [0, {PAGES}) and needs a chunk, got {skip}"
    return None


@settings(max_examples=4 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_load_layers_refuses_every_bad_id_as_the_one_by_one_check_does(tmp_path, data):
    """The hook checks a step's block ids in one batch (Tables.vouch) and hands them to the path
    threads, which make the load items: whatever the lists (ints out of range, bools, floats,
    strings, wrong lengths, tuples, tensors, None), a step is refused with the first error of the
    one-by-one check, before anything started; a step accepted loads into exactly the ids given."""
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        chunks = ["a", "b", "c"]
        put(src, chunks, [Tier.DRAM] * 3)
        loads = []
        for p in range(data.draw(st.integers(1, 3), label="plans")):
            n = data.draw(st.integers(0, 2), label="chunks")
            lists = data.draw(st.lists(_block_list, min_size=n, max_size=n), label="ids")
            if n and data.draw(st.integers(0, 9), label="short") == 0:
                lists = lists[:-1]
            skip = data.draw(st.sampled_from([0, 0, 1, PAGES]), label="skip")
            loads.append((plan(chunks[:n], [Tier.DRAM] * n, plan_id=p + 1), lists, skip))
        expected = _refusal_one_by_one(dst, loads)
        before = dst.counters()["engine"]["layerwise_steps"]
        if expected is not None:
            with pytest.raises(ValueError) as refused:
                dst.load_layers(loads)
            assert str(refused.value) == expected
            assert dst.counters()["engine"]["layerwise_steps"] == before  # nothing started
            return
        step = dst.load_layers(loads)
        results = step.finish(timeout=30)
        given_ids = {(p.plan_id, i): [int(x) for x in blocks] for p, lists, _ in loads
                     for i, blocks in enumerate(lists)}
        flat = [x for ids in given_ids.values() for x in ids]
        assert [r.plan_id for r in results] == [p.plan_id for p, _, _ in loads]
        assert all(r.ok for r in results) or len(set(flat)) < len(flat)  # a page named twice fails its copy
        made = {(loads[item.plan][0].plan_id, item.index): item.blocks.on(torch.device("cpu")).tolist()
                for item in step.job.items}
        assert made == given_ids
        assert all(item.skip == (loads[item.plan][2] if item.index == 0 else 0) for item in step.job.items)


def test_a_path_thread_that_cannot_make_its_items_fails_its_objects_and_no_wait_hangs(tmp_path, monkeypatch):
    """The path threads make the load items (StepJob.take): one that cannot fails every object of
    its tier (StepJob.abandon), each plan's result naming them from its own chunks on, while the
    other path's objects land; no layer's wait hangs."""
    from saria.dataplane.transfer.load_job import StepJob

    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as (src, dst, store):
        put(src, ["a", "b", "c"], [Tier.DRAM, Tier.SSD, Tier.DRAM])
        real = StepJob.take

        def take(job, dram):
            if dram:
                raise MemoryError("no room for the items")
            return real(job, dram)

        monkeypatch.setattr(StepJob, "take", take)
        failures = dst.counters()["engine"]["load_failures"]
        step = dst.load_layers([(plan(["a", "b"], [Tier.DRAM, Tier.SSD], plan_id=1), [[40, 41], [42, 43]], 0),
                                (plan(["b"], [Tier.SSD], plan_id=2), [[44, 45]], 0),
                                (plan(["c"], [Tier.DRAM], plan_id=3), [[46, 47]], 0)])
        done = threading.Event()
        threading.Thread(target=lambda: (step.wait_all(), done.set()), daemon=True).start()
        assert done.wait(30), "a layer's wait hung after a path could not make its items"
        first, second, third = step.finish(timeout=30)
        assert first.failed == (ObjectKey("a", "kv"),) and first.valid_chunks == 0
        assert second.ok and second.valid_chunks == 1  # the SSD path's objects landed
        assert third.failed == (ObjectKey("c", "kv"),) and third.valid_chunks == 0
        assert dst.counters()["engine"]["load_failures"] == failures + 2
        for layer in caches:  # the SSD object's pages hold what was stored from pages [2, 3]
            assert same(layer[44], layer[2]) and same(layer[45], layer[3])

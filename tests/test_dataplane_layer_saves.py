"""Layer-wise saves (saria.dataplane.transfer.layer_saves) on real tensors, a real host pool, a real
SSD store and (where Mooncake is installed) a real cluster: each layer's pages copied into host
slots as the "forward" writes them, held against the spec (an object's DRAM bytes are the packed
bytes of its pages, page by page, as they were when their layer was saved), reloaded whole and
layer by layer, written to SSD from DRAM with checksums computed there, hypothesis over random
steps, host pool exhaustion, faults mid-step and refusals before anything moved."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cluster_cases import mooncake_available, start_cluster
from kernel_cases import vllm_layers
from saria.config import SariaConfig
from saria.control import DropOrder, ObjectKey, PromoteOrder, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import Completion, Coordinator, HostPool, SSDStore, TransferEngine, object_key
from saria.dataplane.ssd.format import Geometry
from saria.kernels import PageTable, pack_pages
from saria.kernels.checksum import checksum
from ssd_cases import drive_file, flip_byte

# Examples of the random-step hunt; SARIA_LAYERWISE_EXAMPLES=500 for a longer one.
EXAMPLES = int(os.environ.get("SARIA_LAYERWISE_EXAMPLES", "25"))

PAGES = 2  # pages per chunk
NB = 80


def caches_of(bs: int, h: int, d: int, layers: int = 3, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    return [t.to(device) for t in vllm_layers(NB, bs, h, d, torch.bfloat16, layers=layers, seed=seed)]


@contextlib.contextmanager
def rig(tmp_path, caches, slot: int, *, slots: int = 24, ssd: bool = True, layers=None, segment: int = 1 << 30):
    """An engine over ``caches`` with a host pool of ``slots`` slots (segments of ``segment``
    bytes) and, if ``ssd``, an SSD store of parts of one slot."""
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(HostPool(slots * slot, slot, segment_bytes=segment))
        store = None
        if ssd:
            (tmp_path / "d").mkdir(exist_ok=True)
            store = stack.enter_context(SSDStore([tmp_path / "d"], 4096 + 24 * (4096 + slot), slot))
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store)
        engine.layerwise(layers)
        try:
            yield engine
        finally:
            engine.close()


def sources(chunks, first: int = 0) -> dict:
    """Chunk ``i`` from the pages ``[2i, 2i + 1]`` (from ``first`` on)."""
    return {c: [first + PAGES * i, first + PAGES * i + 1] for i, c in enumerate(chunks)}


def dram_bytes(engine: TransferEngine, chunk) -> torch.Tensor:
    return torch.cat(engine.dram.views(engine.dram_object(chunk)))


def packed(engine: TransferEngine, blocks) -> torch.Tensor:
    """The spec: an object's bytes are the packed bytes of its pages."""
    return pack_pages(engine.kv_table, torch.tensor(blocks)).view(-1).cpu()


def plan(chunks, tier, plan_id=1):
    return ReloadPlan(plan_id, tuple(chunks), tuple(tier for _ in chunks), None, None, len(chunks) * 8, 0, 0, False)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bf16 bytes hold NaNs, which torch.equal never calls equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def forward(engine: TransferEngine, step, order, seed: int = 7) -> None:
    """A "forward" that writes each layer's pages anew, then saves it (vLLM's save_kv_layer)."""
    g = torch.Generator().manual_seed(seed)
    for layer in order:
        t = engine.kv_table.tensors[layer]
        fresh = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
        t.view(-1).view(torch.uint8).copy_(fresh.to(t.device))
        step.save_layer(layer)


def test_layer_by_layer_saves_hold_each_layer_as_written_and_reload_whole_and_layer_by_layer(tmp_path):
    caches = caches_of(16, 4, 32)  # 8 KiB per tensor page: an object is 48 KiB, three 16 KiB slots
    with rig(tmp_path, caches, 16384) as eng:
        chunks = ["a", "b", "c", "d"]
        blocks = sources(chunks)
        orders = [StoreOrder(1, ("a", "b"), (), 0), PromoteOrder(2, ("c", "d"), (), 0)]
        step = eng.store_layers(orders, blocks)
        assert not any(run.released.is_set() or run.completion.done() for run in step.runs)
        forward(eng, step, [0, 1, 2])  # each layer's pages change just before its save
        runs = step.finish()
        assert runs == step.runs and [r.order for r in runs] == orders
        assert all(r.released.is_set() and r.completion.result().ok and not r.completion.result().failed
                   for r in runs)
        for c in chunks:
            assert same(dram_bytes(eng, c), packed(eng, blocks[c]))  # the layers as the forward wrote them
            assert eng.dram_object(c).checksums == (None, None, None)
        whole = sources(chunks, 40)
        assert eng.load(plan(chunks, Tier.DRAM), [whole[c] for c in chunks]).wait().ok
        layered = sources(chunks, 56)
        load = eng.load_layers([(plan(chunks, Tier.DRAM, 2), [layered[c] for c in chunks], 0)])
        load.wait_all()
        assert load.finish()[0].ok
        for t in eng.kv_table.tensors:
            for c in chunks:
                for a, b, e in zip(blocks[c], whole[c], layered[c]):
                    assert same(t[b], t[a]) and same(t[e], t[a])
        counters = eng.counters()["engine"]
        assert counters["layerwise_save_steps"] == 1 and counters["layerwise_store_objects"] == 4
        assert counters["layer_saves"] == 3 and counters["layer_saves_late"] == 0
        assert counters["gpu_to_dram_bytes"] == 4 * eng.kv_bytes and counters["store_failures"] == 0
        assert eng.host_pool.used_slots == eng.dram.held_slots() == 12


def test_layers_saved_out_of_order_and_one_never_saved(tmp_path):
    caches = caches_of(4, 2, 8, layers=4)
    with rig(tmp_path, caches, 4096, ssd=False) as eng:
        blocks = sources(["x", "y", "z"])
        step = eng.store_layers([StoreOrder(1, ("x", "y", "z"), (), 0)], blocks)
        forward(eng, step, [3, 0, 2])  # layer 1 never reaches its hook
        with pytest.raises(ValueError, match="saved already"):
            step.save_layer(0)
        with pytest.raises(ValueError, match="not one of"):
            step.save_layer(4)
        with pytest.raises(ValueError, match="not one of"):
            step.save_layer(-1)
        step.finish()  # copies layer 1 as the pages are now
        assert all(same(dram_bytes(eng, c), packed(eng, blocks[c])) for c in blocks)
        assert step.finish() is step.runs  # again: the same, done runs
        with pytest.raises(RuntimeError, match="finished"):
            step.save_layer(1)
        counters = eng.counters()["engine"]
        assert counters["layer_saves"] == 4 and counters["layer_saves_late"] == 1


def test_a_step_handed_to_the_retire_thread_ends_once_for_every_waiter(tmp_path):
    """end() hands the step over and returns at once; finish() then waits for the retire thread
    (from any thread, before or after it ran), and every order's released and completion are set."""
    import threading

    caches = caches_of(4, 2, 8, layers=2)
    with rig(tmp_path, caches, 4096, ssd=False) as eng:
        blocks = sources(["x", "y"])
        orders = [StoreOrder(1, ("x",), (), 0), StoreOrder(2, ("y",), (), 0)]
        step = eng.store_layers(orders, blocks)
        forward(eng, step, [0, 1])
        finished = []
        waiter = threading.Thread(target=lambda: finished.append(step.finish(timeout=10)))
        assert step.end() is step.runs  # never waits
        waiter.start()
        waiter.join()
        assert finished == [step.runs] and step.finish(timeout=0) is step.runs
        assert all(r.released.is_set() and r.completion.result().ok for r in step.runs)
        assert all(same(dram_bytes(eng, c), packed(eng, blocks[c])) for c in blocks)


def test_a_steps_start_makes_no_torch_op_on_the_callers_thread(tmp_path):
    """What the bind and start_load_kv hooks call (store_layers, load_layers, with block ids as
    vLLM gives them, lists of ints) runs no torch function on the caller's thread: each releases
    the GIL, and the hook then waits for saria's own threads to hand it back. The ids become a
    tensor on the save and path threads (the step's copies are still exact)."""
    from torch.overrides import TorchFunctionMode

    class Record(TorchFunctionMode):  # the mode stack is per thread: only the caller's ops
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", repr(func)))
            return func(*args, **(kwargs or {}))

    caches = caches_of(4, 2, 8, layers=2)
    with rig(tmp_path, caches, 4096, ssd=False) as eng:
        blocks = sources(["x", "y"])
        eng.store(StoreOrder(1, ("x", "y"), (), 0), blocks).result()
        eng.load_layers([(plan(["x"], Tier.DRAM), [[20, 21]], 0)]).finish()  # warm: threads started
        eng.store_layers([StoreOrder(2, ("w",), (), 0)], {"w": [40, 41]}).finish()
        with Record() as mode:
            load = eng.load_layers([(plan(["x", "y"], Tier.DRAM, 3), [[30, 31], (32, 33)], 0)])
            step = eng.store_layers([StoreOrder(4, ("z",), (), 0)], {"z": [50, 51]})
        assert mode.calls == []
        load.wait_all()
        assert load.finish()[0].ok
        for t in eng.kv_table.tensors:  # the stored objects came from pages 0-3, unchanged since
            assert same(t[30], t[0]) and same(t[31], t[1]) and same(t[32], t[2]) and same(t[33], t[3])
        forward(eng, step, [0, 1])
        assert step.finish()[0].completion.result().ok
        assert same(dram_bytes(eng, "z"), packed(eng, [50, 51]))


def test_a_full_host_pool_fails_the_objects_that_do_not_fit_and_leaks_no_slot(tmp_path):
    caches = caches_of(16, 4, 32)  # three slots per object
    with rig(tmp_path, caches, 16384, slots=8, ssd=False) as eng:
        blocks = sources(["p", "q", "r", "s"])
        step = eng.store_layers([StoreOrder(1, ("p", "q"), (), 0), StoreOrder(2, ("r", "s"), (), 0)], blocks)
        forward(eng, step, [0, 1, 2])
        first, second = (run.completion.result() for run in step.finish())
        assert first.ok and first.failed == ()
        assert not second.ok  # no object of it fit: the order failed
        assert eng.dram_object("r") is None and eng.dram_object("s") is None
        assert all(same(dram_bytes(eng, c), packed(eng, blocks[c])) for c in ("p", "q"))
        assert eng.host_pool.free_slots == 8 - 6 and eng.dram.held_slots() == 6
        counters = eng.counters()["engine"]
        assert counters["host_pool_full"] == 2 and counters["store_failures"] == 2
        eng.dram.drop(ObjectKey("q", "kv"))  # 5 slots free
        step = eng.store_layers([StoreOrder(3, ("p", "t"), (), 0)], {"p": [22, 23], "t": [20, 21]})
        step.finish()  # "p" takes 3 slots and replaces the old "p" (whose slots go back), "t" does not fit
        (run,) = step.runs
        assert run.completion.result() == Completion(3, True, (ObjectKey("t", "kv"),))
        assert same(dram_bytes(eng, "p"), packed(eng, [22, 23]))
        assert eng.host_pool.free_slots == 5 and eng.dram.held_slots() == 3


def _record_pool_calls(pool, calls: list) -> None:
    """Record (method, thread name) of every allocate/free of ``pool``."""
    import threading

    for name in ("allocate", "free"):
        real = getattr(pool, name)

        def record(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        setattr(pool, name, record)


def test_a_steps_drops_run_off_the_callers_thread_before_it_takes_its_slots(tmp_path):
    """store_layers(..., drops): the DRAM drops of the step and its slot allocation run on the save
    thread (never on the hook's), the drops first: the slots they free hold the step's objects in a
    pool that would be full without them. By the time end() returns they ran."""
    import threading

    caches = caches_of(16, 4, 32)  # three slots per object
    with rig(tmp_path, caches, 16384, slots=8, ssd=False) as eng:
        eng.store(StoreOrder(1, ("p", "q"), (), 0), sources(["p", "q"])).result()
        assert eng.host_pool.free_slots == 2
        calls: list = []
        _record_pool_calls(eng.host_pool, calls)
        blocks = sources(["r", "s"], 20)
        step = eng.store_layers([StoreOrder(2, ("r", "s"), (), 0)], blocks,
                                [DropOrder(3, ("p", "q"), (), 0, Tier.DRAM)])
        assert calls == []  # nothing freed or taken on the caller's thread
        forward(eng, step, [0, 1, 2])
        assert step.end() is step.runs
        assert eng.dram_object("p") is None and eng.dram_object("q") is None  # the drops ran
        (run,) = step.finish(timeout=10)
        assert run.completion.result() == Completion(2, True, ())  # both fit: the drops came first
        assert all(same(dram_bytes(eng, c), packed(eng, blocks[c])) for c in ("r", "s"))
        me = threading.current_thread().name
        assert [c for c, _ in calls] == ["free", "allocate", "allocate"]  # the drops: one free of their slots
        assert all(thread != me for _, thread in calls)
        assert eng.host_pool.free_slots == 2 and eng.dram.held_slots() == 6 and not step.drop_failures
        assert eng.counters()["engine"]["dram_drops"] == 2
        with pytest.raises(ValueError, match="DRAM drops"):  # refused before anything started
            eng.store_layers([StoreOrder(4, ("t",), (), 0)], sources(["t"]), [DropOrder(5, ("r",), (), 0, Tier.SSD)])
        assert eng.dram_object("r") is not None


def test_a_cpu_step_whose_hooks_saved_every_layer_is_retired_without_waking_a_thread_from_end(tmp_path):
    """On the CPU the save thread, once it ran the last layer a hook handed it, hands the step to
    the retire thread itself: the objects are published and the runs completed before end(), and
    end() (wait_for_save) hands nothing over (a hand-off wakes a thread). A step with a layer no
    hook saved is still handed over by end()."""
    import threading

    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096, ssd=False) as eng:
        handed: list[str] = []
        retirer = eng._retirer
        real = retirer.after

        def after(*args, **kwargs):
            handed.append(threading.current_thread().name)
            return real(*args, **kwargs)

        retirer.after = after
        blocks = sources(["x", "y"])
        step = eng.store_layers([StoreOrder(1, ("x", "y"), (), 0)], blocks)
        forward(eng, step, [2, 0, 1])
        (run,) = step.runs
        assert run.completion.result(timeout=10).ok and run.released.is_set()  # before end()
        assert step.end() is step.runs and step.finish(timeout=10) is step.runs
        assert handed == ["saria-layer-saves"]
        assert all(same(dram_bytes(eng, c), packed(eng, blocks[c])) for c in blocks)
        handed.clear()
        step = eng.store_layers([StoreOrder(2, ("z",), (), 0)], sources(["z"], 20))
        forward(eng, step, [0, 2])  # layer 1 reaches no hook
        assert not step.runs[0].completion.done()
        step.end()
        assert step.finish(timeout=10)[0].completion.result().ok
        assert handed == [threading.current_thread().name]


def test_a_steps_drops_run_once_whatever_ends_it(tmp_path):
    """The drops of a step run exactly once: by end() when no layer prepared the step, by the
    close that fails it before any layer; one that fails is named, the others still run."""
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096, ssd=False) as eng:
        eng.store(StoreOrder(1, ("a", "b", "c"), (), 0), sources(["a", "b", "c"])).result()
        free = eng.host_pool.free_slots
        step = eng.store_layers([StoreOrder(2, ("u",), (), 0)], sources(["u"], 20),
                                [DropOrder(3, ("a",), (), 0, Tier.DRAM)])
        step.end()  # no hook saved a layer: end() runs the drop, the save thread the layers
        assert eng.dram_object("a") is None
        assert step.finish(timeout=10)[0].completion.result().ok
        real = eng.dram.drop_many

        def faulty(keys):
            if ObjectKey("b", "kv") in keys:
                raise OSError("injected")
            return real(keys)

        eng.dram.drop_many = faulty
        drop_b, drop_c = DropOrder(5, ("b",), (), 0, Tier.DRAM), DropOrder(6, ("c",), (), 0, Tier.DRAM)
        step = eng.store_layers([StoreOrder(4, ("v",), (), 0)], sources(["v"], 30), [drop_b, drop_c])
        eng.close()  # before any layer: the step fails, its drops still run
        (run,) = step.runs
        assert run.completion.done() and not run.completion.result().ok and run.released.is_set()
        assert eng.dram_object("c") is None and eng.dram_object("v") is None
        assert [(order, keys, type(exc)) for order, keys, exc in step.drop_failures] == \
            [(drop_b, [ObjectKey("b", "kv")], OSError)]
        assert eng.dram_object("b") is not None
        n = eng.host_pool.slots_for(eng.kv_bytes)  # a went and u came; c went, v never took a slot
        assert eng.host_pool.free_slots == free + n and eng.dram.held_slots() == 2 * n


def test_a_copy_refused_mid_step_fails_every_object_frees_the_slots_and_releases(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096, ssd=False) as eng:
        free = eng.host_pool.free_slots
        step = eng.store_layers([StoreOrder(1, ("u", "v"), (), 0)], sources(["u", "v"]))
        step.save_layer(0)
        caches[1].set_(caches[1].clone())  # the engine's pages of layer 1 re-pointed: its copy is refused
        step.save_layer(1)  # not raised into the forward
        (run,) = step.finish()
        assert run.released.is_set() and not run.completion.result().ok
        assert eng.dram_object("u") is None and eng.dram_object("v") is None
        assert eng.host_pool.free_slots == free
        assert eng.counters()["engine"]["store_failures"] == 2


def test_closing_the_engine_mid_step_fails_it_and_releases(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096, ssd=False) as eng:
        free = eng.host_pool.free_slots
        step = eng.store_layers([StoreOrder(1, ("u",), (), 0)], sources(["u"]))
        step.save_layer(2)
        eng.close()
        (run,) = step.runs
        assert run.released.is_set() and run.completion.done() and not run.completion.result().ok
        assert eng.host_pool.free_slots == free and eng.dram_object("u") is None
        step.save_layer(0)  # a forward still running: harmless
        assert step.finish()[0].completion.result().ok is False
        with pytest.raises(RuntimeError, match="closed"):
            eng.store_layers([StoreOrder(2, ("w",), (), 0)], sources(["w"]))


def test_saved_objects_go_to_ssd_from_dram_with_checksums_computed_there(tmp_path):
    caches = caches_of(16, 4, 32)
    with rig(tmp_path, caches, 16384) as eng:
        chunks = ["e", "f", "g"]
        blocks = sources(chunks)
        step = eng.store_layers([StoreOrder(1, tuple(chunks), (), 0)], blocks)
        forward(eng, step, [1, 0, 2])
        step.finish()
        spec = {c: packed(eng, blocks[c]) for c in chunks}
        write = eng.write(WriteOrder(2, tuple(chunks), (), 0, Tier.DRAM, "eviction")).result(timeout=30)
        assert write.ok and write.failed == ()
        for c in chunks:
            eng.dram.drop(ObjectKey(c, "kv"))
            parts = eng.ssd.info(object_key(c, "kv")).parts
            assert [p.checksum for p in parts] == [checksum(spec[c][k * 16384:(k + 1) * 16384]) for k in range(3)]
        targets = sources(chunks, 40)
        assert eng.load(plan(chunks, Tier.SSD), [targets[c] for c in chunks]).wait().ok
        for c in chunks:
            assert same(packed(eng, targets[c]), spec[c])
        # the checksums the write computed are checked: a flipped byte fails the reload
        part = eng.ssd.info(object_key("f", "kv")).parts[1]
        geometry = Geometry.for_capacity(4096 + 24 * (4096 + 16384), 16384)
        flip_byte(drive_file(tmp_path / "d"), geometry.payload_offset(part.slot) + 5)
        result = eng.load(plan(["f"], Tier.SSD, 3), [[60, 61]]).wait()
        assert result.failed == (ObjectKey("f", "kv"),)


@pytest.mark.skipif(not mooncake_available(), reason="Mooncake Store is not installed")
def test_saved_objects_put_to_the_cluster_with_checksums_computed_there(tmp_path, tmp_path_factory):
    from saria.dataplane.cluster import ClusterStore
    cluster = start_cluster(tmp_path_factory, node_bytes=64 << 20)
    caches = caches_of(16, 4, 32)
    try:
        with rig(tmp_path, caches, 16384, ssd=False, slots=16) as eng:
            blocks = sources(["h", "i"])
            step = eng.store_layers([StoreOrder(1, ("h", "i"), (), 0)], blocks)
            forward(eng, step, [0, 1, 2])
            step.finish()
            store = ClusterStore(cluster.master, "layer-saves|test", eng.host_pool, timeout_s=10.0)
            try:
                names = [object_key(c, "kv") for c in blocks]
                objs = [eng.dram_object(c) for c in blocks]
                # as the worker's cluster tier passes them: the DRAM copy's checksums, here all None
                futures = store.put_many(names, [eng.dram.views(o) for o in objs], [list(o.checksums) for o in objs])
                assert [f.result(timeout=30) for f in futures] == [eng.kv_bytes] * 2
                slots = eng.host_pool.allocate(eng.host_pool.slots_for(eng.kv_bytes))
                out = eng.host_pool.views(slots, eng.kv_bytes)
                assert store.get_many([names[1]], [out])[0].result(timeout=30) == eng.kv_bytes
                assert same(torch.cat(out), packed(eng, blocks["i"]))
                eng.host_pool.free(slots)
            finally:
                store.close()
    finally:
        cluster.stop()


def test_refusals_come_before_anything_moved(tmp_path):
    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as eng:
        free = eng.host_pool.free_slots
        good = StoreOrder(1, ("a",), (), 0)
        with pytest.raises(ValueError, match="store it whole"):
            eng.store_layers([good, StoreOrder(2, (), ("a",), 0)], sources(["a"]))
        with pytest.raises(ValueError, match="outside"):
            eng.store_layers([good, StoreOrder(3, ("b",), (), 0)], {"a": [0, 1], "b": [NB, NB + 1]})
        with pytest.raises(ValueError, match="no block ids"):
            eng.store_layers([good, StoreOrder(3, ("b",), (), 0)], {"a": [0, 1]})
        with pytest.raises(ValueError, match="needs 2 block ids"):
            eng.store_layers([StoreOrder(3, ("b",), (), 0)], {"b": [0, 1, 2]})
        with pytest.raises(ValueError, match="StoreOrders or PromoteOrders"):
            eng.store_layers([WriteOrder(4, ("a",), (), 0, Tier.GPU, "write-through")], sources(["a"]))
        with pytest.raises(ValueError, match="prewarm"):
            eng.store_layers([PromoteOrder(5, ("a",), (), 0, Tier.SSD)], sources(["a"]))
        assert eng.store_layers_ok(good) and not eng.store_layers_ok(StoreOrder(2, (), ("a",), 0))
        assert not eng.store_layers_ok(PromoteOrder(5, ("a",), (), 0, Tier.SSD))
        assert eng.host_pool.free_slots == free and len(eng.dram) == 0
        assert eng.counters()["engine"]["layerwise_save_steps"] == 0
    with rig(tmp_path, caches_of(4, 3, 32), 4096, ssd=False) as eng:  # 1,536 B pages straddle 4 KiB slots
        assert not eng.store_layers_ok(StoreOrder(1, ("s",), (), 0))
        with pytest.raises(ValueError, match="straddle"):
            eng.store_layers([StoreOrder(1, ("s",), (), 0)], sources(["s"]))


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_layer_saves_store_exactly_the_spec_over_random_steps(data):
    """Random steps (1-3 orders of 0-4 chunks, a chunk stored twice, layers of one or two tensors,
    objects in one or several host slots over one or several pool segments, a pool too small for
    some, layers saved in any order, some by finish; either backend): each object that landed holds the packed
    bytes of its pages as the "forward" left them, each that did not is named failed, and the
    pool's used slots are exactly the DRAM store's."""
    multi = data.draw(st.booleans(), label="objects over several host slots")
    caches = caches_of(16, 4, 32, layers=4) if multi else caches_of(4, 2, 8, layers=4)
    slot = 16384 if multi else 4096
    layers = [[0, 1], [2, 3]] if data.draw(st.booleans(), label="two tensors per layer") else None
    slots = data.draw(st.integers(1, 30), label="host slots")
    segment = slot * data.draw(st.sampled_from([1, 2, 5, 64]), label="slots per segment")
    with rig(None, caches, slot, slots=slots, ssd=False, layers=layers, segment=segment) as eng:
        # The Triton kernel (interpreted here) or the torch twin: the same step-wide preparation.
        eng.layerwise().backend = data.draw(st.sampled_from(["auto", "torch"]), label="backend")
        orders, blocks, c = [], {}, 0
        for o in range(data.draw(st.integers(1, 3), label="orders")):
            chunks = []
            for _ in range(data.draw(st.integers(0, 4), label="chunks")):
                chunk = data.draw(st.sampled_from([f"c{c}", "c0"]), label="chunk")  # "c0" again: stored twice
                c += 1
                if chunk in chunks:
                    continue
                chunks.append(chunk)
                blocks[chunk] = [data.draw(st.integers(0, NB - 1), label="page") for _ in range(PAGES)]
            kind = data.draw(st.sampled_from([StoreOrder, PromoteOrder]), label="kind")
            orders.append(kind(o + 1, tuple(chunks), (), 0))
        step = eng.store_layers(orders, blocks)
        groups = len(eng.layerwise().layers)
        saved = data.draw(st.permutations(range(groups)), label="save order")[:data.draw(st.integers(0, groups))]
        for layer in saved:  # the forward writes a layer's tensors, then saves it
            for t in eng.layerwise().layers[layer]:
                eng.kv_table.tensors[t].view(torch.uint8).view(-1)[::7] += 1
            step.save_layer(layer)
        runs = step.finish()
        stored = {}  # chunk -> the last order that stored it (a later one replaces an earlier)
        for order, run in zip(orders, runs):
            assert run.released.is_set()
            result = run.completion.result()
            failed = set(result.failed) if result.ok else {ObjectKey(ch, "kv") for ch in order.kv}
            assert result.ok == (len(failed) < len(order.kv) or not order.kv)
            for chunk in order.kv:
                if ObjectKey(chunk, "kv") not in failed:
                    stored[chunk] = order
        for chunk in blocks:
            obj = eng.dram_object(chunk)
            assert (obj is not None) == (chunk in stored)
            if obj is not None:
                assert same(dram_bytes(eng, chunk), packed(eng, blocks[chunk]))
        assert eng.host_pool.used_slots == eng.dram.held_slots()
        counters = eng.counters()["engine"]
        assert counters["layer_saves"] == groups and counters["layer_saves_late"] == groups - len(saved)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the device-side copies and events)")
def test_cuda_layer_saves_follow_the_forward_on_its_stream(tmp_path):
    caches = caches_of(16, 8, 128, layers=4, device="cuda")  # 32 KiB per tensor page
    with rig(tmp_path, caches, 1 << 16, slots=64, ssd=False) as eng:
        blocks = sources([f"k{i}" for i in range(8)])
        step = eng.store_layers([StoreOrder(1, tuple(blocks), (), 0)], blocks)
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):  # the forward: a slow kernel, then the layer's pages, then its save
            for layer in range(4):
                a = torch.randn(2048, 2048, device="cuda")
                for _ in range(4):
                    a = a @ a / 2048 ** 0.5
                t = eng.kv_table.tensors[layer]
                t.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                                 dtype=torch.uint8, device="cuda"))
                step.save_layer(layer)
        runs = step.finish()
        assert all(r.completion.result().ok and r.released.is_set() for r in runs)
        torch.cuda.synchronize()
        for chunk, ids in blocks.items():
            assert same(dram_bytes(eng, chunk), packed(eng, ids))


def test_a_layerwise_loads_results_are_made_by_its_last_path_thread(tmp_path, monkeypatch):
    """StepLoad.end (get_finished) returns the results the last path thread made as it ended
    the step: no LoadResult is made on the hook's thread; they are the step job's own results
    (made once for the step's plans)."""
    import threading

    from saria.dataplane.transfer.load_job import StepJob

    caches = caches_of(4, 2, 8)
    with rig(tmp_path, caches, 4096) as eng:
        eng.store(StoreOrder(1, ("x", "y"), (), 0), sources(["x", "y"])).result()
        made: list[str] = []
        real = StepJob._make

        def make(self):
            made.append(threading.current_thread().name)
            return real(self)

        monkeypatch.setattr(StepJob, "_make", make)
        load = eng.load_layers([(plan(["x"], Tier.DRAM), [[20, 21]], 0), (plan(["y", "z"], Tier.DRAM, 2),
                                                                           [[22, 23], [24, 25]], 0)])
        load.wait_all()
        me = threading.current_thread().name
        first, second = load.end()
        assert me not in made and made == ["saria-layers-dram"]
        assert first.ok and first.valid_chunks == 1
        assert second.failed == (ObjectKey("z", "kv"),) and second.valid_chunks == 1  # z is in no tier
        assert load.end() == [first, second]
        assert all(same(eng.kv_table.tensors[t][20 + p], eng.kv_table.tensors[t][p]) for t in range(3)
                   for p in range(4))


_bad_id = st.sampled_from([True, 41.0, "41", -1, NB, 2 ** 64, None])
_ids_list = st.one_of(
    st.lists(st.integers(0, NB - 1), min_size=PAGES, max_size=PAGES),  # the usual case
    st.lists(st.integers(0, NB - 1), min_size=PAGES, max_size=PAGES).map(tuple),
    st.tuples(st.lists(st.integers(0, NB - 1), min_size=PAGES, max_size=PAGES), st.integers(0, PAGES - 1),
              _bad_id).map(lambda t: t[0][:t[1]] + [t[2]] + t[0][t[1] + 1:]),  # one bad id in a good list
    st.lists(st.integers(0, NB - 1), min_size=PAGES - 1, max_size=PAGES + 1),
    st.lists(st.integers(0, NB - 1), min_size=PAGES, max_size=PAGES).map(lambda v: torch.tensor(v)),
    st.none(),  # no ids for the chunk
)


@settings(max_examples=4 * EXAMPLES, deadline=None)
@given(data=st.data())
def test_store_layers_refuses_every_bad_id_as_the_one_by_one_check_does(tmp_path_factory, data):
    """The hook checks a step's block ids in one batch (Tables.vouch) and the step's preparation
    makes its objects from them: whatever the lists, a step is refused with the first error of the
    one-by-one check (Tables.ids, order after order, chunk after chunk), before anything started;
    a step accepted stores each object from exactly the ids given."""
    chunks = [f"c{i}" for i in range(data.draw(st.integers(1, 4), label="chunks"))]
    blocks = {c: data.draw(_ids_list, label=c) for c in chunks if data.draw(st.integers(0, 12)) > 0}
    orders, at = [], 0
    while at < len(chunks):
        n = data.draw(st.integers(1, 2))
        orders.append(StoreOrder(len(orders) + 1, tuple(chunks[at:at + n]), (), 0))
        at += n
    with rig(tmp_path_factory.mktemp("s"), caches_of(4, 2, 8), 4096, ssd=False) as eng:
        expected = None
        for order in orders:
            for n, chunk in enumerate(order.kv):
                try:
                    eng._tables.ids("kv", f"kv object {n} of order {order.order_id}", blocks.get(chunk))
                except ValueError as exc:
                    expected = expected or str(exc)
        free = eng.host_pool.free_slots
        if expected is not None:
            with pytest.raises(ValueError) as refused:
                eng.store_layers(orders, blocks)
            assert str(refused.value) == expected
            assert eng.host_pool.free_slots == free and eng.counters()["engine"]["layerwise_save_steps"] == 0
            return
        step = eng.store_layers(orders, blocks)
        for layer in range(step.layers):
            step.save_layer(layer)
        runs = step.finish()
        assert [run.order for run in runs] == orders
        made = [(obj.key.chunk, obj.ids.on(torch.device("cpu")).tolist()) for obj in step._objs()]
        assert made == [(c, [int(x) for x in blocks[c]]) for order in orders for c in order.kv]

"""No message of the data plane or the control plane shows an object's key, its chunk hash or a
block hash, sealed or not (docs/security.md: a vLLM block hash and a chunk id are token-derived).
Every message that used to show one is provoked here with a distinctive chunk hash, on real
stores (files in a temp dir, a real Mooncake master and node, a real control plane), and neither
its bytes, their hex nor their repr appears in it, nor in any log line; the message names the
object by kind, key length, place or count instead."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch

from cluster_cases import SKIP_REASON, fill, mooncake_available, raw_client, start_cluster
from control_cases import config, request
from kernel_cases import vllm_layers
from saria.config import SariaConfig
from saria.control import ControlPlane, ControlPlaneError, ObjectKey, ReloadPlan, StoreOrder, Tier
from saria.control.tree import CacheObject
from saria.dataplane import (Coordinator, HostPool, ObjectCorrupt, ObjectNotFound, ObjectUnreadable,
                             ObjectWriteError, SSDStore, TransferEngine, object_key)
from saria.dataplane.ssd.keys import describe_key, parse_object_key
from saria.kernels import PageTable
from saria.kernels.checksum import checksum
from ssd_cases import PB, Fault, FaultyOps, capacity, drive_file, drives, flip_byte, geometry, is_payload, payload

MARK = b"QZX-chunk-"
CHUNK = MARK + bytes(range(0xC0, 0xC0 + 38))  # 48 bytes, as a chunk id; \xc0.. is not UTF-8
KEY = object_key(CHUNK, "kv")  # 50 bytes
# The forms a chunk hash or a key could take in a message: its bytes (repr, latin-1), its hex.
FORBIDDEN = ["QZX", "qzx", MARK.hex(), MARK.hex().upper(), CHUNK[10:18].hex(), CHUNK[10:18].hex().upper(),
             "\\xc0\\xc1", "\xc0\xc1", KEY[:8].hex(), KEY[:8].hex().upper()]


def hidden(text: str) -> str:
    for form in FORBIDDEN:
        assert form not in text, f"{form!r} in {text!r}"
    return text


def chunk(i: int) -> bytes:
    """Distinctive prefix-chained chunk hashes (each 48 bytes)."""
    return CHUNK[:-1] + bytes([i])


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG)
    yield caplog
    for record in caplog.records:
        hidden(record.getMessage())


# ------------------------------------------------------------------------------------- SSD store

def test_ssd_store_names_objects_by_kind_and_key_length(tmp_path, logs):
    ops = FaultyOps()
    slots = 8
    with SSDStore(drives(tmp_path, 1), capacity(slots), PB, read_threads=4, io_ops=ops) as store:
        out = torch.zeros(2 * PB, dtype=torch.uint8)
        for call in (lambda: store.read(KEY, out), lambda: store.part_extents(KEY)):
            with pytest.raises(ObjectNotFound) as e:
                call()
            assert "no object under that key (50 bytes)" in hidden(str(e.value))
        (missing,) = store.read_many([KEY], [out])
        assert isinstance(missing, ObjectNotFound) and hidden(str(missing))

        info = store.write(KEY, payload(2 * PB, 1)).result(timeout=30)
        assert hidden(repr(info)).startswith("ObjectInfo(key=<50 bytes>,")

        # memory claims: a write from a read's destination, a read into a write's source
        release, entered = threading.Event(), threading.Event()
        ops.add(Fault("pread", when=lambda c: is_payload(c.offset), gate=release, before=lambda c: entered.set()))
        reading = store.read(KEY, out)
        assert entered.wait(30)
        with pytest.raises(ValueError) as e:
            store.write(b"copy", out)
        assert "out of the read of kv object (50-byte key)" in hidden(str(e.value))
        release.set()
        reading.result(timeout=30)
        ops.clear()
        src = payload(PB, 2)
        release, entered = threading.Event(), threading.Event()
        ops.add(Fault("pwrite", when=lambda c: is_payload(c.offset), gate=release, before=lambda c: entered.set()))
        writing = store.write(object_key(chunk(1), "state"), src)
        assert entered.wait(30)
        with pytest.raises(ValueError) as e:
            store.read(KEY, [src, out[PB:2 * PB]])
        assert "data of the write of state object (50-byte key)" in hidden(str(e.value))
        release.set()
        writing.result(timeout=30)
        ops.clear()

        # a part that cannot be read, one that fails its checksum, a write that fails
        ops.add(Fault("pread", when=lambda c: is_payload(c.offset), error=errno.EIO))
        error = store.read(KEY, out).exception(timeout=30)
        assert isinstance(error, ObjectUnreadable) and "kv object (50-byte key) part" in hidden(str(error))
        ops.clear()
        info = store.write(KEY, payload(2 * PB, 3)).result(timeout=30)
        part = info.parts[1]
        flip_byte(drive_file(tmp_path / "nvme0"), geometry(slots).payload_offset(part.slot) + 7)
        error = store.read(KEY, out).exception(timeout=30)
        assert isinstance(error, ObjectCorrupt) and "kv object (50-byte key) part 1" in hidden(str(error))
        ops.add(Fault("pwrite", when=lambda c: is_payload(c.offset), error=errno.ENOSPC))
        error = store.write(KEY, payload(PB, 4)).exception(timeout=30)
        assert isinstance(error, ObjectWriteError) and "writing kv object (50-byte key) failed" in hidden(str(error))


def test_ssd_keys_are_not_shown_when_refused():
    assert describe_key(KEY) == "kv object (50-byte key)" and describe_key(b"k") == "object (1-byte key)"
    big = (1 << 300) + 123456789
    with pytest.raises(ValueError) as e:
        object_key(big, "kv")
    assert "301 bits" in hidden(str(e.value)) and str(big)[-9:] not in str(e.value)
    for foreign in (b"z" + CHUNK, b"ki" + CHUNK, b"ks" + CHUNK):  # no kind; an int tag of 48 bytes; not UTF-8
        with pytest.raises(ValueError) as e:
            parse_object_key(foreign)
        assert f"not a saria object key ({len(foreign)} bytes)" == hidden(str(e.value))


# ------------------------------------------------------------------------------- transfer engine

def test_block_id_errors_name_the_object_by_its_place(tmp_path, logs):
    caches = vllm_layers(16, 4, 2, 8, torch.bfloat16, layers=1, seed=0)
    with HostPool(8 * 4096, 4096) as pool:
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=2)
        try:
            plan = ReloadPlan(7, (chunk(0), chunk(1)), (Tier.DRAM, Tier.DRAM), None, None, 16, 0, 0, False)
            for blocks, said in (([[0, 1], None], "no block ids given for the kv object of chunk 1 of plan 7"),
                                 ([[0, 1], [2]], "the kv object of chunk 1 of plan 7 needs 2 block ids"),
                                 ([["x", 1], [2, 3]], "the block ids of the kv object of chunk 0 of plan 7 are not"),
                                 ([[0, 1], torch.tensor([2.5, 3.5])], "must be integers"),
                                 ([[0, 99], [2, 3]], "the kv object of chunk 0 of plan 7 names block ids [0, 99]")):
                with pytest.raises(ValueError) as e:
                    engine.load(plan, blocks)
                assert said in hidden(str(e.value))
            with pytest.raises(ValueError) as e:
                engine.store(StoreOrder(5, (chunk(0), chunk(1)), (), 0), {chunk(0): [0, 1], chunk(1): [99, 100]})
            assert "kv object 1 of order 5 names block ids" in hidden(str(e.value))
        finally:
            engine.close()


# -------------------------------------------------------------------------------- cluster store

@pytest.mark.skipif(not mooncake_available(), reason=SKIP_REASON)
def test_cluster_misses_name_the_object_by_its_place_in_the_batch(tmp_path_factory, logs):
    from saria.dataplane.cluster import ClusterStore, Layout, ObjectAbsent

    slot, identity = 1 << 20, "messages|bf16"
    cluster = start_cluster(tmp_path_factory, node_bytes=64 << 20)
    try:
        with HostPool(16 << 20, slot_bytes=slot) as pool, \
                ClusterStore(cluster.master, identity, pool, timeout_s=10.0, retry_min_s=0.2, retry_max_s=1.0) as store:
            keys = [object_key(chunk(i), "kv") for i in range(4)]
            held = [pool.allocate(pool.slots_for(2 * slot + 9)) for _ in keys]
            views = [pool.views(s, 2 * slot + 9) for s in held]
            for i, v in enumerate(views):
                fill(v, i)
            for f in store.put_many(keys, views, [[checksum(x) for x in v] for v in views]):
                f.result(timeout=30)
            layout, raw = Layout(f"{identity}|cluster parts of {slot} bytes"), raw_client(cluster)
            metas = [layout.decode(k, raw.get_batch([layout.meta_key(k)])[0]) for k in keys[:3]]
            assert raw.remove(layout.meta_key(keys[0]), True) == 0  # absent
            parts = layout.part_keys(keys[1], metas[1])
            assert raw.remove(parts[1], True) == 0 and raw.put(parts[1], b"x" * 100) == 0  # a short part
            parts = layout.part_keys(keys[2], metas[2])
            data = bytearray(raw.get_batch([parts[0]])[0])
            data[5] ^= 1
            assert raw.remove(parts[0], True) == 0 and raw.put(parts[0], bytes(data)) == 0  # fails its checksum
            assert raw.remove(layout.meta_key(keys[3]), True) == 0
            assert raw.put(layout.meta_key(keys[3]), b"not metadata") == 0  # junk metadata
            got = [f.exception(timeout=30) for f in store.get_many(keys, views)]
            assert isinstance(got[0], ObjectAbsent) and str(got[0]).startswith("object 0 of the batch is not")
            said = ["object 0 of the batch", "part 1 of object 1 of the batch", "part 0 of object 2 of the batch",
                    "object 3 of the batch in the cluster"]
            for error, expected in zip(got, said):
                assert expected in hidden(str(error)), error
            for s in held:
                pool.free(s)
    finally:
        cluster.stop()


# -------------------------------------------------------------------------------- control plane

def test_control_plane_errors_name_chunks_by_place(logs):
    cp = ControlPlane(config("full-duplicate", dram_chunks=4))
    a, b, c, x = chunk(0), chunk(1), chunk(2), chunk(20)
    request(cp, [a, b, c], 0.0)
    request(cp, [x], 0.0)
    plan = cp.plan([a, b], 1.0)
    stores = [o for o in cp.commit_prefill([chunk(9)], 1.0) if isinstance(o, StoreOrder)]
    calls = [
        (lambda: cp.plan([b], 2.0), "chunk 0 comes at the root, but the tree has it under another chunk"),
        (lambda: cp.plan([x, b], 2.0), "chunk 1 comes under chunk 0"),
        (lambda: cp.plan([a, chunk(8), c], 2.0), "chunk 2 comes after chunk 1, which the tree does not know"),
        (lambda: cp.plan([chunk(5), chunk(6), chunk(5)], 2.0), "chunk 2 repeats the hash of chunk 0"),
        (lambda: cp.commit_prefill([a, c], 2.0, plan), "they differ from chunk 1 on"),
        (lambda: cp.commit_prefill([a, b], 2.0, plan, failed=[c]), "failed entry 0 (a chunk hash) is not among"),
        (lambda: cp.complete(stores[0].order_id, True, 2.0, failed=[ObjectKey(a, "state")]),
         "failed entry 0 (an ObjectKey of a state object) is not among"),
        (lambda: cp.release(plan, 2.0, failed=CHUNK), "got a bytes"),
        (lambda: cp.release(plan, 2.0, failed=[bytearray(CHUNK)]), "entry 0 is an unhashable bytearray"),
        (lambda: cp.chunk_info(bytearray(CHUNK)), "got a bytearray"),
        (lambda: cp.commit_prefill([a, b], 2.0, plan, states=[CHUNK]), "states names a bytes"),
        (lambda: cp.plan_from(plan, CHUNK), "got a bytes"),
        (lambda: cp.recover_ssd([CHUNK], 2.0), "got a bytes (entry 0)"),
        (lambda: cp.commit_prefill([chunk(9)], 2.0, failed=[CHUNK]), "failed names 1 read(s), but no plan"),
    ]
    for call, said in calls:
        with pytest.raises(ControlPlaneError) as e:
            call()
        assert said in hidden(str(e.value)), str(e.value)
    assert cp.audit() == []
    node = cp._tree.nodes[a]
    assert hidden(repr(node)).startswith("<Node <48 bytes> depth 0")
    assert hidden(CacheObject.__repr__(node)).startswith("<kv of <48 bytes>: dram")
    cp._tree.nodes[chunk(4)] = node  # white box: a node filed under another hash, for the audit to find
    problems = cp.audit()
    assert any("filed under another chunk hash" in p for p in problems) and all(hidden(p) for p in problems)

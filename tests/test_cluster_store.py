"""The cluster store against a real Mooncake master and storage node (no mocks of Mooncake):
round trips against the host pool's bytes, objects living in the storage node (another process
reads them), identity isolation, eviction, vanished / wrong-size / tampered values, timeouts,
and the master dying and coming back."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from cluster_cases import fill, matches, mooncake_available, raw_client, start_cluster, SKIP_REASON
from saria.dataplane.cluster import (ClusterMiss, ClusterOff, ClusterStore, ClusterTimeout, Layout,
                                     ObjectAbsent, ObjectCorrupt)
from saria.dataplane.cluster.local import free_ports
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.ssd.keys import object_key
from saria.kernels.checksum import checksum

pytestmark = pytest.mark.skipif(not mooncake_available(), reason=SKIP_REASON)

SLOT = 1 << 20
IDENTITY = "test-model|bf16|16x8|tp1-rank0|pp1-stage0"
SIZES = [1, 4095, SLOT, SLOT + 1, 3 * SLOT + 17, 200_000]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory)
    yield c
    c.stop()


@pytest.fixture
def own_cluster(tmp_path_factory):
    """A cluster of its own (for tests that fill, pause or kill it)."""
    c = start_cluster(tmp_path_factory, node_bytes=64 << 20)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def pool():
    with HostPool(64 << 20, slot_bytes=SLOT) as p:
        yield p


LAYOUT = f"{IDENTITY}|cluster parts of {SLOT} bytes"  # the identity the store's layout is made of


def new_store(cluster, pool, identity=IDENTITY, **kw):
    kw.setdefault("timeout_s", 10.0)
    return ClusterStore(cluster.master, identity, pool, retry_min_s=0.2, retry_max_s=1.0, **kw)


def alloc(pool, nbytes):
    slots = pool.allocate(pool.slots_for(nbytes))
    return slots, pool.views(slots, nbytes)


def put(store, pool, objects):
    """Put ``{key: (nbytes, seed)}`` in one batch from fresh slots (freed after)."""
    keys, views, sums, held = [], [], [], []
    for key, (nbytes, seed) in objects.items():
        slots, v = alloc(pool, nbytes)
        fill(v, seed)
        keys.append(key)
        views.append(v)
        sums.append([checksum(x) for x in v])
        held.append(slots)
    try:
        return [f.exception(timeout=30) or f.result() for f in store.put_many(keys, views, sums)]
    finally:
        for s in held:
            pool.free(s)


def get(store, pool, objects):
    """Get ``{key: (nbytes, seed)}`` in one batch; per key: True (bytes right), or the miss."""
    keys, views, held = list(objects), [], []
    for nbytes, _ in objects.values():
        slots, v = alloc(pool, nbytes)
        for x in v:
            x.fill_(0xEE)
        views.append(v)
        held.append(slots)
    try:
        out = {}
        for key, v, f in zip(keys, views, store.get_many(keys, views)):
            exc = f.exception(timeout=30)
            out[key] = exc if exc is not None else (f.result() == objects[key][0] and matches(v, objects[key][1]))
        return out
    finally:
        for s in held:
            pool.free(s)


def objs(n, base=0, sizes=SIZES):
    return {object_key(base + i, "kv" if i % 2 else "state"): (sizes[i % len(sizes)], base + i) for i in range(n)}


def test_round_trip_many_sizes(cluster, pool):
    with new_store(cluster, pool) as store:
        a, b = objs(12), objs(12, base=100)
        assert all(r == n for r, (n, _) in zip(put(store, pool, a), a.values()))
        assert all(r == n for r, (n, _) in zip(put(store, pool, b), b.values()))
        assert store.exists_many(list(a) + [object_key(999, "kv")]) == [True] * 12 + [False]
        got = get(store, pool, {**a, **b})
        assert all(v is True for v in got.values()), got
        c = store.counters()
        total = sum(n for n, _ in a.values()) + sum(n for n, _ in b.values())
        assert (c["puts"], c["gets"], c["put_bytes"], c["get_bytes"]) == (24, 24, total, total)
        assert sum(c["misses"].values()) == 0
        # a put of an object already there (same bytes) is a success, and reads the same
        assert put(store, pool, dict(list(a.items())[:3])) == [n for n, _ in list(a.values())[:3]]


CHILD = r"""
import json, sys
from cluster_cases import fill, matches
from saria.dataplane.cluster import ClusterStore
from saria.dataplane.cluster.local import free_ports
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.ssd.keys import object_key
master, identity, mode, spec = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
with HostPool(64 << 20, slot_bytes=1 << 20) as pool, ClusterStore(master, identity, pool) as store:
    keys = [object_key(int(k), "kv") for k in spec]
    views = [pool.views(pool.allocate(pool.slots_for(n)), n) for n, _ in spec.values()]
    if mode == "put":
        for v, (_, seed) in zip(views, spec.values()):
            fill(v, seed)
        out = [f.exception(timeout=30) is None for f in store.put_many(keys, views)]
    else:
        out = [f.exception(timeout=30) is None and matches(v, seed)
               for f, v, (_, seed) in zip(store.get_many(keys, views), views, spec.values())]
print(json.dumps(out))
"""


def child(cluster, mode, spec):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", CHILD, cluster.master, IDENTITY, mode, json.dumps(spec)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_objects_live_in_the_storage_node(cluster, pool):
    """A writer process exits; its objects are still read (here); and another process reads ours."""
    theirs = {str(500 + i): (SIZES[i % len(SIZES)], 500 + i) for i in range(6)}
    assert child(cluster, "put", theirs) == [True] * 6  # the writer has exited now
    with new_store(cluster, pool) as store:
        got = get(store, pool, {object_key(int(k), "kv"): v for k, v in theirs.items()})
        assert all(v is True for v in got.values()), got
        ours = {str(600 + i): (SIZES[i % len(SIZES)], 600 + i) for i in range(6)}
        put(store, pool, {object_key(int(k), "kv"): v for k, v in ours.items()})
    assert child(cluster, "get", ours) == [True] * 6


def test_identity_isolation(cluster, pool):
    a = objs(4, base=700)
    with new_store(cluster, pool) as store, new_store(cluster, pool, identity=IDENTITY + "|other") as other:
        put(store, pool, a)
        assert other.exists_many(list(a)) == [False] * 4
        assert all(isinstance(v, ObjectAbsent) for v in get(other, pool, a).values())
        assert all(v is True for v in get(store, pool, a).values())
    with new_store(cluster, pool, max_part_bytes=SLOT // 2) as half:  # other part size: other layout
        assert half.exists_many(list(a)) == [False] * 4


def test_many_batches_in_flight(cluster, pool):
    """Batches submitted together (more than the workers) all complete, each with its own bytes."""
    batches = [objs(3, base=1500 + 3 * b, sizes=[SLOT + 3, 70_000]) for b in range(6)]
    with new_store(cluster, pool) as store:
        held, futures = [], []
        for b in batches:
            views = []
            for nbytes, seed in b.values():
                slots, v = alloc(pool, nbytes)
                fill(v, seed)
                held.append(slots)
                views.append(v)
            futures += store.put_many(list(b), views)
        assert [f.result(timeout=30) for f in futures] == [n for b in batches for n, _ in b.values()]
        for s in held:
            pool.free(s)
        held, futures, checks = [], [], []
        for b in batches:
            views = []
            for nbytes, seed in b.values():
                slots, v = alloc(pool, nbytes)
                held.append(slots)
                views.append(v)
                checks.append((v, seed))
            futures += store.get_many(list(b), views)
        assert all(f.exception(timeout=30) is None for f in futures)
        assert all(matches(v, seed) for v, seed in checks)
        for s in held:
            pool.free(s)


def test_pool_full_evicts_the_oldest_as_misses(own_cluster, pool):
    """96 MiB into a 64 MiB node: the oldest objects are evicted (Mooncake evicts in the
    background, so a put into a full pool may be refused: a miss too); every put and get settles
    as a success or a miss, nothing propagates, and what is read is right."""
    with new_store(own_cluster, pool) as store:
        batches = [objs(8, base=1000 + 8 * b, sizes=[2 * SLOT - 3]) for b in range(6)]
        stored = []
        for b in batches:
            for key, r in zip(b, put(store, pool, b)):
                assert isinstance(r, (int, ClusterMiss)), r
                if isinstance(r, int):
                    stored.append(key)
        results = [get(store, pool, b) for b in batches]
        flat = {k: v for r in results for k, v in r.items()}
        assert all(v is True or isinstance(v, ObjectAbsent) for v in flat.values()), flat
        assert all(isinstance(v, ObjectAbsent) for v in results[0].values())  # the oldest went
        assert any(flat[k] is True for k in stored[-8:])  # recent ones stayed
        assert all(isinstance(flat[k], ObjectAbsent) for k in flat if k not in stored)
        c = store.counters()
        assert c["misses"]["absent"] == sum(isinstance(v, ObjectAbsent) for v in flat.values())
        assert c["gets"] == sum(v is True for v in flat.values())


def test_removed_between_exists_and_get_is_a_miss(cluster, pool):
    a = objs(3, base=800)
    layout = Layout(LAYOUT)
    raw = raw_client(cluster)
    with new_store(cluster, pool) as store:
        put(store, pool, a)
        keys = list(a)
        assert store.exists_many(keys) == [True] * 3
        # one object removed whole, one losing a part (as an eviction does), one intact
        assert store.remove_many(keys[:1]) == 1
        meta = layout.decode(keys[1], raw.get_batch([layout.meta_key(keys[1])])[0])
        assert raw.remove(layout.part_keys(keys[1], meta)[0], True) == 0
        got = get(store, pool, a)
        assert isinstance(got[keys[0]], ObjectAbsent) and isinstance(got[keys[1]], ObjectAbsent)
        assert got[keys[2]] is True
        # the object with a part gone was dropped: exists no longer reports it
        assert store.exists_many(keys) == [False, False, True]


def test_wrong_size_values_are_corrupt_misses(cluster, pool):
    a = {object_key(900, "kv"): (3 * SLOT + 5, 900), object_key(901, "kv"): (SLOT, 901),
         object_key(902, "kv"): (5000, 902)}
    k0, k1, k2 = a
    layout = Layout(LAYOUT)
    raw = raw_client(cluster)
    with new_store(cluster, pool) as store:
        put(store, pool, a)
        meta = layout.decode(k0, raw.get_batch([layout.meta_key(k0)])[0])
        part = layout.part_keys(k0, meta)[1]
        assert raw.remove(part, True) == 0 and raw.put(part, b"x" * 100) == 0  # a short part
        meta1 = layout.decode(k1, raw.get_batch([layout.meta_key(k1)])[0])
        part1 = layout.part_keys(k1, meta1)[0]
        assert raw.remove(part1, True) == 0 and raw.put(part1, b"y" * (SLOT + 10)) == 0  # a long part
        assert raw.remove(layout.meta_key(k2), True) == 0
        assert raw.put(layout.meta_key(k2), b"not metadata") == 0  # junk metadata
        got = get(store, pool, a)
        assert all(isinstance(v, ObjectCorrupt) for v in got.values()), got
        assert store.counters()["corrupt"] == 3
        assert store.exists_many(list(a)) == [False] * 3  # all dropped


def test_flipped_byte_is_a_checksum_miss(cluster, pool):
    a = {object_key(950, "kv"): (2 * SLOT + 77, 950)}
    (key,) = a
    layout = Layout(LAYOUT)
    raw = raw_client(cluster)
    with new_store(cluster, pool) as store:
        put(store, pool, a)
        meta = layout.decode(key, raw.get_batch([layout.meta_key(key)])[0])
        part = layout.part_keys(key, meta)[2]
        data = bytearray(raw.get_batch([part])[0])
        data[33] ^= 0x10
        assert raw.remove(part, True) == 0 and raw.put(part, bytes(data)) == 0
        got = get(store, pool, a)
        assert isinstance(got[key], ObjectCorrupt) and "checksum" in str(got[key])
        assert store.counters()["corrupt"] == 1
        put(store, pool, a)  # rewritten after the drop: served again
        assert get(store, pool, a)[key] is True


def test_timeout_is_a_miss_and_memory_is_released_later(own_cluster, pool):
    a, b = objs(4, base=1200), objs(2, base=1250)
    with new_store(own_cluster, pool) as store:  # stored under the default deadline: a slow machine's put is no timeout
        assert put(store, pool, a) == [n for n, _ in a.values()]
    with new_store(own_cluster, pool, timeout_s=1.0) as store:
        own_cluster.pause_node()  # returns once the node runs nothing (a thread not yet stopped could serve a get)
        try:
            t0 = time.monotonic()
            got = get(store, pool, a)  # frees its slots at once: fine here, nobody else uses them
            put_late = put(store, pool, b)
            took = time.monotonic() - t0
        finally:
            time.sleep(1.0)
            own_cluster.resume_node()
        assert all(isinstance(v, ClusterTimeout) for v in got.values()), [repr(v) for v in got.values()]  # no keys
        assert all(isinstance(r, ClusterTimeout) for r in put_late), put_late
        assert took < 10.0  # two 1 s deadlines (without them the calls block until the node resumes, below)
        assert store.wait_released(timeout=30)
        assert store.counters()["timeouts"] == 6
        assert all(v is True for v in get(store, pool, a).values())
        # the timed-out put committed no metadata: its objects are not served
        assert all(isinstance(v, ObjectAbsent) for v in get(store, pool, b).values())


def test_master_killed_then_back(own_cluster, pool, caplog):
    caplog.set_level(logging.WARNING, logger="saria.dataplane.cluster")
    a = objs(4, base=1300)
    with new_store(own_cluster, pool, timeout_s=2.0) as store:
        put(store, pool, a)
        own_cluster.kill_master()
        end = time.monotonic() + 20
        while store.on and time.monotonic() < end:
            get(store, pool, a)
        assert not store.on
        t0 = time.monotonic()
        for _ in range(20):
            assert all(isinstance(v, ClusterOff) for v in get(store, pool, a).values())
            assert all(isinstance(r, ClusterOff) for r in put(store, pool, a))
            assert store.exists_many(list(a)) == [False] * 4
        assert time.monotonic() - t0 < 2.0  # quick misses
        offs = [r for r in caplog.records if "cluster tier off" in r.getMessage()]
        assert len(offs) == 1, [r.getMessage() for r in caplog.records]
        own_cluster.start_master()
        own_cluster.wait_mounted()
        end = time.monotonic() + 30
        while not store.on and time.monotonic() < end:
            time.sleep(0.1)
        assert store.on
        assert len([r for r in caplog.records if "cluster tier back" in r.getMessage()]) == 1
        assert all(isinstance(v, ObjectAbsent) for v in get(store, pool, a).values())  # a new master knows no key
        assert all(isinstance(r, int) for r in put(store, pool, a))
        assert all(v is True for v in get(store, pool, a).values())
        c = store.counters()
        assert c["off_calls"] >= 60 and c["went_off"] == 1 and c["came_back"] == 1


def test_dead_master_at_open_does_not_block(own_cluster, pool, caplog):
    caplog.set_level(logging.WARNING, logger="saria.dataplane.cluster")
    t0 = time.monotonic()
    store = ClusterStore(f"127.0.0.1:{free_ports(1)[0]}", IDENTITY, pool, setup_wait_s=1.0)
    try:
        assert time.monotonic() - t0 < 2.0 and not store.on
        t1 = time.monotonic()
        assert all(isinstance(v, ClusterOff) for v in get(store, pool, objs(3)).values())
        assert store.exists_many(list(objs(3))) == [False] * 3
        assert time.monotonic() - t1 < 0.5
    finally:
        store.close()
    assert len([r for r in caplog.records if "cluster tier off" in r.getMessage()]) == 1


def test_misuse_is_refused_before_anything_is_sent(cluster, pool):
    with new_store(cluster, pool) as store:
        outside = torch.zeros(100, dtype=torch.uint8)
        with pytest.raises(ValueError, match="registered"):
            store.put_many([object_key(1, "kv")], [[outside]])
        slots, v = alloc(pool, 10)
        try:
            with pytest.raises(ValueError, match="saria object key"):
                store.get_many([b"zz"], [v])
            with pytest.raises(ValueError, match="twice"):
                store.get_many([object_key(1, "kv")] * 2, [v, v])
        finally:
            pool.free(slots)


def test_bench_quick_runs():
    """``bench/bench_cluster.py --quick`` runs end to end (its own master and node) and reports both
    targets (MET or MISSED: the numbers depend on the host; docs/cluster.md has them)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_cluster.py"), "--quick"],
                         capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    for op in ("put", "get"):
        assert f"target {op} >= 0.80 of Mooncake's own" in run.stdout, run.stdout


def test_every_thread_of_the_store_binds_its_device_first(cluster, pool):
    """The store's workers, verifiers, lookups, watchdog and health threads make the engine's device
    current before their first work (saria.dataplane.devices). A device no default could be (``meta``)
    shows it is the one given that reaches each thread."""
    import threading

    from saria.dataplane import devices

    before = {t.ident for t in threading.enumerate()}
    with new_store(cluster, pool, device="meta") as store:
        a = objs(4, base=500)
        assert all(r == n for r, (n, _) in zip(put(store, pool, a), a.values()))
        assert all(v is True for v in get(store, pool, a).values())
        store.exists_many(list(a))
        started = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("saria-")]
        names = {t.name.rsplit("_", 1)[0] for t in started}
        assert {"saria-cluster", "saria-cluster-verify", "saria-cluster-lookup", "saria-cluster-watchdog",
                "saria-cluster-health"} <= names, names
        assert {t.name: devices.bound_device(t) for t in started} == {t.name: torch.device("meta") for t in started}

"""Sealed cluster objects against a real Mooncake master and storage node, and a rogue that
reaches them (issue 33, docs/cluster.md "Sealed objects").

The rogue is a plain Mooncake client of its own: it lists every live key from the master's HTTP
port, reads and writes any value. It never gets a byte loaded: every overwrite, plant, swap,
copy from another identity, layout or tenant, every single-bit flip, truncation and extension is
a miss (``ObjectUnauthentic`` or ``ObjectUnknownEpoch``) counted in ``auth_failures`` /
``unknown_epoch``, and the destination holds zeros or what it held before, never the rogue's bytes
nor unverified plaintext. Names hold chunk ids only; values hold no plaintext; the store's
destinations are memory Mooncake cannot write."""

from __future__ import annotations

import os
import re
import struct
import time

import pytest
import torch

from cluster_cases import (matches, mooncake_available, mooncake_keys, pattern, raw_client, raw_values, raw_write,
                           start_cluster, SKIP_REASON)
from saria.dataplane.cluster import ClusterStore, ObjectAbsent
from saria.dataplane.cluster.errors import ObjectUnauthentic, ObjectUnknownEpoch
from saria.dataplane.cluster.layout import Layout
from saria.dataplane.cluster.sealed import SealedLayout
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.ssd.keys import object_key
from saria.seal import Keyring, PartContext, Sealer, new_key_file, retire_epoch, rotate_key_file
from seal_cases import Version1Sealer

pytestmark = pytest.mark.skipif(not mooncake_available(), reason=SKIP_REASON)

SLOT = 64 << 10
IDENTITY = "test-model|bf16|16x8|tp1-rank0|pp1-stage0"
SCOPE = b"test-model scope"
FILL = 0xEE


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory, node_bytes=128 << 20)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def pool():
    with HostPool(16 << 20, slot_bytes=SLOT) as p:
        yield p


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """One key file in three states: epoch 1 (``k1``), rotated (epochs 1 and 2, ``k12``), epoch 1
    retired (``k2``); all of one names root (the same chunk ids and key id)."""
    path = tmp_path_factory.mktemp("keys") / "saria.key"
    k1 = new_key_file(path)
    k12 = rotate_key_file(path)
    k2 = retire_epoch(path, 1)
    return {name: Keyring(k) for name, k in (("k1", k1), ("k12", k12), ("k2", k2))}


@pytest.fixture(scope="module")
def raw(cluster):
    c = raw_client(cluster)
    yield c
    c.close()


def sealer(keyring, identity=IDENTITY):
    return Sealer(keyring, "cluster", identity)


def new_store(cluster, pool, keyring=None, identity=IDENTITY, **kw):
    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("pipeline_bytes", 3 * SLOT + 64)
    seal = sealer(keyring, identity) if keyring is not None else None
    return ClusterStore(cluster.master, identity, pool, retry_min_s=0.2, retry_max_s=1.0, sealer=seal, **kw)


def chunk_keys(keyring, salt, hashes):
    """Object keys of ``hashes`` (bytes) for the tenant of ``salt``: chunk ids, as the scheduler names them."""
    return [object_key(c, "kv") for c in keyring.chunk_ids(keyring.tenant(salt), SCOPE, hashes)]


def put(store, pool, objects):
    """Put ``{key: (nbytes, seed)}`` in one batch from fresh slots; per object its length or miss."""
    keys, views, held = [], [], []
    for key, (nbytes, seed) in objects.items():
        slots = pool.allocate(pool.slots_for(nbytes))
        v = pool.views(slots, nbytes)
        data = pattern(nbytes, seed)
        off = 0
        for x in v:
            x.copy_(data[off:off + x.numel()])
            off += x.numel()
        keys.append(key)
        views.append(v)
        held.append(slots)
    try:
        return [f.exception(timeout=30) or f.result() for f in store.put_many(keys, views)]
    finally:
        for s in held:
            pool.free(s)


def get(store, pool, objects):
    """Get ``{key: (nbytes, seed)}``; per key True (its bytes, exactly) or the miss, whose
    destination must hold only zeros or the fill it had (never another byte)."""
    keys, views, held = list(objects), [], []
    for nbytes, _ in objects.values():
        slots = pool.allocate(pool.slots_for(nbytes))
        v = pool.views(slots, nbytes)
        for x in v:
            x.fill_(FILL)
        views.append(v)
        held.append(slots)
    try:
        out = {}
        for key, v, f in zip(keys, views, store.get_many(keys, views)):
            exc = f.exception(timeout=30)
            if exc is None:
                out[key] = f.result() == objects[key][0] and matches(v, objects[key][1])
            else:
                flat = torch.cat(v)
                assert bool((flat == 0).all()) or bool((flat == FILL).all()), "a miss left bytes behind"
                out[key] = exc
        return out
    finally:
        for s in held:
            pool.free(s)


def stored(cluster, raw, store, key):
    """``{mooncake key: value}`` of ``key``'s live object in ``store``'s layout, as a rogue finds
    them: the names listed by the master, the values read with its own client."""
    prefix = store._layout.prefix(key)
    return raw_values(raw, [n for n in mooncake_keys(cluster) if n.startswith(prefix)])


@pytest.fixture
def store(cluster, pool, keys):
    with new_store(cluster, pool, keys["k12"]) as s:
        yield s


def test_round_trip_and_nothing_in_the_clear(store, pool, raw, keys, cluster):
    k12 = keys["k12"]
    hashes = [f"block {i}".encode() * 4 for i in range(6)]
    a = dict(zip(chunk_keys(k12, "tenant A", hashes), [(n, i) for i, n in enumerate([1, 100, SLOT, SLOT + 1,
                                                                                     3 * SLOT + 17, 40_000])]))
    b = dict(zip(chunk_keys(k12, "tenant B", hashes), [(5000, 50 + i) for i in range(6)]))
    assert put(store, pool, {**a, **b}) == [n for n, _ in a.values()] + [5000] * 6
    assert store.exists_many(list(a) + list(b)) == [True] * 12
    assert all(v is True for v in get(store, pool, {**a, **b}).values())
    c = store.counters()
    assert (c["puts"], c["gets"], c["auth_failures"], c["unknown_epoch"], sum(c["misses"].values())) == (12, 12, 0, 0, 0)
    # a put of an object that is there already writes nothing (its parts would be new values)
    before = set(mooncake_keys(cluster))
    assert put(store, pool, dict(list(a.items())[:2])) == [1, 100]
    assert set(mooncake_keys(cluster)) == before and store.counters()["present"] == 2
    # names: the layout digest, the object key (kind, type, chunk id), a part index and a write id
    layout = store._layout
    prefixes = tuple(layout.prefix(k) for k in list(a) + list(b))
    ours = [k for k in mooncake_keys(cluster) if k.startswith(prefixes)]
    assert len(ours) == 12 + sum(pool.slots_for(n) for n, _ in {**a, **b}.values())
    pattern_name = re.compile(r"saria/[0-9a-f]{32}/6b62([0-9a-f]{96})/(m|\d+\.[0-9a-f]{32})")
    assert all(pattern_name.fullmatch(k) for k in ours), ours[:3]
    secrets = [h.hex() for h in hashes] + [h[:8].hex() for h in hashes] + [b"tenant".hex()]
    for key in list(a) + list(b):
        meta = layout.open_meta(store._sealer, key, raw_values(raw, [layout.meta_key(key)])[layout.meta_key(key)])
        secrets += [nonce.hex() for _, _, nonce in meta.parts]
    assert not [s for s in secrets if any(s in k for k in ours)]
    # values: no window of the plaintext in any stored value
    values = raw_values(raw, ours)
    for nbytes, seed in {**a, **b}.values():
        plain = pattern(nbytes, seed).numpy().tobytes()
        windows = {plain[i:i + 16] for i in range(0, nbytes - 15, max(1, nbytes // 8))}  # none in 1 byte
        assert not [w for w in windows if any(w in v for v in values.values())]
    # memory: Mooncake reaches the store's own buffers only, never the pool the plaintext lives in
    pool_lo = pool.slot(0).data_ptr()
    pool_hi = pool.slot(pool.num_slots - 1).data_ptr() + pool.slot_bytes
    assert all(p + n <= pool_lo or p >= pool_hi for p, n in store.mooncake_ranges)
    with new_store(cluster, pool) as plain:  # the plain store of one identity registers the pool
        assert any(pool_lo <= p < pool_hi for p, _ in plain.mooncake_ranges)


def test_rogue_without_the_key_never_gets_a_byte_loaded(cluster, store, pool, raw, keys):
    k12 = keys["k12"]
    objects = dict(zip(chunk_keys(k12, "", [b"system prompt %d" % i for i in range(5)]),
                       [(2 * SLOT + 300, 70 + i) for i in range(5)]))
    put(store, pool, objects)
    k0, k1, k2, k3, k4 = objects
    size = 2 * SLOT + 300
    # 1: its own bytes in every part, our metadata left as it is
    raw_write(raw, {name: pattern(len(v) - 16, 99).numpy().tobytes() + bytes(16)
                    for name, v in stored(cluster, raw, store, k0).items() if not name.endswith("/m")})
    # 2: its own metadata, with our clear fields (key id, epoch, write id, nonce) and a body of its own
    meta = stored(cluster, raw, store, k1)[store._layout.meta_key(k1)]
    raw_write(raw, {store._layout.meta_key(k1): meta[:52] + bytes(len(meta) - 52)})
    # 3: a whole object of its own: metadata modeled on ours, parts of its plaintext
    rogue = {name: (v[:52] + pattern(len(v) - 52, 3).numpy().tobytes() if name.endswith("/m")
                    else pattern(len(v), 98).numpy().tobytes()) for name, v in stored(cluster, raw, store, k2).items()}
    raw_write(raw, rogue)
    # 4: our metadata of one object over another's (its parts stay)
    raw_write(raw, {store._layout.meta_key(k3): meta})
    # 5: a planted object under a name never written (a popular prefix's), built like ours
    k5 = chunk_keys(k12, "", [b"never written"])[0]
    raw_write(raw, {store._layout.meta_key(k5): meta,
                    **{store._layout.prefix(k5) + n.rsplit("/", 1)[1]: v for n, v in rogue.items() if not n.endswith("/m")}})
    got = get(store, pool, {**objects, k5: (size, 0)})
    assert [type(got[k]) for k in (k0, k1, k2, k3, k5)] == [ObjectUnauthentic] * 5, got
    assert got[k4] is True
    assert store.counters()["auth_failures"] == 5
    assert store.exists_many([k0, k1, k2, k3, k5, k4]) == [False] * 5 + [True]  # the five dropped
    assert put(store, pool, {k0: objects[k0]}) == [size]  # rewritten: served again
    assert get(store, pool, {k0: objects[k0]})[k0] is True


class TenantKeySealer(Sealer):
    """A rogue holding tenant A's seal key (and, generously, everything public about tenant B):
    it seals for any name with A's key, with the associated data a reader of that name computes."""

    def __init__(self, keyring, tenant, identity=IDENTITY):
        super().__init__(keyring, "cluster", identity)
        self.forced = tenant

    def _seal_key(self, epoch, tenant):
        return super()._seal_key(epoch, self.forced)


def test_tenant_a_key_under_tenant_b_names(cluster, store, pool, raw, keys):
    k12 = keys["k12"]
    hashes = [b"shared prefix %d" % i for i in range(3)]
    a, b = chunk_keys(k12, "A", hashes), chunk_keys(k12, "B", hashes)
    assert not set(a) & set(b)  # one prompt, two salts: two names
    with ClusterStore(cluster.master, IDENTITY, pool, sealer=TenantKeySealer(k12, k12.tenant("A")),
                      pipeline_bytes=3 * SLOT + 64, timeout_s=10.0) as rogue:
        assert put(rogue, pool, {k: (3000, 7) for k in b[:2]}) == [3000, 3000]  # A's key, B's names
        assert put(rogue, pool, {a[2]: (3000, 8)}) == [3000]  # A's own object, genuine
    # A's genuine object copied under B's name (metadata and parts, renamed to B's object)
    values = stored(cluster, raw, store, a[2])
    raw_write(raw, {name.replace(a[2].hex(), b[2].hex()): v for name, v in values.items()})
    got = get(store, pool, {b[0]: (3000, 7), b[1]: (3000, 7), b[2]: (3000, 8), a[2]: (3000, 8)})
    assert [type(got[k]) for k in b] == [ObjectUnauthentic] * 3, got
    assert got[a[2]] is True  # tenant A reads its own
    assert store.counters()["auth_failures"] == 3


def test_two_valid_objects_swapped(cluster, store, pool, raw, keys):
    k12 = keys["k12"]
    x, y = chunk_keys(k12, "", [b"x prefix", b"y prefix"])
    put(store, pool, {x: (SLOT + 5, 1), y: (SLOT + 5, 2)})
    vx, vy = stored(cluster, raw, store, x), stored(cluster, raw, store, y)
    raw_write(raw, {n.replace(x.hex(), y.hex()): v for n, v in vx.items()})
    raw_write(raw, {n.replace(y.hex(), x.hex()): v for n, v in vy.items()})
    got = get(store, pool, {x: (SLOT + 5, 2), y: (SLOT + 5, 1)})
    assert all(isinstance(v, ObjectUnauthentic) for v in got.values()), got
    assert store.counters()["auth_failures"] == 2


def test_objects_of_another_identity_layout_or_store_copied_in(cluster, store, pool, raw, keys):
    k12 = keys["k12"]
    k = chunk_keys(k12, "", [b"copied"])[0]
    spec = {k: (100, 5)}
    sources = [new_store(cluster, pool, k12, identity=IDENTITY + "|another model"),
               new_store(cluster, pool, k12, max_part_bytes=SLOT // 2),  # another part size: one part still
               new_store(cluster, pool)]  # a plain store of this identity
    try:
        for source in sources:
            assert put(source, pool, spec) == [100]
            values = stored(cluster, raw, source, k)
            raw_write(raw, {n.replace(source._layout.prefix(k), store._layout.prefix(k)): v for n, v in values.items()})
            assert isinstance(get(store, pool, spec)[k], ObjectUnauthentic)
    finally:
        for source in sources:
            source.close()
    assert store.counters()["auth_failures"] == 3
    # and the stores never see each other's objects: another layout is another namespace
    fresh = {chunk_keys(k12, "", [b"sealed only"])[0]: (100, 6)}
    with new_store(cluster, pool) as plain:
        assert put(store, pool, fresh) == [100]
        assert [isinstance(v, ObjectAbsent) for v in get(plain, pool, fresh).values()] == [True]
        assert plain.exists_many(list(fresh)) == [False] and store.exists_many(list(fresh)) == [True]


def tamper_cases(meta_name, meta, parts):
    """Every single-bit flip of the metadata (one bit per byte, all eight positions over the bytes),
    bit flips over each part (first, middle, last ciphertext byte, every tag byte), and truncations
    and extensions of each value: ``(what, {name: value})``."""
    for i in range(len(meta)):
        v = bytearray(meta)
        v[i] ^= 1 << (i % 8)
        yield f"metadata byte {i}", {meta_name: bytes(v)}
    for name, value in parts.items():
        n = len(value)
        for i in sorted({0, 1, n // 2, n - 17} | set(range(n - 16, n))):
            v = bytearray(value)
            v[i] ^= 0x80 >> (i % 8)
            yield f"part {name[-36:]} byte {i}", {name: bytes(v)}
    for name, value in [(meta_name, meta), *parts.items()]:
        for what, v in (("cut 1", value[:-1]), ("cut 16", value[:-16]), ("extended 1", value + b"\0"),
                        ("extended 16", value + bytes(16)), ("doubled", value + value)):
            yield f"{name[-36:]} {what}", {name: v}


def test_every_bit_flip_truncation_and_extension_is_a_miss(cluster, store, pool, raw, keys):
    k12 = keys["k12"]
    key = chunk_keys(k12, "flips", [b"flipped"])[0]
    spec = {key: (SLOT + 1000, 11)}
    put(store, pool, spec)
    genuine = stored(cluster, raw, store, key)
    meta_name = store._layout.meta_key(key)
    parts = {n: v for n, v in genuine.items() if n != meta_name}
    assert len(parts) == 2
    cases = list(tamper_cases(meta_name, genuine[meta_name], parts))
    assert len(cases) > len(genuine[meta_name]) + 2 * 20
    missed = []
    for what, change in cases:
        raw_write(raw, {**genuine, **change})
        got = get(store, pool, spec)[key]
        assert isinstance(got, (ObjectUnauthentic, ObjectUnknownEpoch)), (what, got)
        missed.append(type(got))
    c = store.counters()
    assert c["auth_failures"] + c["unknown_epoch"] == len(cases) and c["gets"] == 0
    assert c["unknown_epoch"] >= 1  # a flip in the clear epoch names an epoch the key file lacks
    raw_write(raw, genuine)  # the genuine values, untouched, still read
    assert get(store, pool, spec)[key] is True


def test_key_epochs_rotated_and_retired(cluster, pool, keys):
    k1, k12, k2 = keys["k1"], keys["k12"], keys["k2"]
    old, new = chunk_keys(k1, "", [b"sealed at epoch 1"])[0], chunk_keys(k1, "", [b"sealed at epoch 2"])[0]
    with new_store(cluster, pool, k1) as before, new_store(cluster, pool, k12) as rotated, \
            new_store(cluster, pool, k2) as retired:
        put(before, pool, {old: (3000, 1)})
        put(rotated, pool, {new: (3000, 2)})
        assert get(rotated, pool, {old: (3000, 1)})[old] is True  # an old epoch reads until retired
        got = get(before, pool, {new: (3000, 2)})[new]  # a server that lacks the new epoch: a miss
        assert isinstance(got, ObjectUnknownEpoch) and not got.retired
        assert before.exists_many([new]) == [True]  # left for the servers that hold it
        assert get(retired, pool, {new: (3000, 2)})[new] is True
        got = get(retired, pool, {old: (3000, 1)})[old]
        assert isinstance(got, ObjectUnknownEpoch) and got.retired
        assert retired.exists_many([old]) == [False]  # a retired epoch's object is dropped
        assert (before.counters()["unknown_epoch"], retired.counters()["unknown_epoch"]) == (1, 1)
        assert "epoch" in str(got) and old.hex() not in str(got) and old[2:].hex()[:16] not in str(got)


def test_misses_name_no_object_and_misuse_is_refused(store, pool, raw, keys):
    k12 = keys["k12"]
    key = chunk_keys(k12, "", [b"named"])[0]
    put(store, pool, {key: (500, 3)})
    raw_write(raw, {store._layout.meta_key(key): b"junk"})
    got = get(store, pool, {key: (500, 3), chunk_keys(k12, "", [b"absent"])[0]: (500, 3)})
    texts = [str(v) for v in got.values()]
    assert all(key.hex()[4:20] not in t and "6b62" not in t for t in texts), texts
    outside = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not registered with Mooncake"):
        store.put_many([key], [[outside]])
    with pytest.raises(TypeError, match="Sealer"):
        ClusterStore(store._conn.master, IDENTITY, pool, sealer=object())
    assert isinstance(store._layout, SealedLayout) and store.sealed and store.layout_identity.endswith("|sealed")
    assert not isinstance(Layout(IDENTITY), SealedLayout)


def test_sealed_replicas_reload_from_private_staging_and_recompute_what_a_rogue_touched(cluster, raw, keys,
                                                                                        monkeypatch):
    """Two replicas' scheduler and worker halves (tests/test_vllm_connector_cluster.py's, over CPU
    pages) whose cluster stores seal: a prefix computed on A reloads on B bit for bit, decrypted
    into B's staging slots (host memory Mooncake never had registered) and unpacked from there; a
    rogue's bytes in one object make that chunk and the ones after it recomputed, right."""
    from test_vllm_connector_cluster import CHUNK, Replica, close_all, cluster_keys, request

    import saria.integrations.vllm.worker_start as worker_start
    plain = worker_start.WorkerCluster

    def sealed(engine, master, identity, **kw):
        return plain(engine, master, identity, **{**kw, "sealer": Sealer(keys["k12"], "cluster", identity)})

    monkeypatch.setattr(worker_start, "WorkerCluster", sealed)
    made = []

    def replica():  # the scheduler names chunks by block hash (no key file): the stores seal, as patched
        made.append(Replica(cluster, cluster_insecure=True))
        return made[-1]

    try:
        a, b = replica(), replica()
        assert a.worker.cluster.sealed and a.worker.cluster.layout_identity.endswith("|sealed")
        assert a.run(request("a1", 4, "sealed"))["right"] and a.shared() == 4
        second = b.run(request("b1", 5, "sealed"))
        assert second["offered"] == 4 * CHUNK and not second["errors"] and second["right"]
        assert b.totals()["hit_tokens_cluster"] == 4 * CHUNK
        store = b.worker.cluster.store
        assert store.counters()["gets"] == 4 and store.counters()["auth_failures"] == 0
        pool = b.worker.cluster.engine.host_pool
        lo, hi = pool.slot(0).data_ptr(), pool.slot(pool.num_slots - 1).data_ptr() + pool.slot_bytes
        assert all(p + n <= lo or p >= hi for p, n in store.mooncake_ranges)  # staging is private
        # a rogue rewrites chunk 1's parts between a lookup and the load of a third replica
        key = cluster_keys("sealed", range(1, 2))[0]
        values = stored(cluster, raw, store, key)
        rogue = {n: bytes(len(v)) for n, v in values.items() if not n.endswith("/m")}
        c = replica()
        run = c.run(request("c1", 4, "sealed"), between=lambda: raw_write(raw, rogue))
        assert run["offered"] == 4 * CHUNK and run["computed"] == CHUNK and run["right"]
        assert c.totals()["cluster_chunks_missed"] == 3 and c.totals()["loads_failed"] == 0
        assert c.worker.cluster.counters()["store"]["auth_failures"] == 1 and c.worker.faults.count == 0
    finally:
        close_all(made)


# ------------------------------------------------------------------ metadata that cannot amplify or block (issue 43)


def planted_claim(parts: int, version: int = 2) -> bytes:
    """A metadata value a rogue plants: clear fields claiming ``parts`` parts (of metadata format
    ``version``: 2 as the saria before per-part keys wrote it, 3 now), exactly the size that count
    implies, a body of junk. Laid out here independently of saria's encoder."""
    nonce = 12 if version == 2 else 24
    head = struct.pack(f"<4sHHII8s16s{nonce}s", b"SRCM", version, 0, parts, 1, bytes(8), bytes(16), bytes(nonce))
    body = 48 + (12 + nonce) * parts + 16
    return head + bytes(body)


def test_a_huge_planted_metadata_value_is_a_bounded_miss(cluster, store, pool, raw, keys):
    """A 12 MB value claiming 500,000 parts under a live object's metadata key (and under a name
    never written): the scheduler's lookups and the store's own answer it as a miss, in time
    bounded whatever the claim (the value is never fetched, no key per claimed part is made), and
    count it; the object is written again by the next put and loads."""
    from saria.dataplane.cluster.index import ClusterIndex
    k12 = keys["k12"]
    live, fresh = chunk_keys(k12, "amp", [b"amplified live", b"amplified fresh"])
    assert put(store, pool, {live: (3 * SLOT, 11)}) == [3 * SLOT]
    layout = store._layout
    claim = planted_claim(500_000)
    assert len(claim) > 12_000_000
    raw_write(raw, {layout.meta_key(live): claim, layout.meta_key(fresh): claim})
    index = ClusterIndex(cluster.master, 1, timeout_s=30.0)
    try:
        index.add_layouts([store.layout_identity])
        t0 = time.perf_counter()
        for _ in range(5):
            assert index.leading([live, fresh]) == 0
            assert store.exists_many([live, fresh], timeout_s=30.0) == [False, False]
        took = (time.perf_counter() - t0) / 10
        # a lookup that built a key per claimed part took 0.2 s and more each; one that does not, about a millisecond
        assert took < 0.05, f"{took:.3f} s per lookup"
        assert index.counters()["junk_meta"] == 10 and store.counters()["junk_meta"] == 10
    finally:
        index.close()
    assert store.remove_many([fresh]) == 1  # a removal does not expand the claim either
    assert put(store, pool, {live: (3 * SLOT, 11)}) == [3 * SLOT]
    assert get(store, pool, {live: (3 * SLOT, 11)}) == {live: True}
    assert store.exists_many([live]) == [True]
    assert store.counters()["rewritten"] == 1


def test_junk_metadata_under_a_live_name_does_not_block_the_chunk(cluster, store, pool, raw, keys):
    """Metadata that does not open (junk of the right size, a claim of many parts, another object's
    metadata) or whose parts are gone, under a name: the next put writes the object (``rewritten``)
    and it loads; a sound object is not written again (``present``)."""
    k12 = keys["k12"]
    names = chunk_keys(k12, "junk", [b"junk %d" % i for i in range(5)])
    donor = chunk_keys(k12, "junk", [b"donor"])[0]
    sizes = {k: (2 * SLOT + 100, 20 + i) for i, k in enumerate(names)}
    layout = store._layout
    assert put(store, pool, {**sizes, donor: (2 * SLOT + 100, 30)}) == [2 * SLOT + 100] * 6
    meta_of = {k: raw_values(raw, [layout.meta_key(k)])[layout.meta_key(k)] for k in names + [donor]}
    a, b, c, d, sound = names
    raw_write(raw, {layout.meta_key(a): os.urandom(len(meta_of[a])),  # junk of the right size
                    layout.meta_key(b): planted_claim(3, version=3),  # a claim that does not open
                    layout.meta_key(c): meta_of[donor]})  # another object's sealed metadata
    opened = layout.open_meta(store._sealer, d, meta_of[d])  # d's own metadata, a part removed
    assert raw.remove(layout.part_keys(d, opened)[1]) == 0
    assert store.exists_many(names) == [False, False, False, False, True]
    before = store.counters()
    assert put(store, pool, sizes) == [2 * SLOT + 100] * 5
    assert store.exists_many(names) == [True] * 5
    assert get(store, pool, sizes) == dict.fromkeys(names, True)
    after = store.counters()
    assert after["rewritten"] - before["rewritten"] == 4 and after["present"] - before["present"] == 1
    assert get(store, pool, {donor: (2 * SLOT + 100, 30)}) == {donor: True}


def test_an_object_has_at_most_max_parts(store, pool):
    from saria.dataplane.cluster.layout import MAX_PARTS
    slot = pool.allocate(1)
    try:
        view = pool.views(slot, 64)[0]
        with pytest.raises(ValueError, match="at most"):
            store.put_many([object_key(b"\x01" * 48, "kv")], [[view[i:i + 1] for i in range(1)] * (MAX_PARTS + 1)])
    finally:
        pool.free(slot)


# ------------------------------------------------------------------ objects of the saria before per-part keys


def put_version_2_object(raw, store, keyring, key: bytes, data: bytes) -> None:
    """Write ``key``'s object as the saria before per-part keys wrote it, with a plain client:
    parts sealed by seal format 1 (12-byte nonces, directly under K_eT), metadata of format
    version 2 (laid out here independently of saria's encoder: 52 clear bytes, 48 + 24 n sealed)."""
    old = Version1Sealer(keyring, "cluster", IDENTITY)
    layout = store._layout
    chunks = [data[i:i + SLOT] for i in range(0, len(data), SLOT)]
    write_id = os.urandom(16)
    values, rows = {}, []
    for j, chunk in enumerate(chunks):
        out = bytearray(len(chunk) + 16)
        sealed = old.seal_into(PartContext(key, j, len(chunks), len(data), len(chunk)), chunk, out)
        values[f"{layout.prefix(key)}{j}.{write_id.hex()}"] = bytes(out)
        rows.append(struct.pack("<QI12s", len(chunk), sealed.epoch, sealed.nonce))
    body = struct.pack("<IIQ16s16s", len(chunks), 0, len(data), layout.digest, write_id) + b"".join(rows)
    sealed_body = bytearray(len(body) + 16)
    meta = old.seal_into(PartContext(key, 0, 1, (1 << 62) + len(body), len(body)), body, sealed_body)
    head = struct.pack("<4sHHII8s16s12s", b"SRCM", 2, 0, len(chunks), meta.epoch, keyring.key_id, write_id,
                       meta.nonce)
    values[layout.meta_key(key)] = head + bytes(sealed_body)
    assert len(values[layout.meta_key(key)]) == 116 + 24 * len(chunks)
    raw_write(raw, values)


def test_objects_of_the_saria_before_per_part_keys_still_load(cluster, store, pool, raw, keys):
    """Objects an older saria put (metadata version 2, parts of seal format 1) are found, load
    exactly, and are not written again; a bit flipped in one of their parts is a miss as before.
    New objects are written as version 3 beside them."""
    k12 = keys["k12"]
    old_keys = chunk_keys(k12, "old", [b"old %d" % i for i in range(3)])
    objects = {k: (n, 40 + i) for i, (k, n) in enumerate(zip(old_keys, [100, 2 * SLOT, 3 * SLOT + 5]))}
    for k, (n, seed) in objects.items():
        put_version_2_object(raw, store, k12, k, pattern(n, seed).numpy().tobytes())
    assert store.exists_many(old_keys) == [True] * 3
    assert get(store, pool, objects) == dict.fromkeys(old_keys, True)
    before = store.counters()
    assert put(store, pool, objects) == [n for n, _ in objects.values()]  # sound: not written again
    after = store.counters()
    assert after["present"] - before["present"] == 3 and after["rewritten"] == before["rewritten"]
    victim = old_keys[2]
    part = f"{store._layout.prefix(victim)}1."
    (name,) = [n for n in mooncake_keys(cluster) if n.startswith(part)]
    value = bytearray(raw_values(raw, [name])[name])
    value[7] ^= 1
    raw_write(raw, {name: bytes(value)})
    got = get(store, pool, objects)
    assert got[old_keys[0]] is True and got[old_keys[1]] is True and isinstance(got[victim], ObjectUnauthentic)
    new = chunk_keys(k12, "old", [b"new"])[0]
    assert put(store, pool, {new: (SLOT + 1, 49)}) == [SLOT + 1]
    meta = raw_values(raw, [store._layout.meta_key(new)])[store._layout.meta_key(new)]
    assert meta[4:6] == (3).to_bytes(2, "little") and len(meta) == 128 + 36 * 2
    assert get(store, pool, {new: (SLOT + 1, 49), old_keys[0]: (100, 40)}) == {new: True, old_keys[0]: True}

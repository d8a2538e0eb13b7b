"""Sealed SSD stores on real drive files in a temp dir (docs/ssd.md, "Sealed objects"): every part
is sealed with AES-256-GCM under a real key file, and whatever an attacker with the drive files
does (flip a bit, edit a header and fix its checksum, cut or extend an object, swap two objects,
copy one in from another store or under another tenant's name) is a miss that is counted, never
bytes. Restarts with the same key find the objects; another key file, an unsealed store and a
retired epoch read nothing. The transfer engine's SSD reloads land verified bytes only."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from kernel_cases import fresh_like, vllm_layers
from saria.config import Capacity, ChunkSpec, SariaConfig
from saria.control import DropOrder, ObjectKey, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import Coordinator, HostPool, TransferEngine
from saria.dataplane.build import open_data_plane, sized_config
from saria.dataplane.ssd import (ObjectCorrupt, ObjectEpochUnknown, ObjectNotFound, ObjectUnauthentic, ObjectUnreadable,
                                 ObjectWriteError, SSDStore, object_key)
from saria.dataplane.ssd.format import SEALED_SLOT_VERSION, SLOT_VERSION, Geometry
from saria.kernels import PageTable
from saria.seal import Keyring, PartContext, Unauthentic, retire_epoch, rotate_key_file
from seal_cases import Version1Sealer
from ssd_cases import (SEALED_FIELDS, Fault, FaultyOps, capacity, drive_file, drives, flip_byte, header_block,
                       make_sealer, patch_header, payload, put_header, read_back)

LOGGER = "saria.dataplane.ssd"
IDENTITY = '{"model":"tiny","rank":0}'
PB = 4096  # one block per part: sealed parts of 4 KiB, and small drive files
SLOTS = 64
SCOPE = b"tiny/bf16/4x768"


def open_store(root: Path, key_file: Path | None, n_drives=1, slots=SLOTS, identity=IDENTITY, **kw) -> SSDStore:
    kw.setdefault("read_threads", 4)
    kw.setdefault("durable", False)
    root.mkdir(parents=True, exist_ok=True)
    sealer = None if key_file is None else make_sealer(key_file, identity)
    return SSDStore(drives(root, n_drives), capacity(slots, PB), PB, identity=identity, sealer=sealer, **kw)


def names(keyring: Keyring, salt: str | None, n: int, first: int = 0) -> list[bytes]:
    """Storage names of ``n`` kv objects of tenant ``salt``, as the vLLM scheduler makes them."""
    hashes = [bytes([i % 251]) * 32 for i in range(first, first + n)]
    return [object_key(c, "kv") for c in keyring.chunk_ids(keyring.tenant(salt), SCOPE, hashes)]


def header_at(store: SSDStore, key: bytes, part: int = 0) -> tuple[Path, int]:
    """The drive file and header offset of part ``part`` of ``key``."""
    p = store.info(key).parts[part]
    return drive_file(store.paths[p.drive].parent), Geometry(PB, SLOTS).header_offset(p.slot)


def payload_at(store: SSDStore, key: bytes, part: int = 0) -> tuple[Path, int]:
    p = store.info(key).parts[part]
    return drive_file(store.paths[p.drive].parent), Geometry(PB, SLOTS).payload_offset(p.slot)


def read_error(store: SSDStore, key: bytes, length: int) -> BaseException | None:
    """How reading ``key`` into a destination of ``length`` bytes fails (``None``: it did not)."""
    return store.read(key, torch.zeros(length, dtype=torch.uint8)).exception(timeout=30)


def secrets_of(key_file: Path, *more: bytes) -> list[str]:
    """Hex of what must never reach a log line or a message: the key file's secrets, its key id,
    and ``more`` (storage names, chunk ids, block hashes)."""
    ring = Keyring.load(key_file)
    text = key_file.read_text()
    return [ring.key_id.hex()] + [h for h in text.split('"') if len(h) == 64] + [m.hex() for m in more]


def assert_nothing_leaks(caplog, errors, leaks: list[str]) -> None:
    texts = [r.getMessage() for r in caplog.records] + [str(e) for e in errors if e is not None]
    for text in texts:
        for leak in leaks:
            assert leak not in text and leak[:16] not in text, text


# ------------------------------------------------------------------ round trips and restarts


def test_sealed_objects_round_trip_on_several_drives(tmp_path):
    kf = tmp_path / "keys"
    store = open_store(tmp_path, kf, n_drives=3)
    ring = store._sealing.sealer.keyring
    keys = names(ring, "tenant-a", 4) + names(ring, None, 2) + [object_key("trace-chunk", "state")]
    lengths = [1, PB - 1, PB, 5 * PB - 3, 3 * PB, 2 * PB + 5, 7]
    objs = {k: payload(n, i) for i, (k, n) in enumerate(zip(keys, lengths))}
    assert store.sealed
    for i, (k, v) in enumerate(objs.items()):  # callers' checksums (here wrong) are not kept: tags replace them
        info = store.write(k, v, [12345] * len(v.split(PB)) if i % 2 else None).result(timeout=30)
        assert all(p.checksum == 0 and p.seal.epoch == 1 for p in info.parts)
        assert "<sealed>" in repr(info) and k.hex() not in repr(info)
    assert {p.drive for k in keys for p in store.info(k).parts} == {0, 1, 2}
    for k, v in objs.items():
        assert torch.equal(read_back(store, k, v.numel()), v)
    outs = [torch.zeros(v.numel() + 3, dtype=torch.uint8) for v in objs.values()]
    for f in store.read_many(list(objs), outs):
        f.result(timeout=30)
    assert all(torch.equal(o[:v.numel()], v) and not o[v.numel():].any() for o, v in zip(outs, objs.values()))
    per_part = [[t for t in v.split(PB)] for v in objs.values()]
    outs = [[torch.empty_like(t) for t in parts] for parts in per_part]
    for f in store.read_many(list(objs), outs):
        f.result(timeout=30)
    assert all(torch.equal(a, b) for o, parts in zip(outs, per_part) for a, b in zip(o, parts))
    path, offset = header_at(store, keys[3])
    assert int.from_bytes(header_block(path, offset)[8:10], "little") == SEALED_SLOT_VERSION
    c = store.counters()
    assert c["reads"] == 3 * len(objs) and c["auth_failures"] == c["verification_failures"] == 0
    store.close()
    store = open_store(tmp_path, kf, n_drives=3)  # the same key file: every object found again
    assert sorted(store.keys()) == sorted(objs)
    assert all(torch.equal(read_back(store, k, v.numel()), v) for k, v in objs.items())
    store.close()


def test_restart_over_a_store_sealed_by_version_1_opens_its_objects(tmp_path, caplog):
    """A drive file written with seal format version 1 (12-byte nonces, slot headers of version 2):
    a restart of this saria indexes and opens every object, writes new ones as version 3, and a
    version-1 header tampered with is a miss as before."""
    kf = tmp_path / "keys"
    make_sealer(kf, IDENTITY)
    old_sealer = Version1Sealer(Keyring.load(kf), "ssd", IDENTITY)
    store = SSDStore(drives(tmp_path, 1), capacity(SLOTS, PB), PB, identity=IDENTITY, sealer=old_sealer,
                     read_threads=2, durable=False)
    old = names(old_sealer.keyring, "t", 4)
    lengths = [1, PB, 2 * PB + 7, 3 * PB]
    for i, (k, n) in enumerate(zip(old, lengths)):
        store.write(k, payload(n, i)).result(timeout=30)
    path, offset = header_at(store, old[3])
    store.close()
    assert int.from_bytes(header_block(path, offset)[8:10], "little") == 2  # the old slot version
    patch_header(path, offset, SEALED_FIELDS + 8, bytes([header_block(path, offset)[SEALED_FIELDS + 8] ^ 1]))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = open_store(tmp_path, kf)  # this saria: seals version 2, opens both
    assert sorted(store.keys()) == sorted(old)
    assert all(p.seal.version == 1 for k in old for p in store.info(k).parts)
    for i, (k, n) in enumerate(zip(old[:3], lengths)):
        assert torch.equal(read_back(store, k, n), payload(n, i))
    assert isinstance(read_error(store, old[3], 3 * PB), ObjectUnauthentic)  # its nonce flipped
    new = names(store._sealing.sealer.keyring, "t", 2, first=10)
    for i, k in enumerate(new):
        info = store.write(k, payload(PB + i, 10 + i)).result(timeout=30)
        assert info.parts[0].seal.version == 2 and len(info.parts[0].seal.nonce) == 24
        path, offset = header_at(store, k)
        assert int.from_bytes(header_block(path, offset)[8:10], "little") == SEALED_SLOT_VERSION == 3
    c = store.counters()
    assert c["corrupt_headers"] == 0 and c["auth_failures"] == 1 and c["other_key_dropped_at_open"] == 0
    store.close()
    with open_store(tmp_path, kf) as store:  # and once more: both versions side by side
        assert sorted(store.keys()) == sorted(old[:3] + new)
        for i, (k, n) in enumerate(zip(old[:3], lengths)):
            assert torch.equal(read_back(store, k, n), payload(n, i))
        for i, k in enumerate(new):
            assert torch.equal(read_back(store, k, PB + i), payload(PB + i, 10 + i))


def test_unsealed_store_writes_slot_version_1_as_before(tmp_path):
    with open_store(tmp_path, None) as store:
        assert not store.sealed
        info = store.write(b"plain", payload(100, 1)).result(timeout=30)
        assert info.parts[0].seal is None and info.parts[0].checksum != 0 and "<5 bytes>" in repr(info)
        assert "plain" not in repr(info)  # nor an unsealed key: it holds a chunk hash
        path, offset = header_at(store, b"plain")
        assert int.from_bytes(header_block(path, offset)[8:10], "little") == SLOT_VERSION
        with pytest.raises(ObjectNotFound, match=r"no object under that key \(4 bytes\)"):
            store.read(b"miss", torch.zeros(1, dtype=torch.uint8))


def test_no_plaintext_no_block_hash_no_salt_in_the_drive_files(tmp_path):
    pattern = b"SARIA-PLAINTEXT-PATTERN!"
    data = torch.frombuffer(bytearray(pattern * (3 * PB // len(pattern) + 1)), dtype=torch.uint8)[:3 * PB - 9].clone()
    block_hash = b"\xab\xcd-block-hash-of-a-prompt!\x01\x02\x03\x04"
    with open_store(tmp_path / "sealed", tmp_path / "keys", n_drives=2) as store:
        ring = store._sealing.sealer.keyring
        key = object_key(ring.chunk_ids(ring.tenant("salt-of-tenant-x"), SCOPE, [block_hash])[0], "kv")
        store.write(key, data).result(timeout=30)
        assert torch.equal(read_back(store, key, data.numel()), data)
    with open_store(tmp_path / "plain", None, n_drives=2) as store:  # the search can find it where it is
        store.write(object_key(block_hash, "kv"), data).result(timeout=30)
    for root, found in (("sealed", False), ("plain", True)):
        blob = b"".join(drive_file(d).read_bytes() for d in (tmp_path / root).iterdir())
        assert (pattern[:16] in blob) is found
        assert (block_hash in blob) is found
        assert b"salt-of-tenant-x" not in blob


def test_restart_with_another_key_file_reads_nothing_and_says_so_once(tmp_path, caplog):
    store = open_store(tmp_path, tmp_path / "keys-1", n_drives=2)
    keys = names(store._sealing.sealer.keyring, "t", 5)
    for i, k in enumerate(keys):
        store.write(k, payload(2 * PB + i, i)).result(timeout=30)
    store.close()
    caplog.set_level(logging.WARNING, LOGGER)
    caplog.clear()
    store = open_store(tmp_path, tmp_path / "keys-2", n_drives=2)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "5 object(s)" in lines[0] and "sealed under another key file" in lines[0]
    assert "nvme0" in lines[0] and "nvme1" in lines[0]
    assert store.keys() == [] and store.free_parts == 2 * SLOTS
    assert store.counters()["other_key_dropped_at_open"] == 5
    with pytest.raises(ObjectNotFound) as err:
        store.read(keys[0], torch.zeros(3 * PB, dtype=torch.uint8))
    new = names(store._sealing.sealer.keyring, "t", 1, first=50)[0]
    store.write(new, payload(10, 9)).result(timeout=30)  # the store works on under its own key
    store.close()
    leaks = secrets_of(tmp_path / "keys-1", *keys) + secrets_of(tmp_path / "keys-2", new)
    assert_nothing_leaks(caplog, [err.value], leaks)


def test_sealed_store_never_serves_plaintext_objects_and_unsealed_never_reads_sealed(tmp_path, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    with open_store(tmp_path, None, n_drives=2) as store:
        for i in range(3):
            store.write(bytes([i]) * 50, payload(PB + i, i)).result(timeout=30)
    with open_store(tmp_path, tmp_path / "keys", n_drives=2) as store:
        assert store.keys() == [] and store.counters()["unsealed_dropped_at_open"] == 3
        store.write(bytes([9]) * 50, payload(100, 9)).result(timeout=30)
    with open_store(tmp_path, None, n_drives=2) as store:
        assert store.keys() == [] and store.counters()["sealed_dropped_at_open"] == 1
        assert store.free_parts == 2 * SLOTS
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2
    assert "3 object(s)" in lines[0] and "were not sealed" in lines[0]
    assert "1 object(s)" in lines[1] and "this store has no key file" in lines[1]


def test_rotation_keeps_old_objects_readable_and_retirement_makes_them_misses(tmp_path):
    kf = tmp_path / "keys"
    store = open_store(tmp_path, kf)
    old = names(store._sealing.sealer.keyring, "t", 3)
    for i, k in enumerate(old):
        store.write(k, payload(1000 + 100 * i, i)).result(timeout=30)
    store.close()
    rotate_key_file(kf)
    store = open_store(tmp_path, kf)
    assert all(torch.equal(read_back(store, k, 1000 + 100 * i), payload(1000 + 100 * i, i)) for i, k in enumerate(old))
    new = names(store._sealing.sealer.keyring, "t", 3, first=10)
    for i, k in enumerate(new):
        assert store.write(k, payload(PB, 20 + i)).result(timeout=30).parts[0].seal.epoch == 2
    assert {store.info(k).parts[0].seal.epoch for k in old} == {1}
    path, offset = header_at(store, old[2])
    store.close()
    patch_header(path, offset, SEALED_FIELDS + 4, (2).to_bytes(4, "little"))  # claims epoch 2: another key
    retire_epoch(kf, 1)
    store = open_store(tmp_path, kf)
    assert sorted(store.keys()) == sorted(old + new)  # same key id: indexed, then misses when read
    for k in old[:2]:
        assert isinstance(read_error(store, k, 2 * PB), ObjectEpochUnknown)
    assert isinstance(read_error(store, old[2], 2 * PB), ObjectUnauthentic)
    c = store.counters()
    assert c["unknown_epoch"] == 2 and c["auth_failures"] == 1 and c["read_failures"] == 3
    assert not any(store.contains(k) for k in old)
    assert all(torch.equal(read_back(store, k, PB), payload(PB, 20 + i)) for i, k in enumerate(new))
    store.close()


# ------------------------------------------------------------------ tampering with the drive file


def test_every_bit_flip_of_a_sealed_part_is_refused(tmp_path):
    """Exhaustive over the 32,768 bits of a 4 KiB sealed part, through the store's own read path
    (``SealedParts.read_part`` on the real drive file: flip, read, restore), then a sample of flips
    end to end through ``read_many`` (each a miss, counted, the object dropped)."""
    with open_store(tmp_path, tmp_path / "keys", direct=False) as store:  # flips land in the page cache
        key = names(store._sealing.sealer.keyring, "t", 1)[0]
        data = payload(PB, 1)
        info = store.write(key, data).result(timeout=30)
        part = info.parts[0]
        path, offset = payload_at(store, key)
        ctx = PartContext(key, 0, 1, PB, PB)
        out = torch.empty(PB, dtype=torch.uint8)
        store._sealing.read_part(0, offset, ctx, part.seal, out)
        assert torch.equal(out, data)
        fd = os.open(path, os.O_RDWR)
        try:
            original = os.pread(fd, PB, offset)
            refused = 0
            for bit in range(8 * PB):
                byte = original[bit // 8] ^ (1 << bit % 8)
                os.pwrite(fd, bytes([byte]), offset + bit // 8)
                try:
                    store._sealing.read_part(0, offset, ctx, part.seal, out)
                except Unauthentic:
                    refused += 1
                    assert not out.any()
                os.pwrite(fd, original[bit // 8:bit // 8 + 1], offset + bit // 8)
        finally:
            os.close(fd)
        assert refused == 8 * PB
        assert torch.equal(read_back(store, key, PB), data)  # restored: served again

        keys = names(store._sealing.sealer.keyring, "t", SLOTS - 1, first=1)
        written = {k: payload(PB, i) for i, k in enumerate(keys)}
        for k, v in written.items():
            store.write(k, v).result(timeout=30)
        for i, k in enumerate(keys):  # one bit each, spread over the part (first, last and between)
            path, offset = payload_at(store, k)
            where = (i * 4093) % PB if i else PB - 1
            with open(path, "r+b") as f:
                f.seek(offset + where)
                b = f.read(1)[0]
                f.seek(offset + where)
                f.write(bytes([b ^ (1 << (i % 8))]))
        outs = [torch.full((PB,), 7, dtype=torch.uint8) for _ in keys]
        errors = [f.exception(timeout=30) for f in store.read_many(keys, outs)]
        assert all(isinstance(e, ObjectUnauthentic) and isinstance(e, ObjectCorrupt) for e in errors)
        assert not any(o.any() for o in outs)  # zeroed: no unverified plaintext left behind
        c = store.counters()
        assert c["auth_failures"] == len(keys) and not any(store.contains(k) for k in keys)
        assert store.contains(key)


def test_every_byte_of_the_sealed_header_fields_is_refused(tmp_path):
    """Each byte of a sealed header's fields changed (the header's blake2b recomputed, as an
    attacker with the file can): a corrupt header, another key's object, an unknown epoch or a failed
    tag, each counted, never bytes."""
    fields = {"checksum": range(56, 64), "flags": range(128, 132), "epoch": range(132, 136),
              "random value": range(136, 160), "tag": range(160, 176), "key id": range(176, 184),
              "reserved": range(184, 188)}
    positions = [(name, at) for name, span in fields.items() for at in span]
    kf = tmp_path / "keys"
    with open_store(tmp_path, kf, slots=2 * SLOTS) as store:
        keys = names(store._sealing.sealer.keyring, "t", len(positions))
        where = {}
        for i, k in enumerate(keys):
            store.write(k, payload(1000 + i, i)).result(timeout=30)
            where[k] = header_at(store, k)
    for (name, at), k in zip(positions, keys):
        path, offset = where[k]
        block = header_block(path, offset)
        patch_header(path, offset, at, bytes([block[at] ^ (0x01 if at % 2 else 0x80)]))
    with open_store(tmp_path, kf, slots=2 * SLOTS) as store:
        errors = {k: read_error(store, k, 2000) if store.contains(k) else None for k in keys}
        c = store.counters()
    by_field = {}
    for (name, _), k in zip(positions, keys):
        e = errors[k]
        by_field.setdefault(name, set()).add(type(e).__name__ if e is not None else "not served")
    assert by_field == {"checksum": {"not served"}, "flags": {"not served"}, "reserved": {"not served"},
                        "epoch": {"ObjectEpochUnknown"}, "random value": {"ObjectUnauthentic"},
                        "tag": {"ObjectUnauthentic"}, "key id": {"not served"}}
    assert c["corrupt_headers"] == 16 and c["other_key_dropped_at_open"] == 8
    assert c["unknown_epoch"] == 4 and c["auth_failures"] == 40 and c["reads"] == 0


def test_truncated_or_extended_objects_are_refused(tmp_path):
    kf = tmp_path / "keys"
    lengths = {"cut by one": 2999, "cut to one": 1, "extended by one": 3001, "extended to the slot": PB}
    with open_store(tmp_path, kf, n_drives=2) as store:
        ring = store._sealing.sealer.keyring
        single = dict(zip(lengths, names(ring, "t", len(lengths))))
        for k in single.values():
            store.write(k, payload(3000, 3)).result(timeout=30)
        multi, cut_last = names(ring, "t", 2, first=20)
        for k in (multi, cut_last):
            store.write(k, payload(PB + 1000, 4)).result(timeout=30)
        headers = {k: [header_at(store, k, i) for i in range(len(store.info(k).parts))]
                   for k in [*single.values(), multi, cut_last]}
    for what, k in single.items():
        (path, offset), = headers[k]
        n = lengths[what].to_bytes(8, "little")
        patch_header(path, offset, 32, n + n)  # object length and part length, consistent
    for i, (path, offset) in enumerate(headers[multi]):  # the whole object one byte shorter
        patch_header(path, offset, 32, (PB + 999).to_bytes(8, "little"))
        if i == 1:
            patch_header(path, offset, 40, (999).to_bytes(8, "little"))
    path, offset = headers[cut_last][1]  # only the last part's length: inconsistent, never indexed
    patch_header(path, offset, 40, (999).to_bytes(8, "little"))
    with open_store(tmp_path, kf, n_drives=2) as store:
        assert not store.contains(cut_last) and store.counters()["dropped_at_open"] == 1
        for k in [*single.values(), multi]:
            assert isinstance(read_error(store, k, 2 * PB), ObjectUnauthentic)
        c = store.counters()
        assert c["auth_failures"] >= len(single) + 1 and c["read_failures"] == len(single) + 1 and c["reads"] == 0


def test_swapped_objects_are_refused(tmp_path):
    kf = tmp_path / "keys"
    with open_store(tmp_path, kf) as store:
        a, b, c, d, two = names(store._sealing.sealer.keyring, "t", 5)
        for i, k in enumerate((a, b, c, d)):
            store.write(k, payload(2000, i)).result(timeout=30)
        store.write(two, payload(2 * PB, 9)).result(timeout=30)
        ha, hb = header_at(store, a), header_at(store, b)
        pc, pd = payload_at(store, c), payload_at(store, d)
        parts = [header_at(store, two, i) for i in range(2)]
    blocks = [header_block(*ha), header_block(*hb)]
    put_header(*ha, blocks[1][:12] + blocks[0][12:64] + blocks[1][64:128] + blocks[0][128:])  # keys exchanged
    put_header(*hb, blocks[0][:12] + blocks[1][12:64] + blocks[0][64:128] + blocks[1][128:])
    with open(pc[0], "r+b") as f:  # payloads exchanged, headers left alone
        f.seek(pc[1])
        cc = f.read(PB)
        f.seek(pd[1])
        dd = f.read(PB)
        f.seek(pd[1])
        f.write(cc)
        f.seek(pc[1])
        f.write(dd)
    for (path, offset), index in zip(parts, (1, 0)):  # the two parts of one object exchanged
        patch_header(path, offset, 12, index.to_bytes(4, "little"))
    with open_store(tmp_path, kf) as store:
        assert sorted(store.keys()) == sorted([a, b, c, d, two])
        for k in (a, b, c, d, two):
            assert isinstance(read_error(store, k, 2 * PB), ObjectUnauthentic)
        assert store.counters()["auth_failures"] >= 5 and store.keys() == []


def test_an_object_copied_in_from_a_store_of_another_identity_is_refused(tmp_path):
    kf = tmp_path / "keys"
    with open_store(tmp_path / "other", kf, identity='{"model":"other","rank":0}') as other:
        key = names(other._sealing.sealer.keyring, "t", 1)[0]
        other.write(key, payload(3000, 5)).result(timeout=30)
        src_header, src_payload = header_at(other, key), payload_at(other, key)
    with open_store(tmp_path / "mine", kf) as mine:
        mine.write(names(mine._sealing.sealer.keyring, "t", 1, first=9)[0], payload(10, 1)).result(timeout=30)
    dest = drive_file(tmp_path / "mine" / "nvme0")
    g = Geometry(PB, SLOTS)
    with open(src_header[0], "rb") as f:
        f.seek(src_header[1])
        slot = f.read(g.stride)  # the header and the payload, byte for byte
    with open(dest, "r+b") as f:
        f.seek(g.header_offset(SLOTS - 1))
        f.write(slot)
    with open_store(tmp_path / "mine", kf) as mine:
        assert mine.contains(key)  # a valid header of this key file: indexed, then refused when read
        assert isinstance(read_error(mine, key, 3000), ObjectUnauthentic)
        assert mine.counters()["auth_failures"] == 1 and not mine.contains(key)


def test_tenant_a_object_under_tenant_b_name_is_refused(tmp_path):
    kf = tmp_path / "keys"
    with open_store(tmp_path, kf) as store:
        ring = store._sealing.sealer.keyring
        block_hash = b"\x11" * 32
        key_a, key_b = (object_key(ring.chunk_ids(ring.tenant(s), SCOPE, [block_hash])[0], "kv") for s in ("A", "B"))
        assert key_a != key_b and len(key_a) == len(key_b)
        store.write(key_a, payload(3000, 6)).result(timeout=30)
        path, offset = header_at(store, key_a)
    patch_header(path, offset, 64, key_b)  # tenant A's sealed bytes, under tenant B's name
    with open_store(tmp_path, kf) as store:
        assert store.keys() == [key_b]
        error = read_error(store, key_b, 3000)
        assert isinstance(error, ObjectUnauthentic) and store.counters()["auth_failures"] == 1
        assert key_a.hex()[4:] not in str(error) and key_b.hex()[4:] not in str(error)


def test_messages_of_a_sealed_store_name_no_object(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, LOGGER)
    kf = tmp_path / "keys"
    ops = FaultyOps()
    with open_store(tmp_path, kf, slots=2, io_ops=ops) as store:
        keys = names(store._sealing.sealer.keyring, "t", 3)
        errors = []
        with pytest.raises(ObjectNotFound) as e:
            store.read(keys[0], torch.zeros(1, dtype=torch.uint8))
        errors.append(e.value)
        store.write(keys[0], payload(PB, 1)).result(timeout=30)
        out = torch.zeros(PB, dtype=torch.uint8)
        gate = threading.Event()
        ops.add(Fault("pread", gate=gate))  # the read waits in its pread until the write is refused
        fut = store.read(keys[0], out)
        with pytest.raises(ValueError) as e:  # a write from a destination being filled
            store.write(keys[1], out)
        errors.append(e.value)
        gate.set()
        fut.result(timeout=30)
        ops.add(Fault("pread", error=errno.EIO))
        errors.append(store.read(keys[0], out).exception(timeout=30))
        store.write(keys[0], payload(PB, 1)).result(timeout=30)
        flip_byte(*payload_at(store, keys[0]))
        errors.append(store.read(keys[0], out).exception(timeout=30))
        ops.add(Fault("pwrite", error=errno.ENOSPC))
        errors.append(store.write(keys[2], payload(10, 2)).exception(timeout=30))
    assert "sealed kv object" in str(errors[1]) and isinstance(errors[2], ObjectUnreadable)
    assert isinstance(errors[3], ObjectUnauthentic) and isinstance(errors[4], ObjectWriteError)
    assert_nothing_leaks(caplog, errors, secrets_of(kf, *keys))


# ------------------------------------------------------------------ CUDA destinations


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sealed_parts_to_and_from_cuda_memory(tmp_path):
    with open_store(tmp_path, tmp_path / "keys", n_drives=2) as store:
        k, bad = names(store._sealing.sealer.keyring, "t", 2)
        data = payload(3 * PB - 5, 3).cuda()
        store.write(k, data).result(timeout=30)
        store.write(bad, data).result(timeout=30)
        out = torch.zeros(3 * PB, dtype=torch.uint8, device="cuda")
        store.read(k, out).result(timeout=30)
        assert torch.equal(out[:data.numel()], data) and not out[data.numel():].any()
        flip_byte(*payload_at(store, bad, 1))
        out.zero_()
        assert isinstance(store.read(bad, out).exception(timeout=30), ObjectUnauthentic)
        assert not out[PB:2 * PB].any()  # the failed part never reached the device


# ------------------------------------------------------------------ through the transfer engine

BLOCK_TOKENS, PAGES, NB, SLOT = 4, 2, 48, 4096


def blocks_of(i, base=0):
    return [base + PAGES * i, base + PAGES * i + 1]


def test_sealed_reloads_through_the_transfer_engine(tmp_path):
    """Write-through (and an eviction from DRAM) to a sealed store, then reloads into other pages:
    verified bytes land; a tampered object is a failed load whose pages stay untouched (nothing
    unverified is unpacked)."""
    caches = vllm_layers(NB, BLOCK_TOKENS, 2, 8, torch.bfloat16, layers=3, seed=0)
    target = fresh_like(caches)
    kf = tmp_path / "keys"
    (tmp_path / "d0").mkdir()
    (tmp_path / "d1").mkdir()
    sealer = make_sealer(kf, IDENTITY)
    chunks = sealer.keyring.chunk_ids(sealer.keyring.tenant("t"), SCOPE, [bytes([i]) * 32 for i in range(4)])
    with HostPool(16 * SLOT, SLOT) as pool, \
            SSDStore([tmp_path / "d0", tmp_path / "d1"], capacity(16, SLOT), SLOT, identity=IDENTITY,
                     sealer=sealer) as store:
        writer = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store)
        reader = TransferEngine(PageTable(target), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES, ssd=store)
        try:
            src = {c: blocks_of(i) for i, c in enumerate(chunks)}
            assert writer.write(WriteOrder(1, tuple(chunks[:3]), (), 0, Tier.GPU, "write-through"), src).result().ok
            assert writer.store(StoreOrder(2, (chunks[3],), (), 0), src).result().ok
            assert writer.write(WriteOrder(3, (chunks[3],), (), 0, Tier.DRAM, "eviction"), {}).result().ok
            writer.drop(DropOrder(4, (chunks[3],), (), 0, Tier.DRAM))
            assert all(store.info(object_key(c, "kv")).parts[0].seal is not None for c in chunks)
            evicted = ReloadPlan(2, (chunks[3],), (Tier.SSD,), None, None, 8, 0, 0, False)
            assert reader.load(evicted, [blocks_of(3)]).wait().ok
            bad = store.info(object_key(chunks[1], "kv")).parts[0]
            flip_byte(drive_file(store.paths[bad.drive].parent),
                      Geometry.for_capacity(capacity(16, SLOT), SLOT).payload_offset(bad.slot) + 100)
            plan = ReloadPlan(1, tuple(chunks[:3]), (Tier.SSD,) * 3, None, None, 24, 0, 0, False)
            result = reader.load(plan, [blocks_of(i) for i in range(3)]).wait()
            assert result.failed == (ObjectKey(chunks[1], "kv"),) and result.valid_chunks == 1
            for src_layer, dst_layer in zip(caches, target):
                for page in blocks_of(0) + blocks_of(3):  # the verified chunks landed byte for byte
                    assert torch.equal(dst_layer[page].view(torch.uint8), src_layer[page].view(torch.uint8))
                for page in blocks_of(1):  # the tampered object's pages: not written
                    assert not dst_layer[page].view(torch.uint8).any()
            assert store.counters()["auth_failures"] == 1 and not store.contains(object_key(chunks[1], "kv"))
        finally:
            writer.close()
            reader.close()


def test_open_data_plane_passes_the_sealer(tmp_path):
    caches = vllm_layers(16, 4, 2, 8, torch.bfloat16, layers=1, seed=0)
    table = PageTable(caches)
    cfg = SariaConfig.preset("full-duplicate", chunk=ChunkSpec(chunk_tokens=8, checkpoint_tokens=64),
                             dram=Capacity(nbytes=4 * 4096), ssd=Capacity(nbytes=1 << 20))
    cfg = sized_config(cfg, table, 4)
    (tmp_path / "ssd").mkdir()
    sealer = make_sealer(tmp_path / "keys", IDENTITY)
    data = open_data_plane(cfg, table, block_tokens=4, ssd_paths=[str(tmp_path / "ssd")], ssd_identity=IDENTITY,
                           ssd_sealer=sealer)
    try:
        assert data.ssd.sealed and data.ssd._sealing.sealer is sealer
    finally:
        data.close()
    with pytest.raises(TypeError, match="saria.seal.Sealer"):
        open_data_plane(cfg, table, block_tokens=4, ssd_paths=[str(tmp_path / "ssd")], ssd_sealer="key")
    with pytest.raises(ValueError, match="never move by kvikio"):  # before anything is opened
        SSDStore([tmp_path / "other"], capacity(4, PB), PB, backend="kvikio", sealer=sealer)
    (tmp_path / "other").mkdir()
    with SSDStore([tmp_path / "other"], capacity(4, PB), PB, identity=IDENTITY, sealer=sealer) as store:
        assert store.backend_name == "posix" and store.sealed

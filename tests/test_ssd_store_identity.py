"""The SSD store's identity on real files in a temp dir: every drive file's superblock records what
its objects were written for, and a store opened for another identity wipes the file at open (one
warning line per file, counted) instead of serving its objects. Version-1 superblocks (before
identities) are still read, as identity ``""``."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_cases import vllm_layers
from saria.config import Capacity, ChunkSpec, SariaConfig
from saria.dataplane import SSDStore, StoreConfigError
from saria.dataplane.build import open_data_plane, sized_config
from saria.dataplane.ssd.format import (FORMAT_VERSION, MAX_IDENTITY_BYTES, SUPERBLOCK_BYTES, SuperBlock,
                                        encode_identity)
from saria.kernels import PageTable
from ssd_cases import PB, capacity, drive_file, drives, flip_byte, payload, read_back

LOGGER = "saria.dataplane.ssd"
SLOTS = 16


def identity(**changes) -> str:
    """A canonical JSON identity, as a connector would build it."""
    fields = {"model": "Qwen/Qwen3-8B", "dtype": "bfloat16", "block_tokens": 16, "page_bytes": 65536,
              "tp_size": 1, "rank": 0, **changes}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


A = identity()
B = identity(tp_size=2)


def open_store(root: Path, n_drives=1, slots=SLOTS, part_bytes=PB, **kw) -> SSDStore:
    kw.setdefault("read_threads", 4)
    return SSDStore(drives(root, n_drives), capacity(slots, part_bytes), part_bytes, **kw)


def fill(store: SSDStore, objs: dict[bytes, torch.Tensor]) -> dict:
    return {k: store.write(k, v).result(timeout=30) for k, v in objs.items()}


def assert_serves(store: SSDStore, objs: dict[bytes, torch.Tensor]) -> None:
    """``store`` serves exactly ``objs``, every byte as written."""
    assert sorted(store.keys()) == sorted(objs)
    for k, v in objs.items():
        assert torch.equal(read_back(store, k, v.numel()), v), k


def superblock(directory: Path) -> SuperBlock:
    with open(drive_file(directory), "rb") as f:
        return SuperBlock.decode(f.read(SUPERBLOCK_BYTES))


def write_v1_superblock(directory: Path, part_bytes: int, slots: int) -> None:
    """Put the superblock saria wrote before identities (format version 1) on ``directory``'s file,
    laid out here independently of the encoder."""
    head = struct.pack("<8sHHIQQ", b"SARIADRV", 1, 0, 4096, part_bytes, slots)
    digest = hashlib.blake2b(head, digest_size=8).digest()
    with open(drive_file(directory), "r+b") as f:
        f.write((head + digest).ljust(SUPERBLOCK_BYTES, b"\0"))


def wipe_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "wiped" in r.getMessage()]


def sample_objects(n: int, seed: int = 0) -> dict[bytes, torch.Tensor]:
    lengths = [1, PB - 1, PB, 2 * PB + 5, 3 * PB, 4097, 5 * PB - 3]
    return {f"obj{i}".encode(): payload(lengths[i % len(lengths)], seed + i) for i in range(n)}


# ------------------------------------------------------------------ the superblock

def test_superblock_round_trip_with_a_unicode_identity():
    for ident in ["", "模型=Qwen3 🙂 ünïcödé\n\0tab\t", "é" * (MAX_IDENTITY_BYTES // 2), A]:
        sb = SuperBlock(PB, 1234, ident)
        block = sb.encode()
        assert len(block) == SUPERBLOCK_BYTES
        assert SuperBlock.decode(block) == sb
    assert SuperBlock(PB, 7) == SuperBlock(PB, 7, "") and SuperBlock(PB, 7).identity == ""


def test_every_flipped_byte_of_a_superblock_is_rejected():
    block = SuperBlock(PB, 99, "ïdentity " + A).encode()
    for i in range(SUPERBLOCK_BYTES):  # the identity, its length, the zero padding, the checksum
        damaged = bytearray(block)
        damaged[i] ^= 0x01
        with pytest.raises(ValueError):
            SuperBlock.decode(bytes(damaged))


def test_version_1_superblock_is_read_as_no_identity(tmp_path):
    d = drives(tmp_path, 1)[0]
    drive_file(d).write_bytes(bytes(SUPERBLOCK_BYTES))
    write_v1_superblock(d, PB, 42)
    sb = superblock(d)
    assert (sb.part_bytes, sb.slots, sb.identity) == (PB, 42, "")
    assert SuperBlock(PB, 42).encode()[8:10] == struct.pack("<H", FORMAT_VERSION) != struct.pack("<H", 1)


def test_unknown_format_version_is_rejected():
    block = bytearray(SuperBlock(PB, 1, A).encode())
    block[8:10] = struct.pack("<H", 3)
    with pytest.raises(ValueError, match="format version 3"):
        SuperBlock.decode(bytes(block))


@pytest.mark.parametrize("ident, exc, match", [
    pytest.param("x" * (MAX_IDENTITY_BYTES + 1), ValueError, "3001 bytes of UTF-8, at most 3000", id="ascii"),
    pytest.param("é" * (MAX_IDENTITY_BYTES // 2 + 1), ValueError, "3002 bytes", id="two-byte-chars"),
    pytest.param("\ud800", ValueError, "not valid UTF-8", id="lone-surrogate"),
    pytest.param(b"model", TypeError, "identity must be a str", id="bytes"),
])
def test_bad_identity_is_refused_at_construction(tmp_path, ident, exc, match):
    with pytest.raises(exc, match=match):
        SuperBlock(PB, 1, ident)
    with pytest.raises(exc, match=match):
        open_store(tmp_path, identity=ident)
    assert not drive_file(tmp_path / "nvme0").exists()  # refused before anything was created
    encode_identity("é" * (MAX_IDENTITY_BYTES // 2))  # exactly 3000 bytes fit


# ------------------------------------------------------------------ reopening

def test_same_identity_reopens_and_serves_every_object(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    objs = sample_objects(9)
    with open_store(tmp_path, 3, identity=A) as store:
        assert store.identity == A
        infos = fill(store, objs)
    for d in drives(tmp_path, 3):
        assert superblock(d) == SuperBlock(PB, SLOTS, A)
    with open_store(tmp_path, 3, identity=A) as store:
        assert_serves(store, objs)
        assert all(store.info(k) == infos[k] for k in objs)
        c = store.counters()
        assert c["wiped_files"] == 0 and c["wiped_at_open"] == 0 and c["dropped_at_open"] == 0
    assert wipe_lines(caplog) == []


def test_other_identity_wipes_every_drive_file(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    objs = sample_objects(7)
    with open_store(tmp_path, 3, identity=A) as store:
        fill(store, objs)
    with open_store(tmp_path, 3, identity=B) as store:  # tp_size 1 -> 2: other bytes per page
        assert store.keys() == [] and store.free_parts == store.total_parts
        assert not any(store.contains(k) for k in objs)
        c = store.counters()
        assert c["wiped_files"] == 3 and c["wiped_at_open"] == len(objs) and c["dropped_at_open"] == 0
        lines = wipe_lines(caplog)
        assert len(lines) == 3
        for i, line in enumerate(sorted(lines)):
            assert f"nvme{i}" in line and repr(A) in line and repr(B) in line
            assert f"written for identity {A!r}" in line and f"this store is for identity {B!r}" in line
        assert sum(int(line.split("wiped (")[1].split(" ")[0]) for line in lines) >= len(objs)
        new = sample_objects(3, seed=50)
        fill(store, new)
    for d in drives(tmp_path, 3):
        assert superblock(d) == SuperBlock(PB, SLOTS, B)
        assert drive_file(d).stat().st_size == capacity(SLOTS)
    caplog.clear()
    with open_store(tmp_path, 3, identity=B) as store:  # now the files are B's: served, nothing wiped
        assert_serves(store, new)
        assert store.counters()["wiped_files"] == 0
    assert wipe_lines(caplog) == []
    with open_store(tmp_path, 3, identity=A) as store:  # and A no longer gets them either
        assert store.keys() == [] and store.counters()["wiped_at_open"] == len(new)


def test_version_1_file_is_served_without_identity_and_wiped_with_one(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    objs = sample_objects(5)
    with open_store(tmp_path, 2) as store:
        fill(store, objs)
    for d in drives(tmp_path, 2):
        write_v1_superblock(d, PB, SLOTS)
    with open_store(tmp_path, 2) as store:  # a file from before identities opens as it did
        assert_serves(store, objs)
        assert store.counters()["wiped_files"] == 0
    for d in drives(tmp_path, 2):
        assert superblock(d) == SuperBlock(PB, SLOTS, "")  # rewritten as version 2
        write_v1_superblock(d, PB, SLOTS)
    with open_store(tmp_path, 2, identity=A) as store:
        assert store.keys() == []
        c = store.counters()
        assert c["wiped_files"] == 2 and c["wiped_at_open"] == len(objs)
    lines = wipe_lines(caplog)
    assert len(lines) == 2
    assert all(f"written for no identity with part_bytes={PB}" in line and repr(A) in line for line in lines)


def test_version_1_file_of_other_part_bytes(tmp_path):
    with open_store(tmp_path, 1) as store:
        fill(store, sample_objects(2))
    write_v1_superblock(tmp_path / "nvme0", PB, SLOTS)
    with pytest.raises(StoreConfigError, match="part_bytes=16384.*part_bytes=32768"):  # as before identities
        open_store(tmp_path, 1, part_bytes=2 * PB)
    with open_store(tmp_path, 1, part_bytes=2 * PB, identity=A) as store:  # a cache: wiped, and it starts
        assert store.keys() == [] and store.counters()["wiped_at_open"] == 2
    assert superblock(tmp_path / "nvme0") == SuperBlock(2 * PB, SLOTS, A)


def test_same_identity_other_part_bytes_is_wiped(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with open_store(tmp_path, 2, identity=A) as store:
        fill(store, sample_objects(4))
    with open_store(tmp_path, 2, part_bytes=2 * PB, identity=A) as store:
        assert store.keys() == []
        assert store.counters()["wiped_files"] == 2 and store.counters()["wiped_at_open"] == 4
        objs = {b"big": payload(3 * PB, 9)}
        fill(store, objs)
    lines = wipe_lines(caplog)
    assert len(lines) == 2 and all(f"part_bytes={PB}" in line and f"part_bytes={2 * PB}" in line for line in lines)
    with open_store(tmp_path, 2, part_bytes=2 * PB, identity=A) as store:
        assert_serves(store, objs)


def test_store_without_identity_wipes_a_file_written_for_one(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with open_store(tmp_path, 1, identity=A) as store:
        fill(store, sample_objects(3))
    with open_store(tmp_path, 1) as store:
        assert store.identity == "" and store.keys() == []
        assert store.counters()["wiped_files"] == 1 and store.counters()["wiped_at_open"] == 3
    (line,) = wipe_lines(caplog)
    assert f"written for identity {A!r}" in line and "this store is for no identity" in line
    assert "3 object(s) dropped" in line
    assert superblock(tmp_path / "nvme0") == SuperBlock(PB, SLOTS, "")


def test_file_written_for_an_identity_of_other_part_bytes_is_wiped_without_identity(tmp_path):
    with open_store(tmp_path, 1, identity=A) as store:
        fill(store, sample_objects(2))
    with open_store(tmp_path, 1, part_bytes=2 * PB) as store:  # not ours whatever its geometry: no refusal
        assert store.keys() == [] and store.counters()["wiped_files"] == 1


def test_one_foreign_drive_file_serves_nothing_half(tmp_path, caplog):
    """Drive 0's file replaced by another identity's: objects with a part on it are gone whole (their
    parts on the other drives are dropped as incomplete), the others are served bit-exactly."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    objs = sample_objects(10)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with open_store(tmp_path / "a", 3, identity=A) as store:
        infos = fill(store, objs)
    foreign = sample_objects(4, seed=100)
    with open_store(tmp_path / "b", 3, identity=B) as store:
        foreign_infos = fill(store, foreign)
    shutil.copyfile(drive_file(tmp_path / "b" / "nvme0"), drive_file(tmp_path / "a" / "nvme0"))
    on_drive0 = {k for k, info in infos.items() if any(p.drive == 0 for p in info.parts)}
    striped = {k for k in on_drive0 if len(infos[k].parts) > 1}
    assert on_drive0 and striped and len(on_drive0) < len(objs)  # the test covers all three kinds
    with open_store(tmp_path / "a", 3, identity=A) as store:
        assert_serves(store, {k: v for k, v in objs.items() if k not in on_drive0})
        c = store.counters()
        assert c["wiped_files"] == 1
        assert c["wiped_at_open"] == sum(any(p.drive == 0 for p in i.parts) for i in foreign_infos.values())
        assert c["dropped_at_open"] == len(striped)  # their parts on drives 1 and 2
        assert store.free_parts == store.total_parts - sum(len(infos[k].parts) for k in objs if k not in on_drive0)
    (line,) = wipe_lines(caplog)
    assert "nvme0" in line and repr(B) in line and repr(A) in line
    with open_store(tmp_path / "a", 3, identity=A) as store:  # the leftovers were erased at that open
        c = store.counters()
        assert c["wiped_files"] == 0 and c["dropped_at_open"] == 0 and len(store.keys()) == len(objs) - len(on_drive0)


def test_corrupt_superblock_is_wiped_when_an_identity_is_given(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    objs = sample_objects(6)
    with open_store(tmp_path, 2, identity=A) as store:
        infos = fill(store, objs)
    flip_byte(drive_file(tmp_path / "nvme1"), 17)
    with pytest.raises(StoreConfigError, match="nvme1.*not a usable saria SSD store file.*checksum"):
        open_store(tmp_path, 2)  # without an identity: refused, as before identities, and nothing wiped
    assert wipe_lines(caplog) == []
    with open_store(tmp_path, 2, identity=A) as store:
        assert_serves(store, {k: v for k, v in objs.items() if all(p.drive == 0 for p in infos[k].parts)})
        c = store.counters()
        assert c["wiped_files"] == 1 and c["wiped_at_open"] == 0  # what it held is unknown
    (line,) = wipe_lines(caplog)
    assert "nvme1" in line and "unusable superblock: superblock checksum mismatch" in line
    assert "an unknown number of objects dropped" in line
    assert superblock(tmp_path / "nvme1") == SuperBlock(PB, SLOTS, A)
    # a file that is not a saria store at all (no saria superblock) is refused, never wiped
    # (docs/security.md, "Files on the box")
    drive_file(tmp_path / "nvme1").write_bytes(b"some other file" * 1000)
    with pytest.raises(StoreConfigError, match="nvme1.*is not a saria SSD store file.*not wiped"):
        open_store(tmp_path, 2, identity=A)
    assert drive_file(tmp_path / "nvme1").read_bytes() == b"some other file" * 1000
    assert len(wipe_lines(caplog)) == 1  # the first one's only


def test_blank_superblock_over_objects(tmp_path, caplog):
    """Committed headers under a zeroed superblock: nothing says what they were written for."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    objs = sample_objects(3)
    for ident, served in [("", True), (A, False)]:
        with open_store(tmp_path, 1, identity=ident) as store:
            fill(store, objs)
        with open(drive_file(tmp_path / "nvme0"), "r+b") as f:
            f.write(bytes(SUPERBLOCK_BYTES))
        caplog.clear()
        with open_store(tmp_path, 1, identity=ident) as store:
            if served:  # without an identity, as before identities
                assert_serves(store, objs)
                assert wipe_lines(caplog) == []
            else:
                assert store.keys() == [] and store.counters()["wiped_at_open"] == 3
                (line,) = wipe_lines(caplog)
                assert "unknown (blank superblock)" in line and "3 object(s) dropped" in line
            for k in objs:
                store.delete(k)


def test_blank_file_is_formatted_quietly(tmp_path, caplog):
    """A preallocated file whose superblock was never written (a crash at the first open) holds
    nothing: it is formatted, not reported as wiped."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    drives(tmp_path, 1)
    drive_file(tmp_path / "nvme0").write_bytes(bytes(capacity(SLOTS)))
    with open_store(tmp_path, 1, identity=A) as store:
        assert store.counters()["wiped_files"] == 0 and store.free_parts == SLOTS
    assert wipe_lines(caplog) == []
    assert superblock(tmp_path / "nvme0") == SuperBlock(PB, SLOTS, A)


def test_open_data_plane_passes_the_identity(tmp_path):
    caches = vllm_layers(16, 4, 2, 8, torch.bfloat16, layers=1, seed=0)
    table = PageTable(caches)
    cfg = SariaConfig.preset("full-duplicate", chunk=ChunkSpec(chunk_tokens=8, checkpoint_tokens=64),
                             dram=Capacity(nbytes=4 * 4096), ssd=Capacity(nbytes=1 << 20))
    cfg = sized_config(cfg, table, 4)
    data = open_data_plane(cfg, table, block_tokens=4, ssd_paths=[str(tmp_path)], ssd_identity=A)
    try:
        assert data.ssd.identity == A
    finally:
        data.close()
    assert superblock(tmp_path).identity == A


# ------------------------------------------------------------------ property

IDENTITIES = st.one_of(st.just(""), st.sampled_from([A, B]), st.text(max_size=24))


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=IDENTITIES, second=IDENTITIES, same=st.booleans(), n_drives=st.integers(1, 3),
       lengths=st.dictionaries(st.binary(min_size=1, max_size=8), st.integers(1, 3 * PB), max_size=6))
def test_reopen_serves_the_objects_iff_the_identities_are_equal(first, second, same, n_drives, lengths):
    second = first if same else second
    objs = {k: payload(n, i) for i, (k, n) in enumerate(lengths.items())}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with open_store(root, n_drives, identity=first) as store:
            fill(store, objs)
        with open_store(root, n_drives, identity=second) as store:
            c = store.counters()
            if first == second:
                assert_serves(store, objs)
                assert c["wiped_files"] == 0 and c["wiped_at_open"] == 0
            else:
                assert store.keys() == [] and store.free_parts == store.total_parts
                assert c["wiped_files"] == n_drives and c["wiped_at_open"] == len(objs)
            assert c["dropped_at_open"] == 0
        assert all(superblock(d).identity == second for d in drives(root, n_drives))

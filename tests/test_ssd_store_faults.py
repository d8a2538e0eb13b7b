"""SSD store faults on real files: injected ENOSPC / EIO / short transfers at the syscall layer,
bytes flipped on disk, truncated files, bad drive paths, and real crashes (SIGKILL) between the
data write and the commit marker. Each ends in a clear error at start-up or a counted miss at run
time; never wrong bytes delivered."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from saria.dataplane import (ObjectCorrupt, ObjectUnreadable, ObjectWriteError, SSDStore, StoreConfigError,
                             probe_direct_io)
from ssd_cases import PB, Fault, FaultyOps, capacity, drive_file, drives, flip_byte, geometry, is_header, \
    is_payload, payload, read_back

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
SLOTS = 8


def open_store(tmp_path, n_drives=2, **kw):
    kw.setdefault("read_threads", 4)
    return SSDStore(drives(tmp_path, n_drives), capacity(SLOTS), PB, **kw)


def assert_clean_reopen(tmp_path, expect: dict[bytes, torch.Tensor], n_drives=2):
    """Reopen: exactly ``expect`` is served, byte for byte, and every other slot is free."""
    with open_store(tmp_path, n_drives) as store:
        assert sorted(store.keys()) == sorted(expect)
        used = sum(len(store.info(k).parts) for k in expect)
        assert store.free_parts == store.total_parts - used
        for k, v in expect.items():
            assert torch.equal(read_back(store, k, v.numel()), v)
        return store.counters()


# ------------------------------------------------------------------ write faults

@pytest.mark.parametrize("fault, code", [
    (Fault("pwrite", when=lambda c: is_payload(c.offset), error=errno.ENOSPC), errno.ENOSPC),
    (Fault("pwrite", when=lambda c: is_payload(c.offset), error=errno.EIO), errno.EIO),
    (Fault("fdatasync", error=errno.EIO), errno.EIO),
    (Fault("pwrite", when=lambda c: is_header(c.offset) and c.data[:8] == b"SARIASLT", error=errno.EIO), errno.EIO),
    (Fault("pwrite", when=lambda c: is_header(c.offset) and c.data[:8] == b"SARIASLT", error=errno.ENOSPC,
           times=-1), errno.ENOSPC),
    (Fault("pwrite", when=lambda c: is_payload(c.offset), short=0, times=-1), errno.EIO),  # no progress
], ids=["payload-ENOSPC", "payload-EIO", "sync-EIO", "header-EIO", "all-headers-ENOSPC", "write-stalls"])
def test_failed_write_serves_nothing_and_frees_its_slots(tmp_path, fault, code):
    ops = FaultyOps()
    keep = payload(PB + 5, 1)
    with open_store(tmp_path, io_ops=ops) as store:
        store.write(b"keep", keep).result()
        ops.add(fault)
        fut = store.write(b"bad", payload(3 * PB + 9, 2))
        with pytest.raises(ObjectWriteError, match="writing object .* failed.*nothing of it is stored") as exc:
            fut.result(timeout=30)
        assert exc.value.errno == code
        assert fault.hits >= 1
        assert not store.contains(b"bad") and store.free_parts == store.total_parts - 2
        c = store.counters()
        assert c["write_failures"] == 1 and c["writes"] == 1
        assert c["io_errors"] >= 1 or c["short_writes"] >= 1
        ops.clear()
        store.write(b"after", payload(3 * PB, 3)).result()  # the freed slots are usable again
        assert torch.equal(read_back(store, b"after", 3 * PB), payload(3 * PB, 3))
    assert_clean_reopen(tmp_path, {b"keep": keep, b"after": payload(3 * PB, 3)})


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_short_writes_are_resumed(tmp_path, direct):
    if direct and not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    ops = FaultyOps()
    data = payload(2 * PB + 100, 4)
    with open_store(tmp_path, io_ops=ops, direct=direct) as store:
        f = ops.add(Fault("pwrite", when=lambda c: is_payload(c.offset) and c.length > 6000, short=6000, times=2))
        store.write(b"k", data).result()
        assert f.hits == 2
        c = store.counters()
        assert c["short_writes"] == 2 and c["retries"] == 2 and c["write_failures"] == 0
        assert torch.equal(read_back(store, b"k", data.numel()), data)
    assert_clean_reopen(tmp_path, {b"k": data})


# ------------------------------------------------------------------ read faults

@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_short_reads_are_resumed(tmp_path, direct):
    if direct and not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    ops = FaultyOps()
    data = payload(3 * PB + 100, 5)
    with open_store(tmp_path, io_ops=ops, direct=direct) as store:
        store.write(b"k", data).result()
        f = ops.add(Fault("pread", when=lambda c: is_payload(c.offset) and c.length > 5000, short=5000, times=3))
        assert torch.equal(read_back(store, b"k", data.numel()), data)
        assert f.hits == 3
        c = store.counters()
        assert c["short_reads"] == 3 and c["retries"] == 3 and c["read_failures"] == 0


@pytest.mark.parametrize("fault, exc_type", [
    (Fault("pread", when=lambda c: is_payload(c.offset), error=errno.EIO), ObjectUnreadable),
    (Fault("pread", when=lambda c: is_payload(c.offset), short=0), ObjectUnreadable),  # end of file
    (Fault("pread", when=lambda c: is_payload(c.offset) and c.length > 4096, short=100, times=-1),
     ObjectUnreadable),  # never completes (under O_DIRECT 100 bytes is no progress at all)
], ids=["EIO", "EOF", "stalls"])
def test_failed_read_is_a_counted_miss_and_drops_the_object(tmp_path, fault, exc_type):
    ops = FaultyOps()
    data, other = payload(3 * PB, 6), payload(PB, 7)
    with open_store(tmp_path, io_ops=ops) as store:
        store.write(b"k", data).result()
        store.write(b"other", other).result()
        ops.add(fault)
        out = torch.zeros(3 * PB, dtype=torch.uint8)
        with pytest.raises(exc_type, match="object .* part .* unreadable") as exc:
            store.read(b"k", out).result(timeout=30)
        assert exc.value.errno == errno.EIO
        ops.clear()
        assert not store.contains(b"k")
        assert store.free_parts == store.total_parts - 1
        c = store.counters()
        assert c["read_failures"] == 1 and c["reads"] == 0
        assert c["io_errors"] + c["short_reads"] >= 1
        assert torch.equal(read_back(store, b"other", PB), other)
    assert_clean_reopen(tmp_path, {b"other": other})  # the dropped copy does not come back


def test_flipped_payload_byte_is_detected_and_dropped(tmp_path):
    data, other = payload(2 * PB + 3, 8), payload(PB, 9)
    with open_store(tmp_path) as store:
        info = store.write(b"k", data).result()
        store.write(b"other", other).result()
    part = info.parts[1]
    flip_byte(drive_file(tmp_path / f"nvme{part.drive}"), geometry(SLOTS).payload_offset(part.slot) + 1234)
    with open_store(tmp_path) as store:
        assert store.contains(b"k")  # headers are intact: the damage shows on read
        out = torch.zeros(data.numel(), dtype=torch.uint8)
        with pytest.raises(ObjectCorrupt, match="part 1 .* does not match its checksum"):
            store.read(b"k", out).result(timeout=30)
        c = store.counters()
        assert c["verification_failures"] == 1 and c["read_failures"] == 1
        assert not store.contains(b"k")
        assert torch.equal(read_back(store, b"other", PB), other)
    assert_clean_reopen(tmp_path, {b"other": other})


@pytest.mark.parametrize("part_index, header_offset", [(0, 70), (2, 3), (1, 130)],
                         ids=["part0-key", "part2-magic", "part1-checksum"])
def test_flipped_header_byte_drops_the_object_at_open(tmp_path, part_index, header_offset):
    data, other = payload(3 * PB, 10), payload(PB, 11)
    with open_store(tmp_path) as store:
        info = store.write(b"k", data).result()
        store.write(b"other", other).result()
    part = info.parts[part_index]
    flip_byte(drive_file(tmp_path / f"nvme{part.drive}"), geometry(SLOTS).header_offset(part.slot) + header_offset)
    with open_store(tmp_path) as store:
        c = store.counters()
        assert c["corrupt_headers"] == 1 and c["dropped_at_open"] == 1  # the other two parts' group
        assert store.keys() == [b"other"] and store.free_parts == store.total_parts - 1
    c = assert_clean_reopen(tmp_path, {b"other": other})
    assert c["corrupt_headers"] == 0 and c["dropped_at_open"] == 0  # erased at the first open


def test_flipped_header_of_a_one_part_object(tmp_path):
    with open_store(tmp_path) as store:
        info = store.write(b"k", payload(100, 12)).result()
    p = info.parts[0]
    flip_byte(drive_file(tmp_path / f"nvme{p.drive}"), geometry(SLOTS).header_offset(p.slot) + 40)
    with open_store(tmp_path) as store:
        assert store.keys() == [] and store.free_parts == store.total_parts
        assert store.counters()["corrupt_headers"] == 1


def test_unreadable_header_at_open_drops_its_object(tmp_path):
    data, other = payload(3 * PB, 13), payload(PB, 14)
    with open_store(tmp_path) as store:
        info = store.write(b"k", data).result()
        store.write(b"other", other).result()
    p = info.parts[1]
    bad = geometry(SLOTS).header_offset(p.slot)
    ops = FaultyOps()
    ops.add(Fault("pread", when=lambda c: c.offset == bad and c.path.endswith(f"nvme{p.drive}/saria-ssd-store.bin"),
                  error=errno.EIO))
    with open_store(tmp_path, io_ops=ops) as store:
        c = store.counters()
        assert c["io_errors"] == 1 and c["corrupt_headers"] == 1 and c["dropped_at_open"] == 1
        assert store.keys() == [b"other"] and store.free_parts == store.total_parts - 1
    assert_clean_reopen(tmp_path, {b"other": other})


def test_unreadable_superblock_is_a_start_up_error(tmp_path):
    with open_store(tmp_path) as store:
        store.write(b"k", payload(10, 1)).result()
    ops = FaultyOps()
    ops.add(Fault("pread", when=lambda c: c.offset == 0 and c.path.endswith("nvme1/saria-ssd-store.bin"),
                  error=errno.EIO))
    with pytest.raises(StoreConfigError, match="start-up failed.*Input/output error"):
        open_store(tmp_path, io_ops=ops)
    assert_clean_reopen(tmp_path, {b"k": payload(10, 1)})


def test_corrupt_superblock_is_refused_at_start_up(tmp_path):
    with open_store(tmp_path) as store:
        store.write(b"k", payload(100, 12)).result()
    flip_byte(drive_file(tmp_path / "nvme1"), 17)
    with pytest.raises(StoreConfigError, match="nvme1.*not a usable saria SSD store file.*checksum"):
        open_store(tmp_path)
    drive_file(tmp_path / "nvme1").write_bytes(b"some other file" * 1000)
    with pytest.raises(StoreConfigError, match="no saria superblock"):
        open_store(tmp_path)


def test_truncated_drive_file(tmp_path):
    with open_store(tmp_path, n_drives=1) as store:
        objs = {bytes([i]): payload(PB + 1 + i, 20 + i) for i in range(4)}  # 2 parts each: slots 0..7
        infos = {k: store.write(k, v).result() for k, v in objs.items()}
    g = geometry(SLOTS)
    path = drive_file(tmp_path / "nvme0")
    cut = g.payload_offset(5) + 100  # slot 5 keeps its header but loses most of its payload
    os.truncate(path, cut)
    with open_store(tmp_path, n_drives=1) as store:
        survivors = {k for k, info in infos.items() if all(p.slot < 5 for p in info.parts)}
        assert set(store.keys()) == survivors and len(survivors) == 2
        c = store.counters()
        # the object in slots 4-5 is seen half there and dropped; the one in 6-7 is gone without a
        # trace except the superblock's slot count
        assert c["dropped_at_open"] == 1 and c["truncated_slots"] == 3
        assert path.stat().st_size == g.file_bytes  # re-extended
        assert store.free_parts == store.total_parts - 4
        for k in survivors:
            assert torch.equal(read_back(store, k, objs[k].numel()), objs[k])
    c = assert_clean_reopen(tmp_path, {k: objs[k] for k in survivors}, n_drives=1)
    assert c["dropped_at_open"] == 0 and c["corrupt_headers"] == 0


def test_file_shorter_than_a_superblock_starts_empty(tmp_path):
    drives(tmp_path, 2)
    drive_file(tmp_path / "nvme0").write_bytes(b"\0" * 100)
    with open_store(tmp_path) as store:
        assert store.keys() == [] and store.free_parts == store.total_parts


# ------------------------------------------------------------------ start-up errors

def test_missing_drive_path(tmp_path):
    (tmp_path / "nvme0").mkdir()
    with pytest.raises(StoreConfigError, match="nvme9.* does not exist"):
        SSDStore([tmp_path / "nvme0", tmp_path / "nvme9"], capacity(4), PB)
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(StoreConfigError, match="plain is not a directory"):
        SSDStore([tmp_path / "nvme0", tmp_path / "plain"], capacity(4), PB)
    with SSDStore([tmp_path / "nvme0"], capacity(4), PB) as store:  # the failed starts left it usable
        assert store.free_parts == 4


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("direct", ["auto", False])
def test_unwritable_drive_path(tmp_path, direct):
    d = drives(tmp_path, 1)[0]
    d.chmod(0o500)
    try:
        with pytest.raises(StoreConfigError, match="Permission denied"):
            SSDStore([d], capacity(4), PB, direct=direct)
    finally:
        d.chmod(0o700)


@pytest.mark.parametrize("direct", ["auto", False])
def test_drive_path_refusing_file_creation(tmp_path, direct):
    ops = FaultyOps()
    ops.add(Fault("open", error=errno.EACCES, times=-1))
    with pytest.raises(StoreConfigError, match="Permission denied"):
        open_store(tmp_path, io_ops=ops, direct=direct)
    d = drives(tmp_path, 1)[0]
    d.joinpath("saria-ssd-store.bin").mkdir()
    with pytest.raises(StoreConfigError, match="cannot open .*saria-ssd-store.bin"):
        SSDStore([d], capacity(4), PB)


def test_impossible_preallocation_is_refused_at_start_up(tmp_path):
    with pytest.raises(StoreConfigError, match="cannot preallocate .* bytes for .*nvme0"):
        SSDStore(drives(tmp_path, 1), 1 << 52, PB)  # 4 PiB
    assert not drive_file(tmp_path / "nvme0").exists()
    ops = FaultyOps()
    ops.add(Fault("fallocate", error=errno.ENOSPC))
    with pytest.raises(StoreConfigError, match="cannot preallocate .*No space left on device.*errno 28"):
        SSDStore(drives(tmp_path, 1), capacity(SLOTS), PB, io_ops=ops)
    assert not drive_file(tmp_path / "nvme0").exists()
    ops = FaultyOps()
    ops.add(Fault("fallocate", error=errno.EFBIG))
    with pytest.raises(StoreConfigError, match="cannot preallocate .*errno 27"):
        SSDStore(drives(tmp_path, 1), capacity(SLOTS), PB, io_ops=ops)
    with SSDStore(drives(tmp_path, 1), capacity(SLOTS), PB) as store:  # nothing was left behind
        assert store.free_parts == SLOTS


# ------------------------------------------------------------------ real crashes

CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from saria.dataplane import SSDStore
    from ssd_cases import PB, Fault, FaultyOps, capacity, drives, is_header, payload
    from pathlib import Path

    def die(call):
        os.kill(os.getpid(), signal.SIGKILL)

    ops = FaultyOps()
    store = SSDStore(drives(Path({tmp!r}), 2), capacity({slots}), PB, io_ops=ops)
    store.write(b"kept", payload(2 * PB + 1, 1)).result()
    store.write(b"victim", payload(PB, 2)).result()
    {arm}
    store.write({key!r}, payload(3 * PB + 7, 3)).result()
    print("not killed")
""")

ARMS = {
    # payloads written and synced, no header written yet
    "before-headers": 'ops.add(Fault("fdatasync", then=die))',
    # the first of three committed headers is on disk, the others are not
    "between-headers": 'ops.add(Fault("pwrite", when=lambda c: is_header(c.offset) and c.data[:8] == b"SARIASLT", '
                       'then=die))',
    # the new generation is committed; the old one's headers are not erased yet
    "before-erasing-old": 'ops.add(Fault("pwrite", when=lambda c: is_header(c.offset) and c.data[:8] == bytes(8), '
                          'before=die))',
}


@pytest.mark.parametrize("point, key", [("before-headers", b"new"), ("between-headers", b"new"),
                                        ("before-erasing-old", b"victim")])
def test_crash_between_data_and_commit_marker(tmp_path, point, key):
    code = CHILD.format(tests=str(TESTS), tmp=str(tmp_path), slots=SLOTS, arm=ARMS[point], key=key)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    expect = {b"kept": payload(2 * PB + 1, 1), b"victim": payload(PB, 2)}
    if point == "before-erasing-old":
        expect[b"victim"] = payload(3 * PB + 7, 3)  # the newer generation wins
    c = assert_clean_reopen(tmp_path, expect)
    assert c["dropped_at_open"] == {"before-headers": 0, "between-headers": 1, "before-erasing-old": 1}[point]

"""SSD store on real files in a temp dir: round trips, striping, restart, overwrite, delete, store
full, bad input, O_DIRECT and buffered modes, backend selection, read pins, concurrency."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from saria.dataplane import (ObjectNotFound, SSDStore, StoreClosed, StoreConfigError, StoreFull,
                             probe_direct_io)
from saria.dataplane.ssd.files import O_DIRECT
from saria.kernels import checksum_naive
from ssd_cases import PB, Fault, FaultyOps, capacity, drive_file, drives, is_payload, payload

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


def open_store(tmp_path, n_drives=1, slots=16, **kw):
    kw.setdefault("read_threads", 4)
    return SSDStore(drives(tmp_path, n_drives), capacity(slots), PB, **kw)


def read_back(store, key, length, device="cpu"):
    out = torch.zeros(length, dtype=torch.uint8, device=device)
    store.read(key, out).result(timeout=30)
    return out.cpu()


# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("n_drives", [1, 3], ids=["1drive", "3drives"])
@pytest.mark.parametrize("length", [
    pytest.param(1, id="1byte"),
    pytest.param(PB - 1, id="part-minus-1"),
    pytest.param(PB, id="one-part"),
    pytest.param(5 * PB, id="5parts"),
    pytest.param(3 * PB + 4097, id="last-part-partial"),
])
def test_round_trip(tmp_path, n_drives, length):
    data = payload(length, seed=length)
    with open_store(tmp_path, n_drives) as store:
        info = store.write(b"chunk:kv", data).result(timeout=30)
        n_parts = -(-length // PB)
        assert info.length == length and len(info.parts) == n_parts
        assert [p.length for p in info.parts] == [PB] * (n_parts - 1) + [length - (n_parts - 1) * PB]
        assert [p.checksum for p in info.parts] == [checksum_naive(t) for t in data.split(PB)]
        assert store.free_parts == store.total_parts - n_parts
        out = torch.full((length + 100,), 0xAB, dtype=torch.uint8)
        assert store.read(b"chunk:kv", out).result(timeout=30) == info
        assert torch.equal(out[:length], data)
        assert bool((out[length:] == 0xAB).all()), "bytes past the object must not be touched"
        c = store.counters()
        assert c["reads"] == 1 and c["writes"] == 1
        assert sum(p["write_bytes"] for p in c["paths"].values()) >= length
        assert sum(p["read_bytes"] for p in c["paths"].values()) >= length


def test_parts_are_striped_across_drives(tmp_path):
    with open_store(tmp_path, 3) as store:
        a = store.write(b"a", payload(3 * PB, 1)).result()
        b = store.write(b"b", payload(2 * PB, 2)).result()
        assert sorted(p.drive for p in a.parts) == [0, 1, 2]
        assert [p.drive for p in b.parts] == [0, 1]  # the stripe continues where a ended
        assert len({p.drive for p in b.parts}) == 2


def test_full_drive_spills_parts_to_other_drives(tmp_path):
    with open_store(tmp_path, 2, slots=2) as store:
        store.write(b"a", payload(3 * PB, 1)).result()  # drive 0 gets 2 parts, drive 1 one
        info = store.write(b"b", payload(PB, 2)).result()
        assert info.parts[0].drive == 1 and store.free_parts == 0


def test_list_of_parts_in_and_out_with_given_checksums(tmp_path):
    parts = [payload(PB, 10), payload(PB, 11), payload(999, 12)]
    sums = [checksum_naive(p) for p in parts]
    with open_store(tmp_path, 2) as store:
        info = store.write(b"slots", parts, checksums=sums).result()
        assert [p.checksum for p in info.parts] == sums
        outs = [torch.zeros(PB, dtype=torch.uint8) for _ in range(3)]
        store.read(b"slots", outs).result()
        for p, o in zip(parts, outs):
            assert torch.equal(o[:p.numel()], p)
        assert bool((outs[2][999:] == 0).all())


def test_wrong_given_checksum_is_caught_on_read(tmp_path):
    data = payload(PB, 3)
    with open_store(tmp_path) as store:
        store.write(b"k", data, checksums=[checksum_naive(data) ^ 1]).result()
        with pytest.raises(Exception) as exc:
            store.read(b"k", torch.zeros(PB, dtype=torch.uint8)).result()
        assert type(exc.value).__name__ == "ObjectCorrupt"
        assert not store.contains(b"k")


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_unaligned_and_multidim_buffers(tmp_path, direct):
    if direct and not probe_direct_io(tmp_path):
        pytest.skip("tmp_path's filesystem refuses O_DIRECT")
    backing = payload(2 * PB + 5000 + 3, 4)
    data = backing[3:]  # address not 4 KiB aligned: goes through the bounce buffer
    assert data.data_ptr() % 4096
    with open_store(tmp_path, 2, direct=direct) as store:
        assert store.direct_io is direct
        store.write(b"u", data).result()
        store.write(b"m", data[:4 * 4096].view(4, 4096)).result()  # any contiguous shape is bytes
        out = torch.zeros(data.numel() + 7, dtype=torch.uint8)
        store.read(b"u", out[7:]).result()
        assert torch.equal(out[7:], data)
        out2 = torch.zeros(4, 4096, dtype=torch.uint8)
        store.read(b"m", out2).result()
        assert torch.equal(out2.view(-1), data[:4 * 4096])


# ------------------------------------------------------------------ O_DIRECT and buffered modes

def test_o_direct_used_where_the_filesystem_allows_it(tmp_path):
    ops = FaultyOps()
    with open_store(tmp_path, 2, io_ops=ops) as store:
        store.write(b"k", payload(PB + 10, 5)).result()
        assert torch.equal(read_back(store, b"k", PB + 10), payload(PB + 10, 5))
        expected = probe_direct_io(tmp_path)
        assert store.direct_io is expected
        opens = [c for c in ops.calls if c.op == "open" and c.path.endswith("saria-ssd-store.bin")]
        assert len(opens) == 2 and all(bool(c.flags & O_DIRECT) is expected for c in opens)


def test_buffered_when_asked(tmp_path):
    ops = FaultyOps()
    with open_store(tmp_path, 2, direct=False, io_ops=ops) as store:
        assert store.direct_io is False
        store.write(b"k", payload(PB + 10, 5)).result()
        assert torch.equal(read_back(store, b"k", PB + 10), payload(PB + 10, 5))
    assert not any(c.flags & O_DIRECT for c in ops.calls if c.op == "open")


def refuse_o_direct(ops: FaultyOps) -> None:
    ops.add(Fault("open", when=lambda c: bool(c.flags & O_DIRECT), error=errno.EINVAL, times=-1))


def test_buffered_fallback_where_o_direct_is_refused(tmp_path):
    ops = FaultyOps()
    refuse_o_direct(ops)
    assert probe_direct_io(tmp_path, ops) is False
    with open_store(tmp_path, 2, io_ops=ops) as store:
        assert store.direct_io is False
        store.write(b"k", payload(3 * PB + 1, 6)).result()
        assert torch.equal(read_back(store, b"k", 3 * PB + 1), payload(3 * PB + 1, 6))
    with pytest.raises(StoreConfigError, match="refuses O_DIRECT"):
        open_store(tmp_path, 2, io_ops=ops, direct=True)
    with open_store(tmp_path, 2) as store:  # the same files, now opened O_DIRECT again where possible
        assert torch.equal(read_back(store, b"k", 3 * PB + 1), payload(3 * PB + 1, 6))


def test_probe_direct_io_on_a_missing_directory(tmp_path):
    with pytest.raises(OSError):
        probe_direct_io(tmp_path / "nope")
    assert not list(tmp_path.iterdir()), "the probe leaves no file behind"
    probe_direct_io(tmp_path)
    assert not list(tmp_path.iterdir())


def test_doctor_reports_o_direct(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "doctor", "--json", "--ssd-path", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    ssd = json.loads(proc.stdout)["ssd"]
    assert ssd["path"] == str(tmp_path) and ssd["o_direct"] is probe_direct_io(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "doctor", "--ssd-path", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0 and "ssd O_DIRECT" in proc.stdout and "not usable" in proc.stdout


# ------------------------------------------------------------------ backends

@pytest.mark.skipif(CUDA, reason="checks the machine without CUDA")
def test_kvikio_backend_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(StoreConfigError, match="kvikio.*needs CUDA"):
        open_store(tmp_path, backend="kvikio")
    with open_store(tmp_path, backend="auto") as store:  # the same paths open fine afterwards
        assert store.backend_name == "posix"
    with pytest.raises(ValueError, match="backend must be one of"):
        open_store(tmp_path, backend="gds")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["posix", "auto"])
def test_cuda_round_trip(tmp_path, backend):
    data = payload(3 * PB + 77, 7).cuda()
    with open_store(tmp_path, 2, backend=backend) as store:
        store.write(b"g", data).result()
        out = torch.zeros(3 * PB + 77, dtype=torch.uint8, device="cuda")
        store.read(b"g", out).result()
        assert torch.equal(out, data)
        host = torch.zeros(3 * PB + 77, dtype=torch.uint8)
        store.read(b"g", host).result()
        assert torch.equal(host, data.cpu())


# ------------------------------------------------------------------ restart, overwrite, delete

def test_restart_serves_the_same_objects(tmp_path):
    objs = {f"obj{i}".encode(): payload(i * 7001 + 1, 100 + i) for i in range(7)}
    with open_store(tmp_path, 3, slots=8) as store:
        infos = {k: store.write(k, v).result() for k, v in objs.items()}
        free = store.free_parts
    with open_store(tmp_path, 3, slots=8) as store:
        assert sorted(store.keys()) == sorted(objs)
        assert store.free_parts == free
        assert store.counters()["dropped_at_open"] == 0
        for k, v in objs.items():
            assert store.info(k) == infos[k]
            assert torch.equal(read_back(store, k, v.numel()), v)
        newer = store.write(b"obj0", payload(10, 1)).result()
        assert newer.generation > max(i.generation for i in infos.values())


def test_overwrite_serves_the_newest_and_frees_the_old(tmp_path):
    with open_store(tmp_path, 2) as store:
        store.write(b"k", payload(3 * PB, 1)).result()
        store.write(b"k", payload(PB + 1, 2)).result()
        assert store.free_parts == store.total_parts - 2
        assert torch.equal(read_back(store, b"k", PB + 1), payload(PB + 1, 2))
    with open_store(tmp_path, 2) as store:
        assert store.info(b"k").length == PB + 1 and store.free_parts == store.total_parts - 2
        assert store.counters()["dropped_at_open"] == 0  # the old copy's headers were erased


def test_delete(tmp_path):
    with open_store(tmp_path, 2) as store:
        store.write(b"k", payload(2 * PB, 1)).result()
        store.write(b"keep", payload(10, 2)).result()
        assert store.delete(b"k") is True
        assert store.delete(b"k") is False
        assert not store.contains(b"k") and store.info(b"k") is None
        with pytest.raises(ObjectNotFound, match="no object"):
            store.read(b"k", torch.zeros(2 * PB, dtype=torch.uint8))
        assert store.free_parts == store.total_parts - 1
    with open_store(tmp_path, 2) as store:
        assert store.keys() == [b"keep"] and store.free_parts == store.total_parts - 1


def test_capacity_can_grow_and_shrink_between_runs(tmp_path):
    with open_store(tmp_path, 1, slots=4) as store:
        for i in range(4):
            store.write(bytes([i]), payload(PB, i)).result()
        slots = {bytes([i]): store.info(bytes([i])).parts[0].slot for i in range(4)}
    with open_store(tmp_path, 1, slots=6) as store:
        assert store.total_parts == 6 and store.free_parts == 2 and len(store.keys()) == 4
    with open_store(tmp_path, 1, slots=2) as store:
        kept = {k for k, s in slots.items() if s < 2}
        assert set(store.keys()) == kept and store.counters()["dropped_at_open"] == 2
        for k in kept:
            assert torch.equal(read_back(store, k, PB), payload(PB, k[0]))
    assert drive_file(tmp_path / "nvme0").stat().st_size == capacity(2)


# ------------------------------------------------------------------ refusals and bad input

def test_store_full_is_refused_at_once_and_changes_nothing(tmp_path):
    with open_store(tmp_path, 2, slots=2) as store:
        store.write(b"a", payload(3 * PB, 1)).result()
        with pytest.raises(StoreFull, match="needs 2 free slot"):
            store.write(b"b", payload(2 * PB, 2))
        with pytest.raises(StoreFull):
            store.write(b"huge", payload(5 * PB, 2))
        assert store.keys() == [b"a"] and store.free_parts == 1
        assert store.counters()["store_full"] == 2
        store.write(b"b", payload(PB, 2)).result()
        store.delete(b"a")
        store.write(b"c", payload(3 * PB, 3)).result()
        assert torch.equal(read_back(store, b"c", 3 * PB), payload(3 * PB, 3))


@pytest.mark.parametrize("call, exc, match", [
    (lambda s: s.write("str", payload(4, 0)), TypeError, "key must be bytes"),
    (lambda s: s.write(b"", payload(4, 0)), ValueError, "1..64"),
    (lambda s: s.write(b"x" * 65, payload(4, 0)), ValueError, "1..64"),
    (lambda s: s.write(b"k", torch.zeros(4)), ValueError, "uint8"),
    (lambda s: s.write(b"k", payload(64, 0).view(8, 8).t()), ValueError, "contiguous"),
    (lambda s: s.write(b"k", payload(0, 0)), ValueError, "at least one byte"),
    (lambda s: s.write(b"k", []), ValueError, "empty list"),
    (lambda s: s.write(b"k", [payload(10, 0), payload(10, 0)]), ValueError, "every part but the last"),
    (lambda s: s.write(b"k", [payload(PB + 1, 0)]), ValueError, "every part but the last"),
    (lambda s: s.write(b"k", b"bytes"), TypeError, "uint8 tensor"),
    (lambda s: s.write(b"k", payload(4, 0), checksums=[1, 2]), ValueError, "checksums"),
    (lambda s: s.write(b"k", payload(4, 0), checksums=[-1]), ValueError, "checksums"),
    (lambda s: s.read(b"there", torch.zeros(9, dtype=torch.uint8)), ValueError, "out has 9 bytes"),
    (lambda s: s.read(b"there", torch.zeros(PB + 10)), ValueError, "uint8"),
    (lambda s: s.read(b"there", torch.zeros(2, PB, dtype=torch.uint8).t()), ValueError, "contiguous"),
    (lambda s: s.read(b"there", [torch.zeros(PB, dtype=torch.uint8)]), ValueError, "2 parts"),
    (lambda s: s.read(b"there", [torch.zeros(PB, dtype=torch.uint8)] * 2 + [None]), ValueError, "3 tensors"),
    (lambda s: s.read(b"there", [torch.zeros(PB, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8)]),
     ValueError, "out\\[1\\] has 9 bytes"),
    (lambda s: s.read(b"there", "buffer"), TypeError, "uint8 tensor"),
    (lambda s: s.read(b"missing", torch.zeros(1, dtype=torch.uint8)), ObjectNotFound, "no object"),
])
def test_bad_input_is_refused_before_anything_changes(tmp_path, call, exc, match):
    with open_store(tmp_path, 2) as store:
        store.write(b"there", payload(PB + 10, 1)).result()
        free = store.free_parts
        with pytest.raises(exc, match=match):
            call(store)
        assert store.keys() == [b"there"] and store.free_parts == free
        assert torch.equal(read_back(store, b"there", PB + 10), payload(PB + 10, 1))  # read pins released


@pytest.mark.parametrize("kwargs, match", [
    (dict(part_bytes=1000), "multiple of 4096"),
    (dict(part_bytes=0), "multiple of 4096"),
    (dict(capacity=8192), "holds no slot"),
    (dict(direct="yes"), "direct must be"),
    (dict(read_threads=0), "read_threads"),
])
def test_bad_constructor_arguments(tmp_path, kwargs, match):
    pb = kwargs.pop("part_bytes", PB)
    cap = kwargs.pop("capacity", capacity(4, pb if pb > 0 else PB))
    with pytest.raises(ValueError, match=match):
        SSDStore([tmp_path], cap, pb, **kwargs)


def test_paths_must_be_a_list_of_distinct_directories(tmp_path):
    with pytest.raises(ValueError, match="non-empty list"):
        SSDStore(str(tmp_path), capacity(4), PB)
    with pytest.raises(ValueError, match="non-empty list"):
        SSDStore([], capacity(4), PB)
    with pytest.raises(ValueError, match="distinct"):
        SSDStore([tmp_path, tmp_path / "." ], capacity(4), PB)


def test_one_store_per_drive_file(tmp_path):
    with open_store(tmp_path, 2):
        with pytest.raises(StoreConfigError, match="in use by another SSD store"):
            open_store(tmp_path, 2)
    with open_store(tmp_path, 2):  # the lock went with the first store
        pass


def test_reopen_with_other_part_bytes_is_refused(tmp_path):
    with open_store(tmp_path, 1) as store:
        store.write(b"k", payload(10, 1)).result()
    with pytest.raises(StoreConfigError, match="part_bytes=16384.*part_bytes=32768"):
        SSDStore(drives(tmp_path, 1), capacity(16, 2 * PB), 2 * PB)
    with open_store(tmp_path, 1) as store:
        assert store.contains(b"k")


def test_closed_store_refuses_new_work(tmp_path):
    store = open_store(tmp_path)
    fut = store.write(b"k", payload(10, 1))
    store.close()
    assert fut.done() and fut.result().length == 10  # close waits for writes in flight
    store.close()
    for call in (lambda: store.write(b"k", payload(1, 1)), lambda: store.read(b"k", torch.zeros(10, dtype=torch.uint8)),
                 lambda: store.delete(b"k")):
        with pytest.raises(StoreClosed):
            call()


# ------------------------------------------------------------------ pins, overtaken writes, concurrency

def gate_payload_reads(ops: FaultyOps) -> tuple[threading.Event, threading.Event]:
    """Block the next payload read until the returned ``release`` is set; ``entered`` says it began."""
    release, entered = threading.Event(), threading.Event()
    ops.add(Fault("pread", when=lambda c: is_payload(c.offset), gate=release, before=lambda c: entered.set()))
    return release, entered


def test_delete_waits_for_readers_before_reusing_slots(tmp_path):
    ops = FaultyOps()
    old = payload(PB, 1)
    with open_store(tmp_path, 1, slots=1, io_ops=ops) as store:
        store.write(b"k", old).result()
        release, entered = gate_payload_reads(ops)
        out = torch.zeros(PB, dtype=torch.uint8)
        fut = store.read(b"k", out)
        assert entered.wait(10)
        assert store.delete(b"k")
        assert not store.contains(b"k")
        with pytest.raises(StoreFull):  # the only slot is still being read
            store.write(b"new", payload(PB, 2))
        release.set()
        assert fut.result(timeout=10).key == b"k"
        assert torch.equal(out, old)
        assert store.free_parts == 1
        store.write(b"new", payload(PB, 2)).result()
        assert torch.equal(read_back(store, b"new", PB), payload(PB, 2))


def test_overwrite_while_reading_delivers_the_old_bytes_whole(tmp_path):
    ops = FaultyOps()
    with open_store(tmp_path, 1, slots=4, io_ops=ops) as store:
        store.write(b"k", payload(2 * PB, 1)).result()
        release, entered = gate_payload_reads(ops)
        out = torch.zeros(2 * PB, dtype=torch.uint8)
        fut = store.read(b"k", out)
        assert entered.wait(10)
        store.write(b"k", payload(2 * PB, 2)).result()
        assert store.free_parts == 0  # old slots stay pinned
        release.set()
        fut.result(timeout=10)
        assert torch.equal(out, payload(2 * PB, 1))
        assert store.free_parts == 2
        assert torch.equal(read_back(store, b"k", 2 * PB), payload(2 * PB, 2))


def test_overtaken_writes_resolve_to_none(tmp_path):
    ops = FaultyOps()
    with open_store(tmp_path, 2, io_ops=ops, write_threads=2) as store:
        release, entered = threading.Event(), threading.Event()
        ops.add(Fault("pwrite", when=lambda c: is_payload(c.offset), gate=release, before=lambda c: entered.set()))
        slow = store.write(b"k", payload(PB, 1))  # generation g, held in its payload write
        assert entered.wait(10)
        fast = store.write(b"k", payload(PB, 2)).result(timeout=10)  # generation g + 1 commits first
        release.set()
        assert slow.result(timeout=10) is None
        assert store.info(b"k") == fast
        assert torch.equal(read_back(store, b"k", PB), payload(PB, 2))

        release2, entered2 = threading.Event(), threading.Event()
        ops.add(Fault("pwrite", when=lambda c: is_payload(c.offset), gate=release2, before=lambda c: entered2.set()))
        doomed = store.write(b"k", payload(PB, 3))
        assert entered2.wait(10)
        assert store.delete(b"k") is True
        release2.set()
        assert doomed.result(timeout=10) is None
        assert not store.contains(b"k") and store.free_parts == store.total_parts
    with open_store(tmp_path, 2) as store:
        assert store.keys() == [] and store.free_parts == store.total_parts


def test_many_threads_writing_and_reading(tmp_path):
    """Writers overwrite and delete a few shared keys and write their own; readers read everything.
    Every delivered object is checked byte for byte against the version it says it is."""
    keys = [f"shared{i}".encode() for i in range(3)] + [f"own{i}".encode() for i in range(6)]

    def version_bytes(key: bytes, version: int) -> torch.Tensor:
        n = 100 + (version * 7919 + len(key) * 31) % (3 * PB)
        data = payload(n, hash((key, version)) % 2**31)
        data[:4] = torch.tensor(list(version.to_bytes(4, "little")), dtype=torch.uint8)
        return data

    errors: list[str] = []
    delivered = [0]
    writers_done = threading.Event()
    with open_store(tmp_path, 3, slots=40, read_threads=4, write_threads=2) as store:
        def writer(w: int) -> None:
            for j in range(10):
                key = keys[(w + j) % 3] if j % 2 else keys[3 + w]
                version = w * 1000 + j + 1
                if j % 5 == 4:
                    store.delete(key)
                    continue
                try:
                    store.write(key, version_bytes(key, version)).result(timeout=60)
                except StoreFull:
                    time.sleep(0.01)

        def reader(r: int) -> None:
            j = 0
            while not writers_done.is_set() or j < len(keys):
                j += 1
                key = keys[(r + j) % len(keys)]
                out = torch.zeros(3 * PB, dtype=torch.uint8)
                try:
                    info = store.read(key, out).result(timeout=60)
                except ObjectNotFound:
                    continue
                version = int.from_bytes(bytes(out[:4].tolist()), "little")
                if not torch.equal(out[:info.length], version_bytes(key, version)):
                    errors.append(f"{key!r} v{version}: wrong bytes")
                delivered[0] += 1

        with ThreadPoolExecutor(8) as pool:
            readers = [pool.submit(reader, r) for r in range(5)]
            for f in [pool.submit(writer, w) for w in range(3)]:
                f.result(timeout=120)
            writers_done.set()
            for f in readers:
                f.result(timeout=120)
        c = store.counters()
        assert not errors, errors
        assert delivered[0] > 20, delivered
        assert c["read_failures"] == 0 and c["verification_failures"] == 0
        live = sum(len(store.info(k).parts) for k in store.keys())
        assert store.free_parts == store.total_parts - live  # no slot leaked

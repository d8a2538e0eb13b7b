"""SSD store misuse on real files: a caller's argument mistakes (destinations that overlap each
other or memory in flight, expanded or read-only destinations) are refused before any I/O and never
cost a healthy object; a drive directory is locked against a second store (in this process or
another); a drive file deleted or replaced while the store is open takes that drive out of service
with one log line, never a write reported durable into a file that is gone."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from saria.dataplane import DriveLost, ObjectNotFound, ObjectWriteError, SSDStore, StoreConfigError
from saria.dataplane.ssd.memory import MemoryInUse, byte_span
from ssd_cases import PB, Fault, FaultyOps, capacity, drive_file, drives, is_payload, payload, read_back

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
LOGGER = "saria.dataplane.ssd"
LENGTH = 2 * PB + 100  # three parts: PB, PB, 100


def open_store(tmp_path, n_drives=1, slots=16, **kw):
    kw.setdefault("read_threads", 4)
    return SSDStore(drives(tmp_path, n_drives), capacity(slots), PB, **kw)


def assert_kept(store, key, data):
    """``key`` is still served, byte for byte, and no read failed (nothing was dropped)."""
    assert store.contains(key)
    assert torch.equal(read_back(store, key, data.numel()), data)
    assert store.counters()["read_failures"] == 0


def read_only_tensor(nbytes: int) -> torch.Tensor:
    """``nbytes`` of a read-only anonymous mapping as a uint8 tensor (torch warns: it has no read-only tensors)."""
    m = mmap.mmap(-1, nbytes, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(m, dtype=torch.uint8)


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))


# ------------------------------------------------------------------ destinations refused before any I/O

def buffer(n=4 * PB):
    return torch.zeros(n, dtype=torch.uint8)


@pytest.mark.parametrize("make_out, match", [
    pytest.param(lambda: [buffer(PB)] * 3, r"out\[0\] and out\[1\] overlap in memory", id="same-tensor-thrice"),
    pytest.param(lambda: (lambda t: [t, buffer(PB), t])(buffer(PB)), r"out\[0\] and out\[2\] overlap",
                 id="same-tensor-first-and-last"),
    pytest.param(lambda: (lambda b: [b[:PB], b[PB - 1:2 * PB - 1], b[3 * PB:]])(buffer()),
                 r"out\[0\] and out\[1\] overlap .*: 1 bytes shared", id="views-one-byte-overlap"),
    pytest.param(lambda: (lambda b: [b[:PB], b[2 * PB:3 * PB], b[2 * PB + 50:]])(buffer()),
                 r"out\[1\] and out\[2\] overlap", id="short-last-part-inside-another"),
    pytest.param(lambda: (lambda b: [b.view(4, PB)[0], b.view(4, PB)[1], b[PB:]])(buffer()),
                 r"out\[1\] and out\[2\] overlap", id="2d-view-rows"),
    pytest.param(lambda: torch.zeros(1, dtype=torch.uint8).expand(LENGTH), "expanded tensor", id="expanded-out"),
    pytest.param(lambda: [buffer(PB), torch.zeros(1, dtype=torch.uint8).expand(PB), buffer(PB)],
                 r"out\[1\] must be a contiguous tensor.*expanded", id="expanded-part"),
    pytest.param(lambda: read_only_tensor(LENGTH), "read-only memory", id="read-only-out"),
    pytest.param(lambda: read_only_tensor(LENGTH + 1)[1:], "read-only memory", id="read-only-unaligned"),
    pytest.param(lambda: [buffer(PB), read_only_tensor(PB), buffer(PB)], r"out\[1\] is read-only",
                 id="read-only-part"),
    pytest.param(lambda: torch.empty(LENGTH, dtype=torch.uint8, device="meta"), "CPU or CUDA", id="meta-device"),
])
@pytest.mark.parametrize("direct", ["auto", False], ids=["direct-auto", "buffered"])
def test_bad_destination_is_refused_and_the_object_kept(tmp_path, make_out, match, direct):
    data = payload(LENGTH, 1)
    with open_store(tmp_path, 2, direct=direct) as store:
        store.write(b"obj", data).result()
        free = store.free_parts
        for _ in range(3):  # every time, not by luck of thread timing
            with pytest.raises(ValueError, match=match):
                store.read(b"obj", make_out())
        assert store.free_parts == free
        assert_kept(store, b"obj", data)
    with open_store(tmp_path, 2) as store:  # and after a restart
        assert_kept(store, b"obj", data)


def test_destinations_may_share_bytes_a_read_does_not_write(tmp_path):
    """Only each part's length at the start of ``out[i]`` is written: room past it may be shared."""
    data = payload(LENGTH, 2)
    with open_store(tmp_path, 2) as store:
        store.write(b"obj", data).result()
        b = torch.full((3 * PB,), 7, dtype=torch.uint8)
        store.read(b"obj", [b[:3 * PB], b[PB:3 * PB], b[2 * PB:]]).result(timeout=30)  # adjacent written bytes
        assert torch.equal(b[:LENGTH], data) and bool((b[LENGTH:] == 7).all())


def test_read_only_page_inside_a_destination_fails_the_read_but_keeps_the_object(tmp_path):
    """The up-front probe sees only a destination's first and last bytes; a read-only page between
    them makes the kernel refuse the read (EFAULT), which is the caller's memory, not the stored copy."""
    libc = ctypes.CDLL(None, use_errno=True)
    m = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    out = torch.frombuffer(m, dtype=torch.uint8)
    middle = out.data_ptr() + mmap.PAGESIZE
    assert libc.mprotect(ctypes.c_void_p(middle), mmap.PAGESIZE, mmap.PROT_READ) == 0, os.strerror(ctypes.get_errno())
    try:
        data = payload(3 * mmap.PAGESIZE, 3)
        with open_store(tmp_path, 1, direct=False) as store:
            store.write(b"obj", data).result()
            with pytest.raises(ValueError, match="EFAULT.*the object is kept"):
                store.read(b"obj", out).result(timeout=30)
            assert store.contains(b"obj") and store.counters()["verification_failures"] == 0
            assert torch.equal(read_back(store, b"obj", data.numel()), data)
    finally:
        libc.mprotect(ctypes.c_void_p(middle), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)


def test_the_same_source_twice_is_written(tmp_path):
    """Writes only read their sources: the same tensor twice, or several writes of one buffer at
    once, are legitimate."""
    t = payload(PB, 4)
    with open_store(tmp_path, 2) as store:
        store.write(b"twice", [t, t, t[:10]]).result()
        futures = [store.write(b"copy%d" % i, t) for i in range(4)]
        assert all(f.result(timeout=30) is not None for f in futures)
        assert torch.equal(read_back(store, b"twice", 2 * PB + 10), torch.cat([t, t, t[:10]]))
        assert torch.equal(read_back(store, b"copy3", PB), t)


# ------------------------------------------------------------------ memory in use by another operation in flight

def gate(ops: FaultyOps, op: str) -> tuple[threading.Event, threading.Event]:
    """Block the next payload ``op`` until ``release`` is set; ``entered`` says it began."""
    release, entered = threading.Event(), threading.Event()
    ops.add(Fault(op, when=lambda c: is_payload(c.offset), gate=release, before=lambda c: entered.set()))
    return release, entered


def test_read_into_the_source_of_a_write_in_flight_is_refused(tmp_path):
    ops = FaultyOps()
    with open_store(tmp_path, 1, io_ops=ops) as store:
        store.write(b"other", payload(PB, 5)).result()
        src = payload(2 * PB, 6)
        release, entered = gate(ops, "pwrite")
        writing = store.write(b"new", src)
        assert entered.wait(30)
        with pytest.raises(ValueError, match=r"out overlaps data of the write of object \(3-byte key\), still in flight"):
            store.read(b"other", src[PB // 2:PB // 2 + PB])
        release.set()
        writing.result(timeout=30)
        assert torch.equal(read_back(store, b"new", 2 * PB), payload(2 * PB, 6))  # the source was not touched
        store.read(b"other", src[:PB]).result(timeout=30)  # the write is over: its memory is free again
        assert_kept(store, b"other", payload(PB, 5))


def test_write_from_a_read_destination_in_flight_is_refused(tmp_path):
    ops = FaultyOps()
    with open_store(tmp_path, 1, io_ops=ops) as store:
        store.write(b"obj", payload(PB, 7)).result()
        out = torch.zeros(PB, dtype=torch.uint8)
        release, entered = gate(ops, "pread")
        reading = store.read(b"obj", out)
        assert entered.wait(30)
        with pytest.raises(ValueError, match=r"data\[1\] overlaps out of the read of object \(3-byte key\), still in flight"):
            store.write(b"copy", [payload(PB, 8), out[:100]])
        with pytest.raises(ValueError, match=r"out overlaps out of the read of object \(3-byte key\)"):
            store.read(b"obj", out)  # a second read into the same buffer
        assert not store.contains(b"copy")
        release.set()
        reading.result(timeout=30)
        store.write(b"copy", out).result(timeout=30)
        assert torch.equal(read_back(store, b"copy", PB), payload(PB, 7))
        assert_kept(store, b"obj", payload(PB, 7))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["posix", "kvikio"])
def test_cuda_destinations_that_overlap_are_refused(tmp_path, backend):
    if backend == "kvikio":
        pytest.importorskip("kvikio")
    data = payload(LENGTH, 25)
    with open_store(tmp_path, 2, backend=backend) as store:
        store.write(b"obj", data.cuda()).result()
        t = torch.zeros(PB, dtype=torch.uint8, device="cuda")
        with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] overlap in memory \(cuda:0 bytes"):
            store.read(b"obj", [t, t, t])
        buf = torch.zeros(3 * PB, dtype=torch.uint8, device="cuda")
        store.read(b"obj", [buf[:PB], buf[PB:2 * PB], buf[2 * PB:]]).result(timeout=30)
        assert torch.equal(buf[:LENGTH].cpu(), data)
        cpu_twin = torch.zeros(3 * PB, dtype=torch.uint8)  # other address space: never an overlap
        store.read(b"obj", [buf[:PB], cpu_twin[:PB], buf[2 * PB:]]).result(timeout=30)
        assert_kept(store, b"obj", data)


# ------------------------------------------------------------------ property: exactly the overlapping sets are refused

PART_LENGTHS = (PB, PB, 100)


def overlapping(spans: list[tuple[int, int]]) -> bool:
    return any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[i + 1:])


def test_random_views_of_one_buffer_refused_exactly_when_written_bytes_overlap(tmp_path):
    data = payload(LENGTH, 9)
    with open_store(tmp_path, 2) as store:
        store.write(b"obj", data).result()
        buf = torch.zeros(3 * PB + 1000, dtype=torch.uint8)
        space = buf.numel()

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.tuples(*(st.tuples(st.integers(0, space - n), st.integers(0, 300)) for n in PART_LENGTHS)))
        def check(views):
            out = [buf[start:start + n + extra] for (start, extra), n in zip(views, PART_LENGTHS)]
            written = [(start, start + n) for (start, _), n in zip(views, PART_LENGTHS)]
            if overlapping(written):
                with pytest.raises(ValueError, match="overlap in memory"):
                    store.read(b"obj", out)
            else:
                store.read(b"obj", out).result(timeout=30)
                for (start, end), part in zip(written, data.split(PB)):
                    assert torch.equal(buf[start:end], part)
            assert store.contains(b"obj")

        check()
        assert_kept(store, b"obj", data)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 255), st.integers(0, 64), st.booleans()), max_size=40))
def test_memory_in_use_matches_a_brute_force_model(steps):
    """Random claims (reads write, writes only read) and releases against a list of live spans."""
    buf = torch.zeros(320, dtype=torch.uint8)
    mem, live = MemoryInUse(), []  # live: (claim, start, end, writes)
    for writes, start, length, release in steps:
        if release and live:
            claim, *_ = live.pop(start % len(live))
            mem.release(claim)
            continue
        t = buf[start:start + length]
        s, e = start, start + t.numel()
        clash = any(s < b1 and b0 < e and (writes or w) for _, b0, b1, w in live if b1 > b0 and e > s)
        if clash:
            with pytest.raises(ValueError, match="overlaps"):
                mem.claim("op", writes, [("x", t)])
        else:
            live.append((mem.claim("op", writes, [("x", t)]), s, e, writes))
    assert len(mem) == sum(1 for _, s, e, _ in live if e > s)


def test_byte_span_of_strided_views_is_conservative():
    b = torch.zeros(64, dtype=torch.uint8)
    assert byte_span(b[8:16]).end - byte_span(b[8:16]).start == 8
    every_other = b.view(8, 8)[:, 2]  # bytes 2, 10, ..., 58
    span = byte_span(every_other)
    assert (span.start - b.data_ptr(), span.end - b.data_ptr()) == (2, 59)
    expanded = byte_span(torch.zeros(1, dtype=torch.uint8).expand(10))  # ten elements, one byte
    assert expanded.end - expanded.start == 1


# ------------------------------------------------------------------ one store per drive directory

def test_second_store_in_this_process_is_refused_naming_directory_and_pid(tmp_path):
    with open_store(tmp_path, 2):
        with pytest.raises(StoreConfigError, match=f"SSD path {tmp_path / 'nvme0'} is in use by another SSD store "
                                                   rf"\(held by this process, pid {os.getpid()}"):
            open_store(tmp_path, 2)
        d1 = drives(tmp_path, 2)[1]
        with pytest.raises(StoreConfigError, match=f"SSD path {d1} is in use"):
            SSDStore([d1], capacity(16), PB)
    with open_store(tmp_path, 2):
        pass


def test_second_store_in_another_process_is_refused_both_ways(tmp_path):
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from pathlib import Path
        from saria.dataplane import SSDStore, StoreConfigError
        from ssd_cases import PB, capacity, drives
        try:
            store = SSDStore(drives(Path({str(tmp_path)!r}), 1), capacity(16), PB)
        except StoreConfigError as exc:
            print("refused:", exc, flush=True)
            sys.exit(0)
        print("open", flush=True)
        sys.stdin.readline()
        store.close()
        print("closed", flush=True)
    """)
    with open_store(tmp_path, 1):  # this process holds it: the child is refused
        proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=env())
        assert proc.returncode == 0, proc.stderr
        assert f"is in use by another SSD store (held by process {os.getpid()})" in proc.stdout
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env())
    try:  # the child holds it: this process is refused, with the child's pid
        assert proc.stdout.readline().strip() == "open", proc.stderr.read()
        with pytest.raises(StoreConfigError, match=f"{tmp_path / 'nvme0'} is in use by another SSD store "
                                                   rf"\(held by process {proc.pid}\)"):
            open_store(tmp_path, 1)
        drive_file(tmp_path / "nvme0").unlink()  # deleting the drive file does not release the lock
        with pytest.raises(StoreConfigError, match="in use by another SSD store"):
            open_store(tmp_path, 1)
        out, err = proc.communicate("\n", timeout=60)
        assert proc.returncode == 0 and "closed" in out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open_store(tmp_path, 1) as store:  # the child closed: the directory is free
        assert store.keys() == []


# ------------------------------------------------------------------ drive files deleted or replaced while open

def lost_lines(caplog):
    return [r for r in caplog.records if r.name == LOGGER and "taken out of service" in r.getMessage()]


def test_deleted_drive_file_fails_the_next_write_and_takes_the_drive_out(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = drive_file(tmp_path / "nvme0")
    store = open_store(tmp_path, 1)
    try:
        store.write(b"before", payload(PB + 5, 10)).result()
        path.unlink()
        with pytest.raises(ObjectWriteError, match=f"{path} was deleted while the store had it open") as info:
            store.write(b"after", payload(100, 11)).result(timeout=30)
        assert isinstance(info.value.__cause__, DriveLost) and info.value.__cause__.path == path
        assert store.lost_drives == {path: "was deleted"} and store.check_drives() == {path: "was deleted"}
        assert store.keys() == [] and not store.contains(b"after")
        with pytest.raises(ObjectNotFound):
            store.read(b"before", torch.zeros(PB + 5, dtype=torch.uint8))
        with pytest.raises(DriveLost, match=f"every drive of the SSD store is out of service \\({path} was deleted"):
            store.write(b"later", payload(10, 12))
        c = store.counters()
        assert (c["drives_lost"], c["objects_lost"], c["write_failures"]) == (1, 1, 1)
        assert store.total_parts == 0 and store.free_parts == 0
        with pytest.raises(StoreConfigError, match="in use by another SSD store"):  # the bug: a second store got in
            open_store(tmp_path, 1)
    finally:
        store.close()
    lines = lost_lines(caplog)
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    assert f"{path} was deleted while the store had it open: drive taken out of service, 1 object(s)" in \
        lines[0].getMessage()
    assert not path.exists()  # nothing recreated it behind the store's back
    with open_store(tmp_path, 1) as store:  # after close a new store opens fine, on a new, empty file
        assert store.keys() == [] and store.free_parts == store.total_parts == 16
        store.write(b"k", payload(10, 13)).result()


def test_write_in_flight_when_its_drive_file_is_deleted_is_not_reported_durable(tmp_path, caplog):
    ops = FaultyOps()
    path = drive_file(tmp_path / "nvme0")
    with open_store(tmp_path, 1, io_ops=ops) as store:
        release, entered = gate(ops, "pwrite")
        writing = store.write(b"k", payload(3 * PB, 14))
        assert entered.wait(30)
        path.unlink()
        release.set()
        with pytest.raises(ObjectWriteError, match="was deleted while the store had it open"):
            writing.result(timeout=30)
        assert store.keys() == []
    assert len(lost_lines(caplog)) == 1


def test_replaced_drive_file(tmp_path, caplog):
    path = drive_file(tmp_path / "nvme0")
    with open_store(tmp_path, 1) as store:
        store.write(b"old", payload(PB, 15)).result()
        shutil.copyfile(path, tmp_path / "copy.bin")  # e.g. a backup restored over the live file
        os.replace(tmp_path / "copy.bin", path)
        with pytest.raises(ObjectWriteError, match=f"{path} was replaced by another file"):
            store.write(b"new", payload(PB, 16)).result(timeout=30)
        assert not store.contains(b"old") and store.lost_drives[path].startswith("was replaced by another file")
    assert len(lost_lines(caplog)) == 1
    with open_store(tmp_path, 1) as store:  # the file now at the path is what a restart serves
        assert store.keys() == [b"old"]
        assert torch.equal(read_back(store, b"old", PB), payload(PB, 15))


def test_vanished_drive_file_is_reported_at_close(tmp_path, caplog):
    path = drive_file(tmp_path / "nvme1")
    with open_store(tmp_path, 2) as store:
        store.write(b"k", payload(2 * PB, 17)).result()
        path.unlink()
    assert len(lost_lines(caplog)) == 1 and str(path) in lost_lines(caplog)[0].getMessage()


def test_read_in_flight_when_its_drive_is_lost_delivers_the_bytes_it_pinned(tmp_path):
    """The store still has the vanished file open: a read already under way completes, verified;
    the object is gone from the index, and its slot on the drive left is freed when the read ends."""
    ops = FaultyOps()
    data = payload(2 * PB, 26)
    with open_store(tmp_path, 2, slots=4, io_ops=ops) as store:
        store.write(b"obj", data).result()
        assert {p.drive for p in store.info(b"obj").parts} == {0, 1}
        out = torch.zeros(2 * PB, dtype=torch.uint8)
        release, entered = gate(ops, "pread")
        reading = store.read(b"obj", out)
        assert entered.wait(30)
        drive_file(tmp_path / "nvme1").unlink()
        assert list(store.check_drives().values()) == ["was deleted"]
        assert not store.contains(b"obj") and store.free_parts == 3  # drive 0's slot is still pinned
        release.set()
        reading.result(timeout=30)
        assert torch.equal(out, data)
        assert store.free_parts == 4 and store.total_parts == 4


def test_two_drive_store_losing_one_keeps_serving_on_the_other(tmp_path, caplog):
    lost_path = drive_file(tmp_path / "nvme1")
    objects = {b"a": payload(PB, 20), b"b": payload(PB, 21), b"ab": payload(2 * PB, 22), b"c": payload(PB, 23)}
    with open_store(tmp_path, 2, slots=8) as store:
        for k, v in objects.items():
            store.write(k, v).result()
        on_drive0 = {k for k in objects if all(p.drive == 0 for p in store.info(k).parts)}
        assert on_drive0 and on_drive0 != set(objects)
        lost_path.unlink()
        assert store.check_drives() == {lost_path: "was deleted"}
        assert store.check_drives() == {lost_path: "was deleted"}  # once out, stays out, logged once
        assert set(store.keys()) == on_drive0
        for k in on_drive0:
            assert torch.equal(read_back(store, k, objects[k].numel()), objects[k])
        used = sum(len(store.info(k).parts) for k in on_drive0)
        assert store.total_parts == 8 and store.free_parts == 8 - used  # parts of lost objects on drive 0 freed
        fresh = payload(3 * PB, 24)
        info = store.write(b"fresh", fresh).result(timeout=30)
        assert {p.drive for p in info.parts} == {0}
        assert torch.equal(read_back(store, b"fresh", 3 * PB), fresh)
        assert store.counters()["objects_lost"] == len(objects) - len(on_drive0)
    assert len(lost_lines(caplog)) == 1
    assert "1 drive(s) left in service" in lost_lines(caplog)[0].getMessage()
    with open_store(tmp_path, 2, slots=8) as store:  # restart: a new file on drive 1, drive 0's objects served
        assert set(store.keys()) == on_drive0 | {b"fresh"}
        assert store.counters()["dropped_at_open"] == 0  # lost objects' surviving parts were erased at run time
        assert torch.equal(read_back(store, b"fresh", 3 * PB), fresh)

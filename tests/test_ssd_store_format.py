"""The SSD store's on-disk format and open-time recovery as pure functions: header and superblock
encodings reject every damaged byte, and ``assemble`` serves each key's newest complete object."""

from __future__ import annotations

import pytest

from saria.dataplane.ssd.alloc import SlotAllocator
from saria.dataplane.ssd.errors import StoreFull
from saria.dataplane.ssd.format import (EMPTY_HEADER, HEADER_BYTES, SUPERBLOCK_BYTES, Geometry, SlotHeader,
                                        SuperBlock, decode_header)
from saria.dataplane.ssd.index import assemble

PB = 8192


def header(key=b"k", gen=1, index=0, count=1, length=100, part_length=None, capacity=PB, csum=7):
    if part_length is None:
        part_length = min(PB, length - index * PB)
    return SlotHeader(key, gen, index, count, length, part_length, capacity, csum)


def test_geometry_keeps_every_header_and_payload_4k_aligned():
    g = Geometry.for_capacity(SUPERBLOCK_BYTES + 3 * (HEADER_BYTES + PB) + 4095, PB)
    assert g.slots == 3 and g.file_bytes == SUPERBLOCK_BYTES + 3 * (HEADER_BYTES + PB)
    for s in range(g.slots):
        assert g.header_offset(s) % 4096 == 0 and g.payload_offset(s) % 4096 == 0
        assert g.payload_offset(s) == g.header_offset(s) + HEADER_BYTES
    assert g.whole_slots_in(g.header_offset(2) + HEADER_BYTES + PB - 1) == 2
    assert Geometry.for_capacity(100, PB).slots == 0


def test_header_round_trip_and_empty_slot():
    h = header(key=b"\x00chunk\xff" * 8, gen=2**63, index=3, count=9, length=9 * PB, csum=2**64 - 1)
    block = h.encode()
    assert len(block) == HEADER_BYTES
    assert decode_header(block) == h
    assert decode_header(EMPTY_HEADER) is None


def test_every_flipped_byte_of_a_header_is_rejected():
    block = bytearray(header(key=b"abc", length=5000).encode())
    for i in range(136):  # every byte the header uses
        damaged = bytearray(block)
        damaged[i] ^= 0x01
        with pytest.raises(ValueError):
            decode_header(bytes(damaged))


def test_torn_header_is_rejected():
    block = header(length=5000).encode()
    torn = block[:60] + bytes(HEADER_BYTES - 60)
    with pytest.raises(ValueError, match="checksum"):
        decode_header(torn)


def test_superblock():
    sb = SuperBlock(PB, 1234)
    assert SuperBlock.decode(sb.encode()) == sb
    assert SuperBlock.decode(bytes(SUPERBLOCK_BYTES)) is None
    for i in range(40):
        damaged = bytearray(sb.encode())
        damaged[i] ^= 0x80
        with pytest.raises(ValueError):
            SuperBlock.decode(bytes(damaged))


def parts_of(key, gen, length, drive_slots, skip=()):
    count = -(-length // PB)
    return [(d, s, header(key, gen, i, count, length)) for i, (d, s) in enumerate(drive_slots) if i not in skip]


def test_assemble_serves_complete_objects_in_part_order():
    hs = parts_of(b"a", 5, 2 * PB + 1, [(1, 4), (0, 2), (2, 0)])
    rec = assemble(list(reversed(hs)), PB)
    info = rec.objects[b"a"]
    assert [(p.drive, p.slot, p.length) for p in info.parts] == [(1, 4, PB), (0, 2, PB), (2, 0, 1)]
    assert info.length == 2 * PB + 1 and info.generation == 5
    assert rec.dropped_objects == 0 and rec.erase == [] and rec.max_generation == 5


def test_assemble_newest_complete_generation_wins():
    old = parts_of(b"k", 3, 2 * PB, [(0, 0), (0, 1)])
    new = parts_of(b"k", 7, PB, [(0, 5)])
    half = parts_of(b"k", 9, 2 * PB, [(0, 6), (0, 7)], skip={1})  # crashed while committing
    rec = assemble(old + new + half, PB)
    assert rec.objects[b"k"].generation == 7
    assert rec.dropped_objects == 2 and sorted(rec.erase) == [(0, 0), (0, 1), (0, 6)]
    assert rec.max_generation == 9


@pytest.mark.parametrize("damage", ["missing", "duplicate", "count", "length", "part_length", "capacity"])
def test_assemble_drops_inconsistent_objects(damage):
    hs = parts_of(b"k", 1, 3 * PB, [(0, 0), (1, 0), (2, 0)])
    d, s, h = hs[1]
    if damage == "missing":
        hs.pop(1)
    elif damage == "duplicate":
        hs[2] = (2, 0, h)
    else:
        field = {"count": "part_count", "length": "object_length", "part_length": "part_length",
                 "capacity": "part_capacity"}[damage]
        value = getattr(h, field) + (PB if damage == "capacity" else 1)
        hs[1] = (d, s, SlotHeader(**{**h.__dict__, field: value}))
    rec = assemble(hs, PB)
    assert rec.objects == {} and rec.dropped_objects >= 1
    assert len(rec.erase) == len(hs)


def test_allocator_stripes_and_refuses_without_side_effects():
    a = SlotAllocator([range(2), range(2), range(2)])
    assert a.allocate(3) == [(0, 0), (1, 0), (2, 0)]
    assert a.allocate(2) == [(0, 1), (1, 1)]
    with pytest.raises(StoreFull, match="needs 2 free slot"):
        a.allocate(2)
    assert a.free == 1 and a.allocate(1) == [(2, 1)]
    a.release([(1, 1), (0, 0)])
    assert sorted(a.allocate(2)) == [(0, 0), (1, 1)]

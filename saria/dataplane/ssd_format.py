"""On-disk format of an SSD store drive file (format version 1, all integers little-endian).

A drive file is a 4 KiB superblock followed by an array of slots::

    offset 0                      superblock (4096 bytes)
    offset 4096 + s * stride      slot s header (4096 bytes)      stride = 4096 + part_bytes
    offset 8192 + s * stride      slot s payload (part_bytes)

so every header and every payload starts on a 4 KiB boundary (O_DIRECT).

Superblock (bytes 0..40, the rest zero)::

    0   8s  magic b"SARIADRV"          16  Q  part_bytes (payload capacity of a slot)
    8   H   format version (1)         24  Q  slots (the file holds this many whole slots)
    10  H   reserved (0)               32  Q  blake2b-64 of bytes 0..32
    12  I   header bytes (4096)

Slot header (bytes 0..136, the rest zero). An all-zero header is an empty slot; a header is
*committed* only if its magic, version, state and checksum are all right, so a torn or flipped
header never reads as valid::

    0   8s  magic b"SARIASLT"          32  Q  object length (bytes)
    8   H   format version (1)         40  Q  part length (bytes of payload in this slot)
    10  B   state (1 = committed)      48  Q  part capacity (part_bytes, checked at open)
    11  B   key length (1..64)         56  Q  payload checksum (saria.kernels.checksum)
    12  I   part index                 64  64s key, zero padded
    16  I   part count                 128 Q  blake2b-64 of bytes 0..128
    20  I   reserved (0)
    24  Q   generation (monotonic write counter of the store)

The header's own checksum is blake2b (stdlib): headers are host-side metadata parsed on the CPU at
open, while payload checksums use the kernels' device checksum so reads verify where they land.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

BLOCK = 4096  # O_DIRECT alignment of buffer addresses, lengths and file offsets used here
HEADER_BYTES = 4096
SUPERBLOCK_BYTES = 4096
FORMAT_VERSION = 1
MAX_KEY_BYTES = 64
FILE_NAME = "saria-ssd-store.bin"

SUPER_MAGIC = b"SARIADRV"
SLOT_MAGIC = b"SARIASLT"
STATE_COMMITTED = 1

_SUPER = struct.Struct("<8sHHIQQ")  # 32 bytes, then the checksum
_SLOT = struct.Struct("<8sHBBIIIQQQQQ64s")  # 128 bytes, then the checksum
_CSUM = struct.Struct("<Q")
_SLOT_USED = _SLOT.size + _CSUM.size


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def round_up(n: int, to: int = BLOCK) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Geometry:
    """Where slot ``s`` lives in a drive file of ``slots`` slots of ``part_bytes`` payload each."""

    part_bytes: int
    slots: int

    @property
    def stride(self) -> int:
        return HEADER_BYTES + self.part_bytes

    @property
    def file_bytes(self) -> int:
        return SUPERBLOCK_BYTES + self.slots * self.stride

    def header_offset(self, slot: int) -> int:
        return SUPERBLOCK_BYTES + slot * self.stride

    def payload_offset(self, slot: int) -> int:
        return self.header_offset(slot) + HEADER_BYTES

    def whole_slots_in(self, file_size: int) -> int:
        """How many slots (header and full payload) a file of ``file_size`` bytes holds."""
        return max(0, (file_size - SUPERBLOCK_BYTES) // self.stride)

    @staticmethod
    def for_capacity(capacity_bytes: int, part_bytes: int) -> "Geometry":
        return Geometry(part_bytes, max(0, (capacity_bytes - SUPERBLOCK_BYTES) // (HEADER_BYTES + part_bytes)))


@dataclass(frozen=True)
class SuperBlock:
    part_bytes: int
    slots: int

    def encode(self) -> bytes:
        head = _SUPER.pack(SUPER_MAGIC, FORMAT_VERSION, 0, HEADER_BYTES, self.part_bytes, self.slots)
        return (head + _CSUM.pack(_digest(head))).ljust(SUPERBLOCK_BYTES, b"\0")

    @staticmethod
    def decode(block: bytes) -> "SuperBlock | None":
        """The superblock in ``block``; ``None`` if it is all zeros (a file never formatted).

        Raises ``ValueError`` saying why for anything else that is not a valid version-1 superblock.
        """
        used = block[:_SUPER.size + _CSUM.size]
        if len(used) < _SUPER.size + _CSUM.size:
            if not any(used):
                return None
            raise ValueError(f"superblock is cut short ({len(block)} bytes)")
        if not any(used):
            return None
        magic, version, _, header_bytes, part_bytes, slots = _SUPER.unpack_from(used)
        if magic != SUPER_MAGIC:
            raise ValueError(f"no saria superblock (magic {magic!r})")
        (stored,) = _CSUM.unpack_from(used, _SUPER.size)
        if stored != _digest(used[:_SUPER.size]):
            raise ValueError("superblock checksum mismatch (corrupt superblock)")
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version}, this saria reads version {FORMAT_VERSION}")
        if header_bytes != HEADER_BYTES:
            raise ValueError(f"header size {header_bytes}, expected {HEADER_BYTES}")
        return SuperBlock(part_bytes, slots)


@dataclass(frozen=True)
class SlotHeader:
    """A committed slot header: part ``part_index`` of ``part_count`` of object ``key``."""

    key: bytes
    generation: int
    part_index: int
    part_count: int
    object_length: int
    part_length: int
    part_capacity: int
    checksum: int

    def encode(self) -> bytes:
        body = _SLOT.pack(SLOT_MAGIC, FORMAT_VERSION, STATE_COMMITTED, len(self.key), self.part_index,
                          self.part_count, 0, self.generation, self.object_length, self.part_length,
                          self.part_capacity, self.checksum, self.key)
        return (body + _CSUM.pack(_digest(body))).ljust(HEADER_BYTES, b"\0")


EMPTY_HEADER = bytes(HEADER_BYTES)


def decode_header(block: bytes) -> SlotHeader | None:
    """The committed header in ``block``, ``None`` for an empty (all-zero) slot.

    Raises ``ValueError`` saying why for a header that is torn, flipped, or not committed.
    """
    used = block[:_SLOT_USED]
    if len(used) < _SLOT_USED:
        raise ValueError(f"header cut short ({len(block)} bytes)")
    if not any(used):
        return None
    (magic, version, state, key_len, part_index, part_count, reserved, generation, object_length,
     part_length, part_capacity, checksum, key) = _SLOT.unpack_from(used)
    if magic != SLOT_MAGIC:
        raise ValueError(f"bad header magic {magic!r}")
    (stored,) = _CSUM.unpack_from(used, _SLOT.size)
    if stored != _digest(used[:_SLOT.size]):
        raise ValueError("header checksum mismatch (torn or corrupt header)")
    if version != FORMAT_VERSION:
        raise ValueError(f"header format version {version}")
    if state != STATE_COMMITTED:
        raise ValueError(f"header state {state} is not committed")
    if not 1 <= key_len <= MAX_KEY_BYTES or any(key[key_len:]) or reserved:
        raise ValueError("malformed key field")
    if not part_index < part_count or not 0 < part_length <= part_capacity:
        raise ValueError("inconsistent part fields")
    return SlotHeader(key[:key_len], generation, part_index, part_count, object_length, part_length,
                      part_capacity, checksum)

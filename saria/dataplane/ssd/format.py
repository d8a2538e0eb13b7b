"""On-disk format of an SSD store drive file (format version 2, all integers little-endian).

A drive file is a 4 KiB superblock followed by an array of slots::

    offset 0                      superblock (4096 bytes)
    offset 4096 + s * stride      slot s header (4096 bytes)      stride = 4096 + part_bytes
    offset 8192 + s * stride      slot s payload (part_bytes)

so every header and every payload starts on a 4 KiB boundary (O_DIRECT).

Superblock (version 2; the whole 4 KiB block is checksummed)::

    0   8s  magic b"SARIADRV"          16  Q  part_bytes (payload capacity of a slot)
    8   H   format version (2)         24  Q  slots (the file holds this many whole slots)
    10  H   reserved (0)               32  I  identity length n (0..3000 bytes)
    12  I   header bytes (4096)        36  I  reserved (0)
    40      identity: n bytes of UTF-8 text, then zeros up to byte 4088
    4088 Q  blake2b-64 of bytes 0..4088

The identity says what the objects in the file were written for (e.g. a canonical JSON of model,
dtype, page geometry, TP size and rank, built by the caller; ``""``: nothing said). A version-1
superblock (written by saria before identities) is still read, as identity ``""``: bytes 0..32 as
above with version 1, then ``Q`` blake2b-64 of bytes 0..32 at offset 32, the rest zero. Slot
headers did not change: they are slot format version 1 in files of either superblock version.

Slot header (bytes 0..136, the rest zero). An all-zero header is an empty slot; a header is
*committed* only if its magic, version, state and checksum are all right, so a torn or flipped
header never reads as valid::

    0   8s  magic b"SARIASLT"          32  Q  object length (bytes)
    8   H   slot format version (1)    40  Q  part length (bytes of payload in this slot)
    10  B   state (1 = committed)      48  Q  part capacity (part_bytes, checked at open)
    11  B   key length (1..64)         56  Q  payload checksum (saria.kernels.checksum)
    12  I   part index                 64  64s key, zero padded
    16  I   part count                 128 Q  blake2b-64 of bytes 0..128
    20  I   reserved (0)
    24  Q   generation (monotonic write counter of the store)

The header's own checksum is blake2b (stdlib): headers are host-side metadata parsed on the CPU at
open, while payload checksums use the kernels' device checksum so reads verify where they land.

A sealed store (docs/ssd.md, "Sealed objects") writes slot format version 3: bytes 0..128 as in
version 1 with the payload checksum 0 (the part's AES-GCM tag replaces it), then::

    128 B   flags (1 = sealed; the only value)       160 16s GCM tag of the part
    129 3s  reserved (0)                              176 8s  key id of the key file it was sealed under
    132 I   key epoch                                 184 I   reserved (0)
    136 24s the part's random value (seal format 2)   188 Q   blake2b-64 of bytes 0..188

The random value salts the part's own key and gives its nonce (saria/seal/aead.py, seal format
version 2). Slot format version 2 (saria before per-part keys) had a 12-byte nonce (seal format
version 1) at 136, the tag at 148, the key id at 164, reserved at 172 and its checksum of bytes
0..176 at 176; such headers are still read and their parts opened, none is written any more.

The payload of a sealed part is its ciphertext (as long as the plaintext). Unsealed stores write
version 1, exactly as before.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from saria.seal import SealedPart

BLOCK = 4096  # O_DIRECT alignment of buffer addresses, lengths and file offsets used here
HEADER_BYTES = 4096
SUPERBLOCK_BYTES = 4096
FORMAT_VERSION = 2  # of the superblock written; version 1 superblocks are read too
SLOT_VERSION = 1  # of unsealed slot headers (unchanged since format version 1)
SEALED_SLOT_VERSION = 3  # of sealed slot headers (a part's 24-byte random value: seal format version 2)
V1_SEALED_SLOT_VERSION = 2  # sealed slot headers of seal format version 1 (a 12-byte nonce): read, not written
MAX_IDENTITY_BYTES = 3000  # UTF-8 bytes of a superblock's identity
MAX_KEY_BYTES = 64
FILE_NAME = "saria-ssd-store.bin"

SUPER_MAGIC = b"SARIADRV"
SLOT_MAGIC = b"SARIASLT"
STATE_COMMITTED = 1

_SUPER = struct.Struct("<8sHHIQQ")  # 32 bytes: version 1 puts its checksum next, version 2 the identity
_IDENTITY = struct.Struct("<II")  # version 2: identity length, reserved; the identity's bytes follow
_SUPER_SUMMED = SUPERBLOCK_BYTES - 8  # version 2: the checksum covers the block up to its last 8 bytes
_SLOT = struct.Struct("<8sHBBIIIQQQQQ64s")  # 128 bytes, then the checksum
_CSUM = struct.Struct("<Q")
_SLOT_USED = _SLOT.size + _CSUM.size
_SEALS = {  # sealed slot version: its fields at _SLOT.size, flags .. reserved (60 and 48 bytes)
    SEALED_SLOT_VERSION: struct.Struct("<B3sI24s16s8sI"),
    V1_SEALED_SLOT_VERSION: struct.Struct("<B3sI12s16s8sI"),
}
SEALED_FLAG = 1
_SEAL_NONCE = {24: SEALED_SLOT_VERSION, 12: V1_SEALED_SLOT_VERSION}  # a random value's length: its slot version


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


def encode_identity(identity: str) -> bytes:
    """``identity`` as the UTF-8 bytes a superblock stores; ``TypeError`` / ``ValueError`` if it
    is not text or does not fit (more than :data:`MAX_IDENTITY_BYTES` bytes, lone surrogates)."""
    if not isinstance(identity, str):
        raise TypeError(f"identity must be a str, got {type(identity).__name__}")
    try:
        data = identity.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"identity is not valid UTF-8 text: {exc}") from None
    if len(data) > MAX_IDENTITY_BYTES:
        raise ValueError(f"identity is {len(data)} bytes of UTF-8, at most {MAX_IDENTITY_BYTES} fit in a superblock")
    return data


@dataclass(frozen=True)
class SuperBlock:
    """A drive file's superblock: its slot geometry and what its objects were written for."""

    part_bytes: int
    slots: int
    identity: str = ""

    def __post_init__(self) -> None:
        encode_identity(self.identity)

    def encode(self) -> bytes:
        """The version-2 superblock block (4096 bytes)."""
        ident = encode_identity(self.identity)
        body = (_SUPER.pack(SUPER_MAGIC, FORMAT_VERSION, 0, HEADER_BYTES, self.part_bytes, self.slots)
                + _IDENTITY.pack(len(ident), 0) + ident).ljust(_SUPER_SUMMED, b"\0")
        return body + _CSUM.pack(_digest(body))

    @staticmethod
    def decode(block: bytes) -> "SuperBlock | None":
        """The superblock in ``block`` (version 1 or 2); ``None`` if it is all zeros (a file never
        formatted).

        Raises ``ValueError`` saying why for anything else: not a saria superblock, a damaged one,
        or one of a format version this saria does not read.
        """
        if not any(block[:SUPERBLOCK_BYTES]):
            return None
        if len(block) < _SUPER.size + _CSUM.size:
            raise ValueError(f"superblock is cut short ({len(block)} bytes)")
        magic, version, reserved, header_bytes, part_bytes, slots = _SUPER.unpack_from(block)
        if magic != SUPER_MAGIC:
            raise ValueError(f"no saria superblock (magic {magic!r})")
        if version == 1:
            summed, (stored,) = block[:_SUPER.size], _CSUM.unpack_from(block, _SUPER.size)
        elif version == FORMAT_VERSION:
            if len(block) < SUPERBLOCK_BYTES:
                raise ValueError(f"superblock is cut short ({len(block)} bytes)")
            summed, (stored,) = block[:_SUPER_SUMMED], _CSUM.unpack_from(block, _SUPER_SUMMED)
        else:
            raise ValueError(f"format version {version}: this saria reads versions 1 and {FORMAT_VERSION} "
                             "(a newer saria's file, or a corrupt superblock)")
        if stored != _digest(summed):
            raise ValueError("superblock checksum mismatch (corrupt superblock)")
        if header_bytes != HEADER_BYTES:
            raise ValueError(f"header size {header_bytes}, expected {HEADER_BYTES}")
        if reserved or part_bytes < BLOCK or part_bytes % BLOCK:
            raise ValueError(f"malformed superblock (part_bytes={part_bytes}, reserved={reserved})")
        if version == 1:
            return SuperBlock(part_bytes, slots)
        length, reserved = _IDENTITY.unpack_from(block, _SUPER.size)
        start = _SUPER.size + _IDENTITY.size
        if reserved or length > MAX_IDENTITY_BYTES or any(block[start + length:_SUPER_SUMMED]):
            raise ValueError(f"malformed identity field (length {length})")
        try:
            identity = block[start:start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"identity is not UTF-8 ({exc})") from None
        return SuperBlock(part_bytes, slots, identity)


@dataclass(frozen=True, repr=False)
class SealFields(SealedPart):
    """What a sealed part's header keeps beside its ciphertext: its epoch, nonce and tag (a
    :class:`~saria.seal.SealedPart`, as :meth:`~saria.seal.Sealer.open_into` takes it) and the
    key id of the key file it was sealed under. The random value is 24 bytes (seal format version
    2, slot version 3), or 12 (a version-1 part's nonce, read from a slot of version 2). ``repr``
    shows the epoch only."""

    key_id: bytes = b""

    def __post_init__(self) -> None:
        if len(self.nonce) not in _SEAL_NONCE or len(self.tag) != 16 or len(self.key_id) != 8:
            raise ValueError("sealed fields: a random value is 24 bytes (12 for version 1), a tag 16 and a key id 8")

    def __repr__(self) -> str:
        return f"SealFields(epoch={self.epoch})"


@dataclass(frozen=True)
class SlotHeader:
    """A committed slot header: part ``part_index`` of ``part_count`` of object ``key``;
    ``seal``: its sealed fields (slot version 3, or 2 for a version-1 part's), ``None`` for an
    unsealed part (version 1)."""

    key: bytes
    generation: int
    part_index: int
    part_count: int
    object_length: int
    part_length: int
    part_capacity: int
    checksum: int
    seal: SealFields | None = None

    def encode(self) -> bytes:
        version = SLOT_VERSION if self.seal is None else _SEAL_NONCE[len(self.seal.nonce)]
        body = _SLOT.pack(SLOT_MAGIC, version, STATE_COMMITTED, len(self.key), self.part_index,
                          self.part_count, 0, self.generation, self.object_length, self.part_length,
                          self.part_capacity, self.checksum, self.key)
        if self.seal is not None:
            body += _SEALS[version].pack(SEALED_FLAG, bytes(3), self.seal.epoch, self.seal.nonce, self.seal.tag,
                               self.seal.key_id, 0)
        return (body + _CSUM.pack(_digest(body))).ljust(HEADER_BYTES, b"\0")


EMPTY_HEADER = bytes(HEADER_BYTES)


def decode_header(block: bytes) -> SlotHeader | None:
    """The committed header in ``block``, ``None`` for an empty (all-zero) slot.

    Raises ``ValueError`` saying why for a header that is torn, flipped, or not committed.
    """
    if len(block) < _SLOT_USED:
        raise ValueError(f"header cut short ({len(block)} bytes)")
    if not any(block[:_SLOT_USED]):
        return None
    (magic, version, state, key_len, part_index, part_count, reserved, generation, object_length,
     part_length, part_capacity, checksum, key) = _SLOT.unpack_from(block)
    if magic != SLOT_MAGIC:
        raise ValueError(f"bad header magic {magic!r}")
    summed = _SLOT.size + (_SEALS[version].size if version in _SEALS else 0)
    if len(block) < summed + _CSUM.size:
        raise ValueError(f"header cut short ({len(block)} bytes)")
    (stored,) = _CSUM.unpack_from(block, summed)
    if stored != _digest(block[:summed]):
        raise ValueError("header checksum mismatch (torn or corrupt header)")
    if version != SLOT_VERSION and version not in _SEALS:
        raise ValueError(f"header format version {version}")
    seal = None
    if version in _SEALS:
        flags, pad, epoch, nonce, tag, key_id, pad2 = _SEALS[version].unpack_from(block, _SLOT.size)
        if flags != SEALED_FLAG or any(pad) or pad2 or checksum:
            raise ValueError("malformed sealed fields")
        seal = SealFields(epoch, nonce, tag, key_id)
    if state != STATE_COMMITTED:
        raise ValueError(f"header state {state} is not committed")
    if not 1 <= key_len <= MAX_KEY_BYTES or any(key[key_len:]) or reserved:
        raise ValueError("malformed key field")
    if not part_index < part_count or not 0 < part_length <= part_capacity:
        raise ValueError("inconsistent part fields")
    return SlotHeader(key[:key_len], generation, part_index, part_count, object_length, part_length,
                      part_capacity, checksum, seal)

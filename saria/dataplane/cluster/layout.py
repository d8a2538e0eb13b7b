"""How a saria object is laid out in Mooncake Store: key names and the metadata value.

An object (``key``: :func:`saria.dataplane.ssd.keys.object_key` bytes, up to 64) written for an
``identity`` (the model / layout string the caller gives, as the SSD store's) is ``n`` part values
plus one metadata value, each a Mooncake key under a common prefix::

    saria/<identity digest: 32 hex>/<object key: hex>/m                  metadata (64 + 16 n bytes)
    saria/<identity digest: 32 hex>/<object key: hex>/<i>.<checksum:016x>  part i (at most a host slot)

A part's key names its checksum, so a part value is immutable: two writes of different bytes for
the same object never share a part key, and a reader never mixes parts of two writes. The
metadata is written last, with an upsert (it replaces an older one), and is the commit marker: it
lists every part's length and checksum. Objects of another identity live under another digest and
are never seen.

Metadata (little-endian): magic ``SRCM``, format version (u16), 0 (u16), part count (u32), 0 (u32),
object length (u64), the identity digest (16 bytes), a digest of the object key (16 bytes), then
per part its length and checksum (u64, u64), then a CRC-32 of all the bytes before it (u32) and 0
(u32). A value that fails any check is a corrupt object, never a guess.

An object has at most :data:`MAX_PARTS` parts (a store refuses to write more, a metadata value
that claims more is junk): what a lookup may expand one metadata value into is bounded, whatever a
rogue writes (:attr:`Layout.max_meta_bytes`: no lookup fetches a larger value).

A sealed store's objects have a layout of their own (:mod:`.sealed`, format version 2), under
an identity that ends in :data:`SEALED`: sealed and plain stores of one model never see each
other's objects. :func:`.sealed.layout_of` gives the layout of an identity either way.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"SRCM"
VERSION = 1
_HEAD = struct.Struct("<4sHHIIQ16s16s")
_PART = struct.Struct("<QQ")
_TAIL = struct.Struct("<II")
PREFIX = "saria"
SEALED = "|sealed"  # the end of a sealed store's layout identity
MAX_PARTS = 1024  # parts of one object, at most (4 GiB objects of 4 MiB parts)


def meta_bytes(parts: int) -> int:
    """Size of the metadata value of an object of ``parts`` parts."""
    return _HEAD.size + _PART.size * parts + _TAIL.size


def identity_digest(identity: str) -> bytes:
    """16 bytes standing for ``identity`` in every key and metadata value."""
    return hashlib.sha256(identity.encode()).digest()[:16]


def _key_digest(digest: bytes, key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16, key=digest).digest()


@dataclass(frozen=True)
class Meta:
    """The decoded metadata of one object: its length and each part's ``(length, checksum)``."""

    length: int
    parts: tuple[tuple[int, int], ...]


class Layout:
    """Key names and metadata values of one identity's objects."""

    def __init__(self, identity: str):
        self.identity = identity
        self.digest = identity_digest(identity)
        self._root = f"{PREFIX}/{self.digest.hex()}/"

    def meta_bytes(self, parts: int) -> int:
        """Size of the metadata value of an object of ``parts`` parts."""
        return meta_bytes(parts)

    @property
    def max_parts(self) -> int:
        """The most parts an object of this layout has (:data:`MAX_PARTS`)."""
        return MAX_PARTS

    @property
    def max_meta_bytes(self) -> int:
        """The largest metadata value an object of this layout has: a lookup fetches none larger."""
        return self.meta_bytes(MAX_PARTS)

    def peek_part_keys(self, key: bytes, value: bytes | memoryview) -> list[str]:
        """The part keys a metadata value names (``ValueError`` if it does not parse): what a lookup
        checks and a removal removes. For this layout, the checked metadata's."""
        return self.part_keys(key, self.decode(key, value))

    def prefix(self, key: bytes) -> str:
        return f"{self._root}{key.hex()}/"

    def meta_key(self, key: bytes) -> str:
        return self.prefix(key) + "m"

    def part_key(self, key: bytes, index: int, checksum: int) -> str:
        return f"{self.prefix(key)}{index}.{checksum:016x}"

    def part_keys(self, key: bytes, meta: Meta) -> list[str]:
        return [self.part_key(key, i, c) for i, (_, c) in enumerate(meta.parts)]

    def encode(self, key: bytes, parts: Sequence[tuple[int, int]]) -> bytes:
        """The metadata value of ``key`` made of ``parts`` (``(length, checksum)`` each)."""
        length = sum(n for n, _ in parts)
        body = _HEAD.pack(MAGIC, VERSION, 0, len(parts), 0, length, self.digest, _key_digest(self.digest, key))
        body += b"".join(_PART.pack(n, c) for n, c in parts)
        return body + _TAIL.pack(zlib.crc32(body), 0)

    def decode(self, key: bytes, value: bytes | memoryview) -> Meta:
        """The metadata in ``value``, checked against ``key``; ``ValueError`` saying what is wrong."""
        value = bytes(value)
        if len(value) < meta_bytes(0):
            raise ValueError(f"metadata of {len(value)} bytes is shorter than any")
        magic, version, _, nparts, _, length, digest, kdig = _HEAD.unpack_from(value)
        if magic != MAGIC:
            raise ValueError(f"metadata magic {magic!r} is not {MAGIC!r}")
        if version != VERSION:
            raise ValueError(f"metadata format version {version}, this saria reads {VERSION}")
        if nparts > MAX_PARTS:
            raise ValueError(f"metadata claims {nparts} parts, an object has at most {MAX_PARTS}")
        if len(value) != meta_bytes(nparts):
            raise ValueError(f"metadata of {len(value)} bytes for {nparts} parts (expected {meta_bytes(nparts)})")
        crc, _ = _TAIL.unpack_from(value, len(value) - _TAIL.size)
        if zlib.crc32(value[:-_TAIL.size]) != crc:
            raise ValueError("metadata CRC mismatch")
        if digest != self.digest or kdig != _key_digest(self.digest, key):
            raise ValueError("metadata of another identity or object")
        parts = tuple(_PART.unpack_from(value, _HEAD.size + i * _PART.size) for i in range(nparts))
        if nparts < 1 or sum(n for n, _ in parts) != length or any(n < 1 for n, _ in parts):
            raise ValueError(f"metadata lengths do not add up: {length} vs parts {[n for n, _ in parts]}")
        return Meta(length, parts)


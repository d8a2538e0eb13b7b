"""How a sealed store's object is laid out in Mooncake Store (format version 3): key names, the
sealed metadata value, and the contexts its parts are sealed in (docs/cluster.md "Sealed objects").

A sealed store (:class:`~saria.dataplane.cluster.store.ClusterStore` opened with a
:class:`~saria.seal.Sealer`) writes each object as ``n`` sealed part values and one sealed metadata
value, under its layout identity (which ends in :data:`~.layout.SEALED`, so plain and sealed stores
never meet)::

    saria/<identity digest: 32 hex>/<object key: hex>/m                   metadata (128 + 36 n bytes)
    saria/<identity digest: 32 hex>/<object key: hex>/<i>.<write id: 32 hex>  part i: ciphertext | tag

The object key is a chunk id with a key (the scheduler names every chunk so): no block hash, salt
or token reaches a name. The **write id** is 16 random bytes drawn for each write of an object: part
values stay immutable (two writes never share a part key, a reader never mixes them) and a name
holds no nonce, tag or digest of the bytes.

A part value is its ciphertext and GCM tag (``part length + 16`` bytes), sealed with
``PartContext(object key, i, n, object length, part length)`` under a key of its own (seal format
version 2, saria/seal/aead.py: its 24-byte random value is kept in the metadata). The metadata
value is::

    clear:  magic "SRCM" | version 3 (u16) | 0 (u16) | part count (u32) | epoch (u32) |
            key id (8) | write id (16) | random value (24)                              64 bytes
    sealed: part count (u32) | 0 (u32) | object length (u64) | layout digest (16) | write id (16) |
            per part: length (u64), epoch (u32), random value (24)             48 + 36 n bytes
            then its GCM tag                                                            16 bytes

The clear fields are what a reader needs before it can open anything (how many parts, which key
epoch and random value opened the body) and what a lookup needs to name the parts without a key;
the sealed body repeats the count and write id, so a clear field changed by anyone is caught. The
body is sealed in a context no data part can have: ``PartContext(object key, 0, 1, META_MARK +
body length, body length)`` (a data object of one part has its part's length; none reaches 2**62
bytes), so a metadata value is never accepted as a part, nor a part as metadata. The layout digest
in the body binds the part size (two stores of one sealer identity but other slot sizes).

**Version 2** (saria before per-part keys) is the same with 12-byte nonces (seal format version 1)
in place of the random values: 52 clear bytes, ``48 + 24 n`` sealed, ``116 + 24 n`` in all. Such
metadata still opens, and its parts with it; nothing writes it any more.

**Bounds.** An object has at most :data:`~.layout.MAX_PARTS` parts (a store refuses to write more):
a metadata value that claims more, or is not exactly the size its count implies, is junk. Lookups
(:mod:`.queries`) learn a value's size before they fetch it and fetch none larger than the
largest metadata an object may have, so a planted value never makes them build a key per claimed
part.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from saria.dataplane.cluster.layout import MAGIC, MAX_PARTS, SEALED, Layout
from saria.seal import PartContext, SealedPart, Sealer, Unauthentic
from saria.seal.aead import NONCE_BYTES, V1_NONCE_BYTES

VERSION = 3  # of the metadata written: parts of seal format version 2 (24-byte random values)
V2 = 2  # metadata of parts of seal format version 1 (12-byte nonces): opened, never written
VERSIONS = (VERSION, V2)
WRITE_ID_BYTES = 16
KEY_ID_BYTES = 8
META_MARK = 1 << 62  # added to the metadata body's length as its "object length" (module docstring)
_RANDOM = {VERSION: NONCE_BYTES, V2: V1_NONCE_BYTES}
_HEADS = {v: struct.Struct(f"<4sHHII{KEY_ID_BYTES}s{WRITE_ID_BYTES}s{n}s") for v, n in _RANDOM.items()}
_HEAD = _HEADS[VERSION]
_MAGIC_VERSION = struct.Struct("<4sH")
_BODY = struct.Struct(f"<IIQ16s{WRITE_ID_BYTES}s")
_PARTS = {v: struct.Struct(f"<QI{n}s") for v, n in _RANDOM.items()}
TAG_BYTES = 16


def sealed_meta_bytes(parts: int, version: int = VERSION) -> int:
    """Size of a sealed metadata value of an object of ``parts`` parts (of format ``version``)."""
    return _HEADS[version].size + _body_bytes(parts, version) + TAG_BYTES


def _body_bytes(parts: int, version: int = VERSION) -> int:
    return _BODY.size + _PARTS[version].size * parts


def new_write_id() -> bytes:
    return os.urandom(WRITE_ID_BYTES)


@dataclass(frozen=True, repr=False)
class SealedMeta:
    """The opened metadata of one sealed object: its length, write id and each part's ``(length,
    epoch, nonce)``. ``repr`` shows no write id or nonce."""

    length: int
    write_id: bytes
    parts: tuple[tuple[int, int, bytes], ...]

    def __repr__(self) -> str:
        return f"SealedMeta(length={self.length}, parts={len(self.parts)})"


class SealedLayout(Layout):
    """Key names and sealed metadata values of one sealed layout identity (module docstring)."""

    def meta_bytes(self, parts: int) -> int:
        return sealed_meta_bytes(parts)

    def part_key(self, key: bytes, index: int, write_id: bytes) -> str:  # type: ignore[override]
        return f"{self.prefix(key)}{index}.{write_id.hex()}"

    def part_keys(self, key: bytes, meta: SealedMeta) -> list[str]:  # type: ignore[override]
        return [self.part_key(key, i, meta.write_id) for i in range(len(meta.parts))]

    def peek_part_keys(self, key: bytes, value: bytes | memoryview) -> list[str]:
        """The part keys a metadata value's clear fields name, without a key (a lookup's hint, and
        what a removal removes); ``ValueError`` for a value that is no sealed metadata."""
        count, write_id = self._peek(bytes(value))
        return [self.part_key(key, i, write_id) for i in range(count)]

    @staticmethod
    def _peek(value: bytes) -> tuple[int, bytes]:
        count, version = _count(value)
        return count, _HEADS[version].unpack_from(value)[6]

    def encode(self, key: bytes, parts) -> bytes:  # type: ignore[override]
        raise TypeError("a sealed layout's metadata is sealed: use seal_meta")

    def decode(self, key: bytes, value) -> SealedMeta:  # type: ignore[override]
        raise TypeError("a sealed layout's metadata is opened with a key: use open_meta")

    # ------------------------------------------------------------------ sealing and opening

    @staticmethod
    def part_context(key: bytes, index: int, count: int, length: int, part_length: int) -> PartContext:
        return PartContext(key, index, count, length, part_length)

    @staticmethod
    def _meta_context(key: bytes, parts: int, version: int = VERSION) -> PartContext:
        n = _body_bytes(parts, version)
        return PartContext(key, 0, 1, META_MARK + n, n)

    def seal_meta(self, sealer: Sealer, key: bytes, meta: SealedMeta, out) -> None:
        """Seal ``meta`` of the object ``key`` into ``out`` (a writable buffer of exactly
        :meth:`meta_bytes` of its part count: the value to store)."""
        n = len(meta.parts)
        dest = memoryview(out).cast("B")
        if dest.nbytes != sealed_meta_bytes(n):
            raise ValueError(f"sealing metadata of {n} parts into {dest.nbytes} bytes")
        body = _BODY.pack(n, 0, meta.length, self.digest, meta.write_id)
        body += b"".join(_PARTS[VERSION].pack(length, epoch, nonce) for length, epoch, nonce in meta.parts)
        sealed = sealer.seal_into(self._meta_context(key, n), body, dest[_HEAD.size:])
        dest[:_HEAD.size] = _HEAD.pack(MAGIC, VERSION, 0, n, sealed.epoch, sealer.key_id, meta.write_id, sealed.nonce)

    def open_meta(self, sealer: Sealer, key: bytes, value) -> SealedMeta:
        """The metadata sealed in ``value`` for the object ``key`` (format version 3, or 2 as older
        saria wrote it): :class:`~saria.seal.Unauthentic` unless it is this layout's sealed
        metadata of that object under this key file, as written (``UnknownEpoch`` for an epoch the
        key file lacks). The message names nothing secret."""
        data = memoryview(value).cast("B")
        try:
            count, version = _count(data)
        except ValueError as exc:
            raise Unauthentic(f"a sealed object's metadata is junk: {exc}") from None
        magic, _, zero, count, epoch, key_id, write_id, nonce = _HEADS[version].unpack_from(data)
        if key_id != sealer.key_id:
            raise Unauthentic("a sealed object's metadata names another key file")
        body = bytearray(_body_bytes(count, version))
        sealer.open_into(self._meta_context(key, count, version), SealedPart(epoch, nonce, b""),
                         data[_HEADS[version].size:], body)
        n, _, length, digest, inner_id = _BODY.unpack_from(body)
        if n != count or inner_id != write_id or digest != self.digest:
            raise Unauthentic("a sealed object's metadata disagrees with its clear fields or its layout")
        part = _PARTS[version]
        parts = tuple(part.unpack_from(body, _BODY.size + i * part.size) for i in range(n))
        if any(p[0] < 1 for p in parts) or sum(p[0] for p in parts) != length:
            raise Unauthentic("a sealed object's part lengths do not add up")
        return SealedMeta(length, write_id, parts)


def epoch_of(value) -> int:
    """The clear epoch field of a sealed metadata value (any version: it is at bytes 12..16)."""
    return int.from_bytes(bytes(memoryview(value).cast("B")[12:16]), "little")


def _count(value) -> tuple[int, int]:
    """The part count and format version a sealed metadata value's clear fields claim, checked
    against its size and :data:`~.layout.MAX_PARTS`; ``ValueError`` saying what is wrong."""
    data = memoryview(value).cast("B")
    if data.nbytes < _HEADS[V2].size:
        raise ValueError(f"{data.nbytes} bytes are shorter than any")
    magic, version = _MAGIC_VERSION.unpack_from(data)
    if magic != MAGIC or version not in VERSIONS:
        raise ValueError("not sealed metadata (magic or format version)")
    head = _HEADS[version]
    if data.nbytes < head.size:
        raise ValueError(f"{data.nbytes} bytes are shorter than any")
    _, _, zero, count, _, _, _, _ = head.unpack_from(data)
    if zero or not 1 <= count <= MAX_PARTS:
        raise ValueError(f"a part count of {count} (an object has 1 to {MAX_PARTS})")
    if data.nbytes != sealed_meta_bytes(count, version):
        raise ValueError(f"{data.nbytes} bytes for {count} parts")
    return count, version


def layout_of(identity: str) -> Layout:
    """The layout of a store's layout identity: sealed (:class:`SealedLayout`) when it ends in
    :data:`~.layout.SEALED`, else the plain one (:class:`~.layout.Layout`)."""
    return SealedLayout(identity) if identity.endswith(SEALED) else Layout(identity)

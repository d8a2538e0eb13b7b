"""How a sealed store's object is laid out in Mooncake Store (format version 2): key names, the
sealed metadata value, and the contexts its parts are sealed in (docs/cluster.md "Sealed objects").

A sealed store (:class:`~saria.dataplane.cluster.store.ClusterStore` opened with a
:class:`~saria.seal.Sealer`) writes each object as ``n`` sealed part values and one sealed metadata
value, under its layout identity (which ends in :data:`~.layout.SEALED`, so plain and sealed stores
never meet)::

    saria/<identity digest: 32 hex>/<object key: hex>/m                   metadata (116 + 24 n bytes)
    saria/<identity digest: 32 hex>/<object key: hex>/<i>.<write id: 32 hex>  part i: ciphertext | tag

The object key is a chunk id with a key (the scheduler names every chunk so): no block hash, salt
or token reaches a name. The **write id** is 16 random bytes drawn for each write of an object: part
values stay immutable (two writes never share a part key, a reader never mixes them) and a name
holds no nonce, tag or digest of the bytes.

A part value is its ciphertext and GCM tag (``part length + 16`` bytes), sealed with
``PartContext(object key, i, n, object length, part length)``. The metadata value is::

    clear:  magic "SRCM" | version 2 (u16) | 0 (u16) | part count (u32) | epoch (u32) |
            key id (8) | write id (16) | nonce (12)                                     52 bytes
    sealed: part count (u32) | 0 (u32) | object length (u64) | layout digest (16) | write id (16) |
            per part: length (u64), epoch (u32), nonce (12)                     48 + 24 n bytes
            then its GCM tag                                                            16 bytes

The clear fields are what a reader needs before it can open anything (how many parts, which key
epoch and nonce opened the body) and what a lookup needs to name the parts without a key; the
sealed body repeats the count and write id, so a clear field changed by anyone is caught. The body
is sealed in a context no data part can have: ``PartContext(object key, 0, 1, META_MARK + body
length, body length)`` (a data object of one part has its part's length; none reaches 2**62 bytes),
so a metadata value is never accepted as a part, nor a part as metadata. The layout digest in the
body binds the part size (two stores of one sealer identity but other slot sizes).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from saria.dataplane.cluster.layout import MAGIC, SEALED, Layout
from saria.seal import NONCE_BYTES, PartContext, SealedPart, Sealer, Unauthentic

VERSION = 2
WRITE_ID_BYTES = 16
KEY_ID_BYTES = 8
META_MARK = 1 << 62  # added to the metadata body's length as its "object length" (module docstring)
_HEAD = struct.Struct(f"<4sHHII{KEY_ID_BYTES}s{WRITE_ID_BYTES}s{NONCE_BYTES}s")
_BODY = struct.Struct(f"<IIQ16s{WRITE_ID_BYTES}s")
_PART = struct.Struct(f"<QI{NONCE_BYTES}s")
TAG_BYTES = 16


def sealed_meta_bytes(parts: int) -> int:
    """Size of a sealed metadata value of an object of ``parts`` parts."""
    return _HEAD.size + _body_bytes(parts) + TAG_BYTES


def _body_bytes(parts: int) -> int:
    return _BODY.size + _PART.size * parts


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
        if len(value) < sealed_meta_bytes(0):
            raise ValueError(f"sealed metadata of {len(value)} bytes is shorter than any")
        magic, version, zero, count, _, _, write_id, _ = _HEAD.unpack_from(value)
        if magic != MAGIC or version != VERSION or zero:
            raise ValueError("not sealed metadata (magic or format version)")
        if count < 1 or len(value) != sealed_meta_bytes(count):
            raise ValueError(f"sealed metadata of {len(value)} bytes for {count} parts")
        return count, write_id

    def encode(self, key: bytes, parts) -> bytes:  # type: ignore[override]
        raise TypeError("a sealed layout's metadata is sealed: use seal_meta")

    def decode(self, key: bytes, value) -> SealedMeta:  # type: ignore[override]
        raise TypeError("a sealed layout's metadata is opened with a key: use open_meta")

    # ------------------------------------------------------------------ sealing and opening

    @staticmethod
    def part_context(key: bytes, index: int, count: int, length: int, part_length: int) -> PartContext:
        return PartContext(key, index, count, length, part_length)

    @staticmethod
    def _meta_context(key: bytes, parts: int) -> PartContext:
        n = _body_bytes(parts)
        return PartContext(key, 0, 1, META_MARK + n, n)

    def seal_meta(self, sealer: Sealer, key: bytes, meta: SealedMeta, out) -> None:
        """Seal ``meta`` of the object ``key`` into ``out`` (a writable buffer of exactly
        :meth:`meta_bytes` of its part count: the value to store)."""
        n = len(meta.parts)
        dest = memoryview(out).cast("B")
        if dest.nbytes != sealed_meta_bytes(n):
            raise ValueError(f"sealing metadata of {n} parts into {dest.nbytes} bytes")
        body = _BODY.pack(n, 0, meta.length, self.digest, meta.write_id)
        body += b"".join(_PART.pack(length, epoch, nonce) for length, epoch, nonce in meta.parts)
        sealed = sealer.seal_into(self._meta_context(key, n), body, dest[_HEAD.size:])
        dest[:_HEAD.size] = _HEAD.pack(MAGIC, VERSION, 0, n, sealed.epoch, sealer.key_id, meta.write_id, sealed.nonce)

    def open_meta(self, sealer: Sealer, key: bytes, value) -> SealedMeta:
        """The metadata sealed in ``value`` for the object ``key``: :class:`~saria.seal.Unauthentic`
        unless it is this layout's sealed metadata of that object under this key file, as written
        (``UnknownEpoch`` for an epoch the key file lacks). The message names nothing secret."""
        data = memoryview(value).cast("B")
        if data.nbytes < sealed_meta_bytes(1):
            raise Unauthentic("a sealed object's metadata is shorter than any")
        magic, version, zero, count, epoch, key_id, write_id, nonce = _HEAD.unpack_from(data)
        if magic != MAGIC or version != VERSION or zero:
            raise Unauthentic("a sealed object's metadata has another magic or format version")
        if data.nbytes != sealed_meta_bytes(count):
            raise Unauthentic("a sealed object's metadata is not the size its part count implies")
        if key_id != sealer.key_id:
            raise Unauthentic("a sealed object's metadata names another key file")
        body = bytearray(_body_bytes(count))
        sealer.open_into(self._meta_context(key, count), SealedPart(epoch, nonce, b""), data[_HEAD.size:], body)
        n, _, length, digest, inner_id = _BODY.unpack_from(body)
        if n != count or inner_id != write_id or digest != self.digest:
            raise Unauthentic("a sealed object's metadata disagrees with its clear fields or its layout")
        parts = tuple(_PART.unpack_from(body, _BODY.size + i * _PART.size) for i in range(n))
        if any(p[0] < 1 for p in parts) or sum(p[0] for p in parts) != length:
            raise Unauthentic("a sealed object's part lengths do not add up")
        return SealedMeta(length, write_id, parts)


def layout_of(identity: str) -> Layout:
    """The layout of a store's layout identity: sealed (:class:`SealedLayout`) when it ends in
    :data:`~.layout.SEALED`, else the plain one (:class:`~.layout.Layout`)."""
    return SealedLayout(identity) if identity.endswith(SEALED) else Layout(identity)

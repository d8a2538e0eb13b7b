"""Stable byte keys for SSD objects: the same chunk hash and kind give the same key in every
process and after a restart (Python's ``hash()`` would not).

A key holds its chunk hash (a vLLM block hash, or a sealed store's chunk id): token-derived, so no
message shows a key's bytes or its chunk hash (docs/security.md); :func:`describe_key` names an
object by its kind and its key's length instead."""

from __future__ import annotations

from typing import Hashable

KINDS = {"kv": b"k", "state": b"s"}
MAX_HASH_BYTES = 62  # SSD keys are at most 64 bytes: kind, type tag, hash
_KIND_OF_BYTE = {v[0]: k for k, v in KINDS.items()}


def describe_key(key: bytes) -> str:
    """How messages name the object under ``key``: ``"kv object (50-byte key)"`` (its kind when the
    key is an :func:`object_key`'s, and the key's length), never the key's bytes."""
    kind = _KIND_OF_BYTE.get(key[0]) if len(key) >= 2 and key[1:2] in (b"i", b"b", b"s") else None
    return f"{kind + ' ' if kind else ''}object ({len(key)}-byte key)"


def object_key(chunk: Hashable, kind: str) -> bytes:
    """``kind`` byte + type tag + the chunk hash's bytes.

    Chunk hashes are ints (trace block ids, 64-bit hashes), bytes (vLLM's block hashes) or str.
    """
    try:
        prefix = KINDS[kind]
    except KeyError:
        raise ValueError(f"object kind must be 'kv' or 'state', got {kind!r}") from None
    if isinstance(chunk, bool):
        raise TypeError("a chunk hash cannot be a bool")
    if isinstance(chunk, int):
        if not -(1 << 255) <= chunk < (1 << 255):
            raise ValueError(f"int chunk hash out of the 256-bit range ({chunk.bit_length()} bits)")
        body = b"i" + chunk.to_bytes(32, "little", signed=True)
    elif isinstance(chunk, (bytes, bytearray)):
        body = b"b" + bytes(chunk)
    elif isinstance(chunk, str):
        body = b"s" + chunk.encode()
    else:
        raise TypeError(f"chunk hashes must be int, bytes or str, got {type(chunk).__name__}")
    if len(body) > MAX_HASH_BYTES + 1:
        raise ValueError(f"chunk hash too long for an SSD key ({len(body) - 1} bytes > {MAX_HASH_BYTES})")
    return prefix + body


def parse_object_key(key: bytes) -> tuple[Hashable, str]:
    """The ``(chunk hash, kind)`` an :func:`object_key` was made of; ``ValueError`` for bytes no
    call of it could have made (a foreign key)."""
    def foreign() -> ValueError:  # its bytes are not shown: they may hold a chunk hash
        return ValueError(f"not a saria object key ({len(key)} bytes)")

    if len(key) < 2 or key[0] not in _KIND_OF_BYTE:
        raise foreign()
    kind, tag, body = _KIND_OF_BYTE[key[0]], key[1:2], bytes(key[2:])
    if tag == b"i" and len(body) == 32:
        chunk: Hashable = int.from_bytes(body, "little", signed=True)
    elif tag == b"b":
        chunk = body
    elif tag == b"s":
        try:
            chunk = body.decode()
        except UnicodeDecodeError:
            raise foreign() from None
    else:
        raise foreign()
    if object_key(chunk, kind) != key:
        raise foreign()
    return chunk, kind

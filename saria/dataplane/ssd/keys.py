"""Stable byte keys for SSD objects: the same chunk hash and kind give the same key in every
process and after a restart (Python's ``hash()`` would not)."""

from __future__ import annotations

from typing import Hashable

KINDS = {"kv": b"k", "state": b"s"}
MAX_HASH_BYTES = 62  # SSD keys are at most 64 bytes: kind, type tag, hash


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
            raise ValueError(f"int chunk hash out of the 256-bit range: {chunk}")
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
    kinds = {v[0]: k for k, v in KINDS.items()}
    if len(key) < 2 or key[0] not in kinds:
        raise ValueError(f"not a saria object key: {bytes(key[:16])!r}")
    kind, tag, body = kinds[key[0]], key[1:2], bytes(key[2:])
    if tag == b"i" and len(body) == 32:
        chunk: Hashable = int.from_bytes(body, "little", signed=True)
    elif tag == b"b":
        chunk = body
    elif tag == b"s":
        try:
            chunk = body.decode()
        except UnicodeDecodeError:
            raise ValueError(f"not a saria object key: {bytes(key[:16])!r}") from None
    else:
        raise ValueError(f"not a saria object key: {bytes(key[:16])!r}")
    if object_key(chunk, kind) != key:
        raise ValueError(f"not a saria object key: {bytes(key[:16])!r}")
    return chunk, kind

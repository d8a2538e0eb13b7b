"""Keys derived from a key file, and the chunk ids that name sealed objects.

Every derivation is HKDF-SHA256 (``cryptography``) or HMAC-SHA256 (the standard library's
``hmac``), each under its own label so no two uses share a key::

    tenant tag   T = HKDF(names root, info="saria tenant v1" | SHA-256(cache_salt))[:16]
    name key     N = HKDF(names root, info="saria names v1" | T)
    mask key     M = HKDF(names root, info="saria mask v1")
    seal key  K_eT = HKDF(master key of epoch e, info="saria seal v1" | T | e as u32)
    key id         = HKDF(names root, info="saria key id v1")[:8]
    label key    L = HKDF(names root, info="saria store label v1")
    store label    = "saria-sealed-v1:" | hex(HMAC(L, store identity)[:16])

A request's ``cache_salt`` selects its tenant (no salt: the empty string's tenant); the salt is
never a secret and never leaves this module: the scheduler side turns it into ``T`` and every
block hash of the request into a **chunk id** of 48 bytes::

    h        = HMAC(N, "saria chunk v1" | len(scope) | scope | block hash)     32 bytes
    chunk id = (T xor HMAC(M, h)[:16]) | h                                     48 bytes

``scope`` is what the bytes of an object depend on (model, dtype, page geometry: the caller's
string). The control plane, the orders, the data plane and every store see chunk ids only: a name
is unlinkable to its block hash, salt or tokens without the names root, and the first 16 bytes
look random per object (no two objects of a tenant share them), yet the worker, which holds the
key file, reads the tenant back from a chunk id (:meth:`Keyring.tenant_of`) to pick its seal key.
The key id is stored beside sealed objects (never logged) so a store can tell objects of another
key file apart from objects that were tampered with.

Everything a sealed store writes where others can read it derives from the naming root: the key
id, the chunk ids, and the **store label** a sealed store records and names its objects under in
place of its identity (:meth:`Keyring.store_label`: no model name, revision or layout can be read
from a superblock or a cluster key, and two stores of one identity under other key files do not
link). ``saria keys rotate`` keeps the naming root (names stay, old epochs stay readable);
``saria keys rekey`` replaces it, so nothing of the old key file stays stable: every name, label
and key id changes and every old object is a clean miss.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from saria.seal.errors import SealError, UnknownEpoch
from saria.seal.keyfile import KeyFile

TAG_BYTES = 16
HASH_BYTES = 32
CHUNK_ID_BYTES = TAG_BYTES + HASH_BYTES
KEY_ID_BYTES = 8
LABEL_PREFIX = "saria-sealed-v1:"  # a sealed store's label (:meth:`Keyring.store_label`) starts with it
LABEL_BYTES = 16


def hkdf(key: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(key)


@dataclass(frozen=True, repr=False, eq=True)
class Tenant:
    """A tenant: the tag its ``cache_salt`` selects (``repr`` never shows it)."""

    tag: bytes

    def __repr__(self) -> str:
        return "Tenant(<sealed>)"


def salt_bytes(cache_salt: str | bytes | None) -> bytes:
    if cache_salt is None:
        return b""
    if isinstance(cache_salt, str):
        return cache_salt.encode("utf-8", "surrogatepass")
    if isinstance(cache_salt, (bytes, bytearray)):
        return bytes(cache_salt)
    raise SealError(f"cache_salt must be a str, bytes or None, got {type(cache_salt).__name__}")


class Keyring:
    """The keys of one key file. Thread-safe; derived keys are cached (a few per tenant)."""

    def __init__(self, keys: KeyFile):
        self._keys = keys
        self._mask = hkdf(keys.names, b"saria mask v1")
        self.key_id = hkdf(keys.names, b"saria key id v1", KEY_ID_BYTES)
        self._label_key = hkdf(keys.names, b"saria store label v1")
        self._lock = threading.Lock()
        self._tenants: dict[bytes, Tenant] = {}
        self._name_keys: dict[bytes, bytes] = {}
        self._seal_keys: dict[tuple[int, bytes], bytes] = {}

    @staticmethod
    def load(path: str | os.PathLike) -> "Keyring":
        return Keyring(KeyFile.load(path))

    def __repr__(self) -> str:
        return f"Keyring(current={self.current_epoch}, epochs={list(self.epochs)})"

    @property
    def current_epoch(self) -> int:
        return self._keys.current

    @property
    def epochs(self) -> tuple[int, ...]:
        return tuple(sorted(self._keys.epochs))

    def store_label(self, identity: str) -> str:
        """What a sealed store records (an SSD superblock) and names its objects under (cluster
        keys) in place of ``identity``: a MAC of it under the naming root. It says nothing of the
        model, revision or layout to whoever reads the storage, differs between key files (and
        across a rekey), and is the same on every server holding this key file. Never logged."""
        if not isinstance(identity, str):
            raise SealError(f"a store identity is a str, got {type(identity).__name__}")
        mac = hmac.digest(self._label_key, identity.encode("utf-8", "surrogatepass"), "sha256")[:LABEL_BYTES]
        return LABEL_PREFIX + mac.hex()

    # ---------------------------------------------------------------- scheduler side

    def tenant(self, cache_salt: str | bytes | None) -> Tenant:
        """The tenant a request's ``cache_salt`` selects (``None``: no salt)."""
        digest = hashlib.sha256(salt_bytes(cache_salt)).digest()
        with self._lock:
            found = self._tenants.get(digest)
        if found is None:
            found = Tenant(hkdf(self._keys.names, b"saria tenant v1" + digest, TAG_BYTES))
            with self._lock:
                if len(self._tenants) > 65536:
                    self._tenants.clear()
                self._tenants[digest] = found
        return found

    def chunk_ids(self, tenant: Tenant, scope: bytes, block_hashes) -> list[bytes]:
        """The chunk id of each block hash (bytes) of ``tenant`` in ``scope``."""
        name_key = self._name_key(tenant.tag)
        head = b"saria chunk v1" + struct.pack("<I", len(scope)) + scope
        ids = []
        for block_hash in block_hashes:
            if not isinstance(block_hash, (bytes, bytearray)):
                raise SealError(f"block hashes must be bytes, got {type(block_hash).__name__}")
            h = hmac.digest(name_key, head + bytes(block_hash), "sha256")
            mask = hmac.digest(self._mask, h, "sha256")[:TAG_BYTES]
            ids.append(bytes(a ^ b for a, b in zip(tenant.tag, mask)) + h)
        return ids

    # ---------------------------------------------------------------- worker side

    def tenant_of(self, chunk_id: bytes) -> Tenant:
        """The tenant a chunk id was made for; :class:`SealError` for bytes that are not a chunk id."""
        if not isinstance(chunk_id, (bytes, bytearray)) or len(chunk_id) != CHUNK_ID_BYTES:
            raise SealError(f"a chunk id is {CHUNK_ID_BYTES} bytes")
        h = bytes(chunk_id[TAG_BYTES:])
        mask = hmac.digest(self._mask, h, "sha256")[:TAG_BYTES]
        return Tenant(bytes(a ^ b for a, b in zip(chunk_id[:TAG_BYTES], mask)))

    def seal_key(self, epoch: int, tenant: Tenant) -> bytes:
        """The AES-256 key of ``tenant`` under ``epoch``; :class:`UnknownEpoch` if the key file has
        no such epoch (retired, or a newer key file's)."""
        cache_key = (epoch, tenant.tag)
        with self._lock:
            found = self._seal_keys.get(cache_key)
        if found is not None:
            return found
        master = self._keys.epochs.get(epoch)
        if master is None:
            raise UnknownEpoch(f"key epoch {epoch} is not in the key file (retired or unknown)")
        found = hkdf(master, b"saria seal v1" + tenant.tag + struct.pack("<I", epoch))
        with self._lock:
            if len(self._seal_keys) > 65536:
                self._seal_keys.clear()
            self._seal_keys[cache_key] = found
        return found

    def _name_key(self, tag: bytes) -> bytes:
        with self._lock:
            found = self._name_keys.get(tag)
        if found is None:
            found = hkdf(self._keys.names, b"saria names v1" + tag)
            with self._lock:
                if len(self._name_keys) > 65536:
                    self._name_keys.clear()
                self._name_keys[tag] = found
        return found

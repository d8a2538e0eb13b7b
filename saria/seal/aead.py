"""AES-256-GCM sealing of store parts, each under a key of its own, bound to its place by
associated data.

A store seals each part of an object on its own (parts travel to different drives or storage
nodes and are read independently). A sealed part is its ciphertext (as long as its plaintext), a
16-byte tag, the epoch and the part's 24-byte random value ``r`` (format version 2).

**Per-part keys** (format version 2). ``K_eT`` (:meth:`Keyring.seal_key`, the epoch's key of the
tenant) is the same on every rank, store and server of a fleet, so no process can count how many
parts it sealed. Each part therefore draws ``r = os.urandom(24)`` and is sealed under a key of its
own::

    part key = HKDF-SHA256(K_eT, salt = r[0:16], info = "saria part v2")        32 bytes
    nonce    = r[16:24] | 00 00 00 00                                           12 bytes (AES-GCM)

Each derived key seals exactly one part, so GCM's per-key limits (2**32 random nonces, 2**39 - 256
bits per message) hold without any counting; the fleet-wide bound is that two parts draw the same
128-bit salt, about ``N**2 / 2**129`` for ``N`` parts (2**-33 at 2**48 parts), and even then the two
share a key under different nonces (a nonce repeat needs all 192 bits to repeat: ``N**2 / 2**193``).
docs/security.md gives the arithmetic. The associated data binds::

    "saria sealed v2" | format version (2) | the store kind ("ssd", "cluster") | the store identity
    (model, layout, rank: the store's own string) | the object's storage name | the tenant tag |
    the key id | the epoch | part index | part count | object length | part length | r (24 bytes)

so a part moved to another name, another part index, another store, another model, layout or
rank, another tenant or key file, cut short or extended, or given another part's random value,
fails its tag. The tag replaces the store's checksum on sealed objects: one pass over the bytes.

**Format version 1** (saria before per-part keys) sealed directly under ``K_eT`` with a 12-byte
random nonce and the associated data above with "saria sealed v1", version 1 and no ``r``. Parts
of version 1 still open (a :class:`SealedPart` whose value is 12 bytes is one); nothing seals
them any more. ``encrypt_into`` / ``decrypt_into`` write straight into the caller's buffer (no
extra copy).
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from saria.seal.errors import SealError, Unauthentic
from saria.seal.keys import CHUNK_ID_BYTES, Keyring, Tenant

NONCE_BYTES = 24  # a version-2 part's random value r: the key derivation's salt, then the nonce
SALT_BYTES = 16  # r[:16] salts the part key's derivation; r[16:] is the AES-GCM nonce, zero-extended
V1_NONCE_BYTES = 12  # a version-1 part's AES-GCM nonce (opened, never sealed any more)
GCM_TAG_BYTES = 16
FORMAT_VERSION = 2  # of the parts sealed now
FORMAT_VERSIONS = (1, 2)  # of the parts opened
PART_KEY_INFO = b"saria part v2"
STORE_KINDS = ("ssd", "cluster")
_NUMBERS = struct.Struct("<IIIQQ")  # epoch, part index, part count, object length, part length
_LABELS = {1: b"saria sealed v1", 2: b"saria sealed v2"}
_NONCE_VERSION = {NONCE_BYTES: 2, V1_NONCE_BYTES: 1}


def part_key(seal_key: bytes, random: bytes) -> bytes:
    """The AES-256 key of the version-2 part whose random value is ``random`` (module docstring)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=random[:SALT_BYTES], info=PART_KEY_INFO).derive(seal_key)


def part_nonce(random: bytes) -> bytes:
    """The AES-GCM nonce of the version-2 part whose random value is ``random``: its last 8 bytes,
    zero-extended to 12."""
    return random[SALT_BYTES:] + bytes(4)


@dataclass(frozen=True, repr=False)
class SealedPart:
    """What a store keeps beside a sealed part's ciphertext: its epoch, its random value
    (``nonce``: 24 bytes, format version 2; 12 bytes, the AES-GCM nonce of a version-1 part) and
    its tag. ``repr`` shows the epoch and version only."""

    epoch: int
    nonce: bytes
    tag: bytes

    @property
    def version(self) -> int:
        """The part's format version (by its random value's length); 0 for a malformed one."""
        return _NONCE_VERSION.get(len(self.nonce), 0)

    def __repr__(self) -> str:
        return f"SealedPart(epoch={self.epoch}, version={self.version})"


@dataclass(frozen=True, repr=False)
class PartContext:
    """Where a part lives: its object's storage name (at most 255 bytes), its index among ``count``
    parts, the object's length and its own. ``repr`` leaves the name out (it holds a chunk id)."""

    name: bytes
    index: int
    count: int
    object_length: int
    part_length: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, (bytes, bytearray)) or len(self.name) > 255:
            raise SealError("a part's storage name must be at most 255 bytes")
        if not (0 <= self.index < self.count <= 0xFFFFFFFF and 0 < self.part_length <= self.object_length < 1 << 64):
            raise SealError(f"inconsistent part: index {self.index} of {self.count}, {self.part_length} of "
                            f"{self.object_length} bytes")

    def __repr__(self) -> str:
        return (f"PartContext(index={self.index}, count={self.count}, object_length={self.object_length}, "
                f"part_length={self.part_length})")


class Sealer:
    """Seals and opens the parts of one store (``kind``: ``"ssd"`` or ``"cluster"``, ``identity``:
    the store's identity string). Thread-safe. Seals format version 2 (a key per part, module
    docstring), opens versions 1 and 2. Nothing is counted: no key it derives seals twice."""

    def __init__(self, keyring: Keyring, kind: str, identity: str):
        if kind not in STORE_KINDS:
            raise SealError(f"store kind must be one of {STORE_KINDS}, got {kind!r}")
        self.keyring = keyring
        ident = identity.encode()
        tail = struct.pack("<B", len(kind)) + kind.encode() + struct.pack("<I", len(ident)) + ident
        self._heads = {v: _LABELS[v] + struct.pack("<H", v) + tail for v in FORMAT_VERSIONS}
        self._lock = threading.Lock()
        self._v1: dict[tuple[int, bytes], AESGCM] = {}  # version-1 parts open under K_eT itself

    @property
    def key_id(self) -> bytes:
        """The key file's id (8 bytes, a one-way value): a store keeps it beside sealed parts to
        tell another key file's objects from tampered ones. Never log it."""
        return self.keyring.key_id

    def tenant_of_name(self, name: bytes) -> Tenant:
        """The tenant whose key seals the object named ``name``: the tenant of its chunk id (an
        object key whose last 48 bytes are one, after its kind and type bytes), else the tenant of
        no salt (objects a tool names itself)."""
        if len(name) == 2 + CHUNK_ID_BYTES and name[1:2] == b"b":
            return self.keyring.tenant_of(name[2:])
        return self.keyring.tenant(None)

    def associated_data(self, ctx: PartContext, tenant: Tenant, epoch: int, random: bytes | None = None) -> bytes:
        """The associated data of a part (module docstring): format version 2 with its random value
        ``random``, version 1 when ``random`` is ``None``."""
        head = self._heads[1 if random is None else 2]
        return (head + struct.pack("<B", len(ctx.name)) + ctx.name + tenant.tag + self.keyring.key_id
                + _NUMBERS.pack(epoch, ctx.index, ctx.count, ctx.object_length, ctx.part_length)
                + (random or b""))

    def _seal_key(self, epoch: int, tenant: Tenant) -> bytes:
        """``K_eT``: the key every part key of ``tenant`` under ``epoch`` derives from."""
        return self.keyring.seal_key(epoch, tenant)

    def _v1_aesgcm(self, epoch: int, tenant: Tenant) -> AESGCM:
        cache_key = (epoch, tenant.tag)
        with self._lock:
            aead = self._v1.get(cache_key)
        if aead is None:
            aead = AESGCM(self._seal_key(epoch, tenant))
            with self._lock:
                if len(self._v1) > 4096:
                    self._v1.clear()
                self._v1[cache_key] = aead
        return aead

    def seal_into(self, ctx: PartContext, plaintext, out) -> SealedPart:
        """Seal ``plaintext`` (``ctx.part_length`` bytes, any buffer) into ``out`` (a writable
        buffer of ``part_length + 16`` bytes: the ciphertext, then the tag) under the current
        epoch, with a fresh random value and the key it derives (format version 2)."""
        plain = memoryview(plaintext).cast("B")
        dest = memoryview(out).cast("B")
        if plain.nbytes != ctx.part_length or dest.nbytes != ctx.part_length + GCM_TAG_BYTES:
            raise SealError(f"sealing {plain.nbytes} bytes into {dest.nbytes} for a part of {ctx.part_length}")
        if dest.readonly:
            raise SealError("sealing into a read-only buffer")
        tenant = self.tenant_of_name(ctx.name)
        epoch = self.keyring.current_epoch
        random = os.urandom(NONCE_BYTES)
        aead = AESGCM(part_key(self._seal_key(epoch, tenant), random))
        aead.encrypt_into(part_nonce(random), plain, self.associated_data(ctx, tenant, epoch, random), dest)
        return SealedPart(epoch, random, bytes(dest[ctx.part_length:]))

    def open_into(self, ctx: PartContext, sealed: SealedPart, ciphertext_and_tag, out) -> None:
        """Verify and decrypt ``ciphertext_and_tag`` (``part_length + 16`` bytes) into ``out``
        (``part_length`` bytes, writable: a private staging, never memory a reader may see before this
        returns): a version-2 part (24-byte random value) under the key it derives, a version-1 part
        (12-byte nonce) under ``K_eT``. :class:`Unauthentic` if the tag fails (``out`` is then
        zeroed: no unverified plaintext is left behind), :class:`UnknownEpoch` for an epoch the
        key file lacks."""
        data = memoryview(ciphertext_and_tag).cast("B")
        dest = memoryview(out).cast("B")
        if dest.readonly:
            raise SealError("opening into a read-only buffer")
        if data.nbytes != ctx.part_length + GCM_TAG_BYTES or dest.nbytes != ctx.part_length:
            raise Unauthentic("a sealed part's length does not match its place")
        version = sealed.version
        if not version:
            raise Unauthentic("a sealed part's nonce is malformed")
        tenant = self.tenant_of_name(ctx.name)
        if version == 2:
            aead = AESGCM(part_key(self._seal_key(sealed.epoch, tenant), sealed.nonce))
            nonce, ad = part_nonce(sealed.nonce), self.associated_data(ctx, tenant, sealed.epoch, sealed.nonce)
        else:
            aead = self._v1_aesgcm(sealed.epoch, tenant)
            nonce, ad = sealed.nonce, self.associated_data(ctx, tenant, sealed.epoch)
        try:
            aead.decrypt_into(nonce, data, ad, dest)
        except InvalidTag:
            dest[:] = bytes(dest.nbytes)
            raise Unauthentic("a sealed part failed its authentication tag") from None

"""AES-256-GCM sealing of store parts, bound to their place by associated data.

A store seals each part of an object on its own (parts travel to different drives or storage
nodes and are read independently). A sealed part is its ciphertext (as long as its plaintext), a
16-byte tag, the epoch and the 96-bit random nonce. The associated data binds::

    "saria sealed v1" | format version | the store kind ("ssd", "cluster") | the store identity
    (model, layout, rank: the store's own string) | the object's storage name | the tenant tag |
    the key id | the epoch | part index | part count | object length | part length

so a part moved to another name, another part index, another store, another model, layout or
rank, another tenant or key file, or cut short or extended, fails its tag. The tag replaces the
store's checksum on sealed objects: one pass over the bytes.

Nonces are random (``os.urandom``); each (epoch, tenant) key seals at most 2**32 parts in a process
(NIST SP 800-38D's bound for random nonces), then :class:`SealError` asks for a rotation.
``encrypt_into`` / ``decrypt_into`` write straight into the caller's buffer (no extra copy).
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from saria.seal.errors import SealError, Unauthentic
from saria.seal.keys import CHUNK_ID_BYTES, Keyring, Tenant

NONCE_BYTES = 12
GCM_TAG_BYTES = 16
FORMAT_VERSION = 1
MAX_SEALS_PER_KEY = 1 << 32
STORE_KINDS = ("ssd", "cluster")
_NUMBERS = struct.Struct("<IIIQQ")  # epoch, part index, part count, object length, part length


@dataclass(frozen=True, repr=False)
class SealedPart:
    """What a store keeps beside a sealed part's ciphertext: its epoch, nonce and tag."""

    epoch: int
    nonce: bytes
    tag: bytes

    def __repr__(self) -> str:
        return f"SealedPart(epoch={self.epoch})"


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
    the store's identity string). Thread-safe."""

    def __init__(self, keyring: Keyring, kind: str, identity: str):
        if kind not in STORE_KINDS:
            raise SealError(f"store kind must be one of {STORE_KINDS}, got {kind!r}")
        self.keyring = keyring
        ident = identity.encode()
        self._head = (b"saria sealed v1" + struct.pack("<HB", FORMAT_VERSION, len(kind)) + kind.encode()
                      + struct.pack("<I", len(ident)) + ident)
        self._lock = threading.Lock()
        self._aead: dict[tuple[int, bytes], AESGCM] = {}
        self._uses: dict[tuple[int, bytes], int] = {}

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

    def associated_data(self, ctx: PartContext, tenant: Tenant, epoch: int) -> bytes:
        return (self._head + struct.pack("<B", len(ctx.name)) + ctx.name + tenant.tag + self.keyring.key_id
                + _NUMBERS.pack(epoch, ctx.index, ctx.count, ctx.object_length, ctx.part_length))

    def _aesgcm(self, epoch: int, tenant: Tenant, sealing: bool) -> AESGCM:
        cache_key = (epoch, tenant.tag)
        with self._lock:
            aead = self._aead.get(cache_key)
            if sealing:
                uses = self._uses.get(cache_key, 0)
                if uses >= MAX_SEALS_PER_KEY:
                    raise SealError(f"the key of epoch {epoch} sealed {MAX_SEALS_PER_KEY} parts in this process: "
                                    "rotate the key file (saria keys rotate) and restart")
                self._uses[cache_key] = uses + 1
        if aead is None:
            aead = AESGCM(self.keyring.seal_key(epoch, tenant))
            with self._lock:
                if len(self._aead) > 4096:
                    self._aead.clear()
                self._aead[cache_key] = aead
        return aead

    def seal_into(self, ctx: PartContext, plaintext, out) -> SealedPart:
        """Seal ``plaintext`` (``ctx.part_length`` bytes, any buffer) into ``out`` (a writable
        buffer of ``part_length + 16`` bytes: the ciphertext, then the tag) under the current epoch."""
        plain = memoryview(plaintext).cast("B")
        dest = memoryview(out).cast("B")
        if plain.nbytes != ctx.part_length or dest.nbytes != ctx.part_length + GCM_TAG_BYTES:
            raise SealError(f"sealing {plain.nbytes} bytes into {dest.nbytes} for a part of {ctx.part_length}")
        if dest.readonly:
            raise SealError("sealing into a read-only buffer")
        tenant = self.tenant_of_name(ctx.name)
        epoch = self.keyring.current_epoch
        aead = self._aesgcm(epoch, tenant, sealing=True)
        nonce = os.urandom(NONCE_BYTES)
        aead.encrypt_into(nonce, plain, self.associated_data(ctx, tenant, epoch), dest)
        return SealedPart(epoch, nonce, bytes(dest[ctx.part_length:]))

    def open_into(self, ctx: PartContext, sealed: SealedPart, ciphertext_and_tag, out) -> None:
        """Verify and decrypt ``ciphertext_and_tag`` (``part_length + 16`` bytes) into ``out``
        (``part_length`` bytes, writable: a private staging, never memory a reader may see before this
        returns). :class:`Unauthentic` if the tag fails (``out`` is then zeroed: no unverified
        plaintext is left behind), :class:`UnknownEpoch` for an epoch the key file lacks."""
        data = memoryview(ciphertext_and_tag).cast("B")
        dest = memoryview(out).cast("B")
        if dest.readonly:
            raise SealError("opening into a read-only buffer")
        if data.nbytes != ctx.part_length + GCM_TAG_BYTES or dest.nbytes != ctx.part_length:
            raise Unauthentic("a sealed part's length does not match its place")
        if len(sealed.nonce) != NONCE_BYTES:
            raise Unauthentic("a sealed part's nonce is malformed")
        tenant = self.tenant_of_name(ctx.name)
        aead = self._aesgcm(sealed.epoch, tenant, sealing=False)
        try:
            aead.decrypt_into(sealed.nonce, data, self.associated_data(ctx, tenant, sealed.epoch), dest)
        except InvalidTag:
            dest[:] = bytes(dest.nbytes)
            raise Unauthentic("a sealed part failed its authentication tag") from None

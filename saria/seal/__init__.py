"""Sealed objects for shared tiers (docs/security.md): a key file, keys derived from it per tenant
and epoch, storage names that disclose nothing, and AES-256-GCM sealing of every part a store
writes with associated data that binds it to its place.

Pure Python over ``cryptography`` (no torch): the vLLM scheduler side uses :class:`Keyring` to
name chunks, the data plane's stores use :class:`Sealer` to seal and open their parts.
"""

from saria.seal.errors import KeyFileError, SealError, SealFailure, UnknownEpoch, Unauthentic
from saria.seal.keyfile import KeyFile, new_key_file, rekey_key_file, retire_epoch, rotate_key_file
from saria.seal.keys import CHUNK_ID_BYTES, TAG_BYTES, Keyring, Tenant
from saria.seal.aead import NONCE_BYTES, PartContext, SealedPart, Sealer

__all__ = ["CHUNK_ID_BYTES", "KeyFile", "KeyFileError", "Keyring", "NONCE_BYTES", "PartContext", "SealError",
           "SealFailure", "SealedPart", "Sealer", "TAG_BYTES", "Tenant", "UnknownEpoch", "Unauthentic",
           "new_key_file", "rekey_key_file", "retire_epoch", "rotate_key_file"]

"""The connector's keys (``secret_file``, docs/security.md): loaded at start by both halves, the
scheduler's chunk ids, and what the start says about sealing.

* :func:`load_keyring`: the key file of the settings (``None`` without one); a key file that
  cannot be used (missing, readable by group or other, malformed) fails the start with its one
  line (:class:`~saria.seal.KeyFileError`). The scheduler process and every worker process load it.
* :class:`ChunkNames` (scheduler half): with a key, every chunk hash the scheduler hands to the
  control plane, the orders and the cluster lookups is a **chunk id**,
  ``keyring.chunk_ids(keyring.tenant(request.cache_salt), scope, block_hashes)``: a MAC of vLLM's
  block hash under the tenant's naming key, so no store, order, log line or metric sees a block
  hash, and two tenants' (two salts') names never meet. The request's salt is read here and never
  leaves (the worker reads the tenant back from the chunk id, :meth:`~saria.seal.Keyring.tenant_of`).
  Without a key, the chunk hash is vLLM's block hash, as before. After a reset of the connector
  (:mod:`.resets`: the weights may have changed) every name also depends on that generation's
  random nonce: the scope's ``weights`` field with a key, a keyed BLAKE2b of the block hash without
  one, so no object named before the reset (in any tier, after a restart too) is found again.
* :func:`seal_scope`: what an object's bytes depend on that the scheduler knows (the model identity
  and the page geometry; not the rank: every rank's shard of a chunk has the chunk's one name).
* :func:`announce`: one line at start, a warning where objects that leave the process (SSD, cluster)
  are neither sealed nor authenticated.

No secret, salt, chunk id or block hash is logged or put in an exception here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Hashable, Mapping, Sequence

from saria.seal import Keyring, Tenant
from saria.seal.keys import salt_bytes

from .settings import ConnectorSettings

log = logging.getLogger("saria.vllm")

SCOPE_VERSION = 1
MAX_CACHED_REQUESTS = 1 << 16  # requests whose chunk ids are kept (each is forgotten when it finishes)


def load_keyring(settings: ConnectorSettings) -> Keyring | None:
    """The settings' key file as a :class:`~saria.seal.Keyring` (``None`` without ``secret_file``).
    :class:`~saria.seal.KeyFileError` (one line naming the path) if it cannot be used."""
    if not settings.secret_file:
        return None
    return Keyring.load(settings.secret_file)


def seal_scope(model: Mapping[str, Any], *, block_size: int, hash_tokens: int, chunk_tokens: int,
               kv_bytes_per_token: int, kv_element_bytes: int, state_bytes: int) -> bytes:
    """The ``scope`` of this server's chunk ids: canonical JSON of the model identity
    (:func:`~.layout.model_identity`: model, revision, config digest, dtypes, block hashing) and the
    object geometry. Two servers of one model and geometry name a chunk alike (the cluster tier finds
    it across replicas); another model's or geometry's names never collide with these."""
    doc = {"saria_scope": SCOPE_VERSION, **model, "block_size": block_size, "hash_tokens": hash_tokens,
           "chunk_tokens": chunk_tokens, "kv_bytes_per_token": kv_bytes_per_token,
           "kv_element_bytes": kv_element_bytes, "state_bytes": state_bytes}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def with_weights(scope: bytes, weights: bytes) -> bytes:
    """``scope`` (:func:`seal_scope`'s canonical JSON) with the weights generation's nonce folded in
    (``weights``: ``b""`` for the weights loaded at start, ``scope`` unchanged)."""
    if not weights:
        return scope
    doc = json.loads(scope) if scope else {}
    doc["weights"] = weights.hex()
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class ChunkNames:
    """The names the scheduler half gives a request's chunks: vLLM's block hashes without a key,
    chunk ids with one (module docstring). A request's chunk ids are computed once (block hashes are
    prefix-chained: a longer prompt's first ids are its shorter prefix's) and kept until
    :meth:`forget`."""

    def __init__(self, keyring: Keyring | None, scope: bytes = b"", weights: bytes = b""):
        self.keyring = keyring
        self.weights = weights  # the weights generation's nonce (:mod:`.resets`); b"": the weights loaded at start
        self.scope = with_weights(scope, weights) if keyring is not None else scope
        self._requests: dict[str, tuple[Any, Tenant, list[bytes]]] = {}  # request id -> (request, tenant, ids)

    @property
    def sealed(self) -> bool:
        return self.keyring is not None

    @property
    def renamed(self) -> bool:
        """Whether names differ from vLLM's block hashes (a key file, or weights updated since start)."""
        return self.keyring is not None or bool(self.weights)

    def names(self, request: Any, hashes: Sequence[bytes]) -> list:
        """The names of ``hashes``, the request's chunk hashes in order from its first chunk."""
        if self.keyring is None:
            if not self.weights:
                return list(hashes)
            return [hashlib.blake2b(bytes(h), key=self.weights, digest_size=32).digest() for h in hashes]
        found = self._requests.get(request.request_id)
        if found is None or found[0] is not request:  # a new request (or a request id used again)
            if len(self._requests) >= MAX_CACHED_REQUESTS:
                self._requests.clear()  # a bound, not a cache policy: each request is forgotten when it ends
            found = (request, self.keyring.tenant(getattr(request, "cache_salt", None)), [])
            self._requests[request.request_id] = found
        _, tenant, ids = found
        if len(ids) < len(hashes):
            ids += self.keyring.chunk_ids(tenant, self.scope, hashes[len(ids):])
        return ids[:len(hashes)]

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def tenant_of(self, request: Any) -> Hashable:
        """The request's tenant, for its cache hints (:mod:`saria.control.hints`: a session or a pin
        is its tenant's own): with a key file the tenant's tag (as its chunk ids), without one the
        SHA-256 digest of its ``cache_salt``; None for a request without a salt and no key file.
        Never logged."""
        salt = getattr(request, "cache_salt", None)
        if self.keyring is not None:
            found = self._requests.get(request.request_id)
            tenant = found[1] if found is not None and found[0] is request else self.keyring.tenant(salt)
            return tenant.tag
        if salt is None:
            return None
        return hashlib.sha256(salt_bytes(salt)).digest()


def _shared_tiers(settings: ConnectorSettings) -> list[str]:
    """The configured tiers whose objects leave the process: SSD (``ssd_paths``) and the cluster tier."""
    return [name for name, on in (("SSD", bool(settings.ssd_paths)), ("cluster", bool(settings.cluster))) if on]


def unsealed_tiers(settings: ConnectorSettings) -> list[str]:
    """The tiers whose objects leave the process unsealed: every shared tier without a key; none with one."""
    return [] if settings.sealed else _shared_tiers(settings)


def describe(settings: ConnectorSettings, keyring: Keyring | None) -> str:
    """What the start says about sealing (no path of a key file beyond the one the user gave, no
    key material: the epochs only)."""
    tiers = _shared_tiers(settings)
    if keyring is not None:
        where = " and ".join(tiers) + " objects" if tiers else "objects of the SSD and cluster tiers (none configured)"
        return (f"{where} sealed (AES-256-GCM) and named by MACs per tenant, with key file {settings.secret_file} "
                f"(epoch {keyring.current_epoch} current, {len(keyring.epochs)} readable)")
    unsealed = unsealed_tiers(settings)
    if not unsealed:
        return "no key file (secret_file): DRAM objects stay in this server's memory, nothing is written elsewhere"
    extra = " (cluster_insecure)" if settings.cluster else ""
    return (f"{' and '.join(unsealed)} objects are neither sealed nor authenticated{extra}: whoever can write the "
            f"SSD directories or reach the cluster can read prompts' KV or plant KV that is served; give secret_file "
            f"(saria serve --secret-file PATH, made by saria keys new PATH)")


def announce(settings: ConnectorSettings, keyring: Keyring | None) -> None:
    """One line at start (the scheduler half): a warning where SSD or cluster objects are unsealed."""
    text = describe(settings, keyring)
    if keyring is None and unsealed_tiers(settings):
        log.warning("saria: %s", text)
    else:
        log.info("saria: %s", text)

"""saria.seal under attack: sealed parts round-trip, and every change of a sealed part's bytes or of
anything its associated data binds is a failure, never bytes; tenants, scopes and key files give
unlinkable chunk ids; rotation and retirement; the per-key limit; nonces; threads; nothing secret in
a repr or a message. The derivations and the associated data are checked against an independent
implementation of what saria/seal/keys.py and aead.py document (so a change to either fails here).
Key file refusals and ``saria keys`` are in test_seal_keyfile.py."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.dataplane.ssd.keys import object_key
from saria.seal import (CHUNK_ID_BYTES, KeyFile, Keyring, PartContext, SealedPart, Sealer, SealError, SealFailure,
                        UnknownEpoch, Unauthentic, new_key_file, retire_epoch, rotate_key_file)
from saria.seal import aead as aead_module

IDENTITY = "model=qwen3-tiny;dtype=bfloat16;pages=32x2048;tp=0/1"
SCOPE = b"qwen3-tiny|bfloat16|32"
SALT = "tenant-A-salt-4c1f9e"
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)


@pytest.fixture
def key_path(tmp_path):
    path = tmp_path / "saria.key"
    new_key_file(path)
    return path


@pytest.fixture
def keyring(key_path):
    return Keyring.load(key_path)


def name_of(keyring, salt=SALT, block_hash=b"\x01" * 32, kind="kv", scope=SCOPE):
    (chunk_id,) = keyring.chunk_ids(keyring.tenant(salt), scope, [block_hash])
    return object_key(chunk_id, kind)


def seal(sealer, plaintext: bytes, name: bytes, index=0, count=1, object_length=None):
    ctx = PartContext(name, index, count, object_length or len(plaintext), len(plaintext))
    out = bytearray(len(plaintext) + 16)
    return ctx, sealer.seal_into(ctx, plaintext, out), bytes(out)


def opened(sealer, ctx, sealed, blob) -> bytes:
    out = bytearray(b"\xaa" * ctx.part_length)
    sealer.open_into(ctx, sealed, blob, out)
    return bytes(out)


def refused(sealer, ctx, sealed, blob, error=Unauthentic):
    """Opening fails with ``error`` and leaves no byte it decrypted in the output: zeros after a
    failed tag, else the output untouched."""
    fill = b"\xaa" * ctx.part_length
    out = bytearray(fill)
    with pytest.raises(error):
        sealer.open_into(ctx, sealed, blob, out)
    assert out in (fill, bytes(len(out))), "unverified plaintext left in the output"


# ------------------------------------------------------------------ round trips


@SLOW
@given(size=st.integers(1, 200_000), count=st.integers(1, 6), kind=st.sampled_from(["ssd", "cluster"]),
       salt=st.one_of(st.none(), st.text(max_size=20), st.binary(max_size=20)), data=st.data())
def test_round_trip_any_size(key_path, keyring, size, count, kind, salt, data):
    sealer = Sealer(keyring, kind, IDENTITY)
    index = data.draw(st.integers(0, count - 1))
    plaintext = os.urandom(size)
    name = name_of(keyring, salt, os.urandom(32), data.draw(st.sampled_from(["kv", "state"])))
    ctx, sealed, blob = seal(sealer, plaintext, name, index, count, size * count)
    # encrypted: a short ciphertext may equal its plaintext by chance (a byte: 1 in 256), 16 bytes never do
    assert (size < 16 or blob[:size] != plaintext) and len(sealed.nonce) == 24 and sealed.tag == blob[size:]
    assert sealed.epoch == keyring.current_epoch
    assert opened(sealer, ctx, sealed, blob) == plaintext
    # a store reopened with the same key file (a restart) opens it too
    assert opened(Sealer(Keyring.load(key_path), kind, IDENTITY), ctx, sealed, blob) == plaintext


def test_round_trip_into_torch_and_numpy_buffers(keyring):
    import numpy as np
    import torch

    sealer = Sealer(keyring, "ssd", IDENTITY)
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    ctx = PartContext(name_of(keyring), 0, 1, 4096, 4096)
    staging = torch.zeros(4096 + 16, dtype=torch.uint8)
    sealed = sealer.seal_into(ctx, src.numpy(), staging.numpy())
    back = np.zeros(4096, dtype=np.uint8)
    sealer.open_into(ctx, sealed, staging.numpy(), back)
    assert torch.equal(torch.from_numpy(back), src)


def test_names_not_chunk_ids_use_the_tenant_of_no_salt(keyring):
    """A name that is not an object key of a chunk id (a tool's own) is sealed under no salt's key."""
    sealer = Sealer(keyring, "cluster", IDENTITY)
    assert sealer.tenant_of_name(b"saria-meta/whatever") == keyring.tenant(None)
    assert sealer.tenant_of_name(name_of(keyring, "x")) == keyring.tenant("x")
    ctx, sealed, blob = seal(sealer, b"meta" * 10, b"saria-meta/whatever")
    assert opened(sealer, ctx, sealed, blob) == b"meta" * 10


# ------------------------------------------------------------------ tampering


def test_every_single_bit_flip_of_ciphertext_tag_and_nonce_fails(keyring):
    sealer = Sealer(keyring, "ssd", IDENTITY)
    ctx, sealed, blob = seal(sealer, os.urandom(256), name_of(keyring))
    for bit in range(len(blob) * 8):
        flipped = bytearray(blob)
        flipped[bit // 8] ^= 1 << (bit % 8)
        refused(sealer, ctx, sealed, bytes(flipped))
    for bit in range(len(sealed.nonce) * 8):  # the random value: its salt and its nonce bits alike
        nonce = bytearray(sealed.nonce)
        nonce[bit // 8] ^= 1 << (bit % 8)
        refused(sealer, ctx, SealedPart(sealed.epoch, bytes(nonce), sealed.tag), blob)
    for nonce in (b"", sealed.nonce[:11], sealed.nonce[:12], sealed.nonce[:23], sealed.nonce + b"\0"):
        refused(sealer, ctx, SealedPart(sealed.epoch, nonce, sealed.tag), blob)
    assert opened(sealer, ctx, sealed, blob) is not None  # the untouched part still opens


def test_truncation_and_extension_fail(keyring):
    sealer = Sealer(keyring, "cluster", IDENTITY)
    plaintext = os.urandom(1000)
    ctx, sealed, blob = seal(sealer, plaintext, name_of(keyring))
    for cut in (1, 15, 16, 17, 500, 999):
        refused(sealer, ctx, sealed, blob[:-cut])  # the stored part is shorter than its place says
        short = PartContext(ctx.name, 0, 1, 1000 - cut, 1000 - cut)  # ...and its place agrees
        refused(sealer, short, sealed, blob[:1000 - cut] + blob[-16:])  # its end cut off
        refused(sealer, short, sealed, blob[cut:])  # its start cut off
    for extra in (b"\0", os.urandom(16), os.urandom(4096)):
        refused(sealer, ctx, sealed, blob + extra)
        longer = PartContext(ctx.name, 0, 1, 1000 + len(extra), 1000 + len(extra))
        refused(sealer, longer, sealed, blob[:1000] + extra + blob[1000:])
        refused(sealer, longer, sealed, blob + extra)


def test_every_bound_field_changed_fails(keyring, tmp_path):
    """Each field of the associated data, changed alone where it can be: the part fails its tag."""
    sealer = Sealer(keyring, "cluster", IDENTITY)
    name = name_of(keyring)
    ctx, sealed, blob = seal(sealer, os.urandom(512), name, index=1, count=3, object_length=1500)
    assert opened(sealer, ctx, sealed, blob)

    def place(**changes):
        fields = dict(name=ctx.name, index=ctx.index, count=ctx.count, object_length=ctx.object_length,
                      part_length=ctx.part_length)
        return PartContext(**{**fields, **changes})

    chunk_id = name[2:]
    other_object = name_of(keyring, block_hash=b"\x02" * 32)
    same_hash_other_tenant = name[:2] + bytes(b ^ 1 for b in chunk_id[:16]) + chunk_id[16:]
    for moved in (other_object, object_key(chunk_id, "state"), same_hash_other_tenant, name_of(keyring, "B"),
                  b"k" + name[1:-1] + bytes([name[-1] ^ 1]), name + b"\0", b"saria-meta/x"):
        refused(sealer, place(name=moved), sealed, blob)
    for index in (0, 2):
        refused(sealer, place(index=index), sealed, blob)
    for count in (2, 4, 1 << 20):
        refused(sealer, place(count=count), sealed, blob)
    for object_length in (512, 1499, 1501, 1 << 40):
        refused(sealer, place(object_length=object_length), sealed, blob)
    for other in (Sealer(keyring, "cluster", IDENTITY + " "), Sealer(keyring, "cluster", IDENTITY.replace("0/1", "1/2")),
                  Sealer(keyring, "cluster", ""), Sealer(keyring, "ssd", IDENTITY)):
        refused(other, ctx, sealed, blob)
    # the key id alone (same seal keys, another key id in the associated data)
    twin = Sealer(Keyring(KeyFile.load(tmp_path / "saria.key")), "cluster", IDENTITY)
    twin.keyring.key_id = bytes(b ^ 0x80 for b in twin.keyring.key_id)
    refused(twin, ctx, sealed, blob)
    # another key file: other names root (tenant tags, key id) and other master keys
    refused(Sealer(Keyring(new_key_file(tmp_path / "b.key")), "cluster", IDENTITY), ctx, sealed, blob)
    # the epoch: a rotated key file holds both; the part claims the other one
    rotate_key_file(tmp_path / "saria.key")
    rotated = Sealer(Keyring.load(tmp_path / "saria.key"), "cluster", IDENTITY)
    assert opened(rotated, ctx, sealed, blob)
    refused(rotated, ctx, SealedPart(2, sealed.nonce, sealed.tag), blob)
    refused(rotated, ctx, SealedPart(3, sealed.nonce, sealed.tag), blob, UnknownEpoch)


def test_tenant_and_epoch_are_bound_even_under_one_aes_key(keyring):
    """Belt and braces: with the AES key held fixed, the associated data alone differs per tenant
    and epoch (so a key derivation that ever collided would still not let a part move)."""
    sealer = Sealer(keyring, "ssd", IDENTITY)
    ctx = PartContext(name_of(keyring), 0, 1, 64, 64)
    tenant = sealer.tenant_of_name(ctx.name)
    ads = {sealer.associated_data(ctx, tenant, 1), sealer.associated_data(ctx, keyring.tenant("other"), 1),
           sealer.associated_data(ctx, tenant, 2)}
    assert len(ads) == 3
    key = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    blob = key.encrypt(nonce, b"x" * 64, sealer.associated_data(ctx, tenant, 1))
    for ad in ads - {sealer.associated_data(ctx, tenant, 1)}:
        with pytest.raises(InvalidTag):
            key.decrypt(nonce, blob, ad)


def test_swapped_objects_and_parts_fail(keyring):
    sealer = Sealer(keyring, "cluster", IDENTITY)
    a, b = name_of(keyring, block_hash=b"a" * 32), name_of(keyring, block_hash=b"b" * 32)
    parts_a = [seal(sealer, os.urandom(300), a, i, 2, 600) for i in range(2)]
    parts_b = [seal(sealer, os.urandom(300), b, i, 2, 600) for i in range(2)]
    for (ctx_a, sealed_a, blob_a), (ctx_b, sealed_b, blob_b) in zip(parts_a, parts_b):
        refused(sealer, ctx_a, sealed_b, blob_b)  # b's part under a's name
        refused(sealer, ctx_b, sealed_a, blob_a)
    (c0, s0, b0), (c1, s1, b1) = parts_a
    refused(sealer, c0, s1, b1)  # a's parts swapped with each other
    refused(sealer, c1, s0, b0)
    refused(sealer, c0, SealedPart(s0.epoch, s1.nonce, s0.tag), b0)  # another part's nonce


# ------------------------------------------------------------------ tenants and chunk ids


@SLOW
@given(salt_a=st.one_of(st.none(), st.text(max_size=30)), salt_b=st.one_of(st.none(), st.text(max_size=30)),
       hashes_=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8, unique=True))
def test_chunk_ids_carry_their_tenant_and_nothing_else(keyring, salt_a, salt_b, hashes_):
    a, b = keyring.tenant(salt_a), keyring.tenant(salt_b)
    ids_a = keyring.chunk_ids(a, SCOPE, hashes_)
    assert all(len(i) == CHUNK_ID_BYTES and keyring.tenant_of(i) == a for i in ids_a)
    assert ids_a == keyring.chunk_ids(a, SCOPE, hashes_)  # deterministic
    assert len({i[:16] for i in ids_a}) == len(ids_a)  # no two objects of a tenant share their first bytes
    assert not any(h in i for h in hashes_ if len(h) >= 8 for i in ids_a)
    if (salt_a or "") != (salt_b or ""):
        assert a != b
        ids_b = keyring.chunk_ids(b, SCOPE, hashes_)
        assert not set(ids_a) & set(ids_b) and not {i[16:] for i in ids_a} & {i[16:] for i in ids_b}
        assert all(keyring.tenant_of(i) == b for i in ids_b)
    assert not set(ids_a) & set(keyring.chunk_ids(a, SCOPE + b"x", hashes_))


def test_salt_forms_and_scopes(keyring, tmp_path):
    assert keyring.tenant(None) == keyring.tenant("") == keyring.tenant(b"")  # no salt: the empty salt
    assert keyring.tenant("é") == keyring.tenant("é".encode())
    assert keyring.tenant("a") != keyring.tenant("A")
    with pytest.raises(SealError):
        keyring.tenant(3)
    with pytest.raises(SealError):
        keyring.chunk_ids(keyring.tenant(None), SCOPE, ["not bytes"])
    for bad in (b"", b"x" * 47, b"x" * 49, "x" * 48):
        with pytest.raises(SealError):
            keyring.tenant_of(bad)
    scopes = [b"", b"a", b"ab", b"a\0", b"\0a"]  # the scope is length-prefixed: no two collide
    assert len({keyring.chunk_ids(keyring.tenant(None), s, [b"h"])[0] for s in scopes}) == len(scopes)
    # another key file: other ids for the same tenant and hash; a restart: the same ids
    other = Keyring(new_key_file(tmp_path / "b.key"))
    assert other.chunk_ids(other.tenant(SALT), SCOPE, [b"h"]) != keyring.chunk_ids(keyring.tenant(SALT), SCOPE, [b"h"])
    again = Keyring.load(tmp_path / "saria.key")
    assert again.chunk_ids(again.tenant(SALT), SCOPE, [b"h"]) == keyring.chunk_ids(keyring.tenant(SALT), SCOPE, [b"h"])


def test_a_part_of_tenant_a_under_tenant_b_s_name_fails(keyring):
    """Tenant A's part (its key) planted where tenant B's object of the same prompt lives."""
    sealer = Sealer(keyring, "cluster", IDENTITY)
    block = hashlib.sha256(b"the system prompt").digest()
    ctx_a, sealed, blob = seal(sealer, os.urandom(400), name_of(keyring, "A", block))
    refused(sealer, PartContext(name_of(keyring, "B", block), 0, 1, 400, 400), sealed, blob)


# ------------------------------------------------------------------ rotation and retirement


def test_rotation_keeps_old_epochs_readable_and_retirement_makes_them_misses(key_path, keyring):
    sealer1 = Sealer(keyring, "ssd", IDENTITY)
    name = name_of(keyring)
    old = seal(sealer1, b"epoch one" * 20, name)
    assert old[1].epoch == 1
    rotate_key_file(key_path)
    ring2 = Keyring.load(key_path)
    assert ring2.current_epoch == 2 and ring2.epochs == (1, 2) and ring2.key_id == keyring.key_id
    assert name_of(ring2) == name  # names do not change with the epoch
    sealer2 = Sealer(ring2, "ssd", IDENTITY)
    new = seal(sealer2, b"epoch two" * 20, name)
    assert new[1].epoch == 2
    assert opened(sealer2, *old) == b"epoch one" * 20 and opened(sealer2, *new) == b"epoch two" * 20
    refused(sealer1, *new, error=UnknownEpoch)  # a server that lacks the new epoch misses
    retire_epoch(key_path, 1)
    ring3 = Keyring.load(key_path)
    assert ring3.epochs == (2,)
    sealer3 = Sealer(ring3, "ssd", IDENTITY)
    refused(sealer3, *old, error=UnknownEpoch)
    assert opened(sealer3, *new) == b"epoch two" * 20
    assert issubclass(UnknownEpoch, SealFailure) and issubclass(Unauthentic, SealFailure)


# ------------------------------------------------------------------ limits, nonces, threads


def test_every_part_is_sealed_under_a_key_of_its_own(keyring):
    """No count, no limit: 20,000 parts of one tenant and epoch, each under the key its own random
    value derives (format version 2), all open; the counter of version 1 is gone."""
    sealer = Sealer(keyring, "ssd", IDENTITY)
    name = name_of(keyring)
    parts = [seal(sealer, b"p" * 32, name) for _ in range(20_000)]
    assert not hasattr(aead_module, "MAX_SEALS_PER_KEY")
    assert all(s.version == 2 and len(s.nonce) == 24 for _, s, _ in parts)
    k_et = keyring.seal_key(keyring.current_epoch, keyring.tenant(SALT))
    assert len({aead_module.part_key(k_et, s.nonce) for _, s, _ in parts[:2000]}) == 2000
    assert all(opened(sealer, *p) == b"p" * 32 for p in parts[::97])


def test_nonces_are_unique_and_ciphertexts_differ(keyring):
    sealer = Sealer(keyring, "ssd", IDENTITY)
    name = name_of(keyring)
    parts = [seal(sealer, b"same bytes" * 4, name) for _ in range(20_000)]
    assert len({s.nonce for _, s, _ in parts}) == len(parts)
    assert len({b for _, _, b in parts}) == len(parts)


def test_threads_seal_and_open_at_once(keyring):
    """8 threads, 4 tenants, seals and opens interleaved: every part opens to its bytes."""
    per_thread, threads = 150, 8
    sealer = Sealer(keyring, "cluster", IDENTITY)
    errors, barrier = [], threading.Barrier(threads)

    def work(t):
        try:
            barrier.wait()
            name = name_of(keyring, f"tenant{t % 4}", bytes([t]) * 32)
            for i in range(per_thread):
                data = os.urandom(1 + (i * 997) % 70_000)
                part = seal(sealer, data, name, 0, 1)
                if opened(sealer, *part) != data:
                    errors.append("mismatch")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []


# ------------------------------------------------------------------ misuse and secrets


def test_misuse_is_refused_with_seal_errors(keyring):
    with pytest.raises(SealError):
        Sealer(keyring, "dram", IDENTITY)
    sealer = Sealer(keyring, "ssd", IDENTITY)
    for args in ((b"n", 1, 1, 10, 10), (b"n", 0, 1, 10, 11), (b"n", 0, 1, 10, 0), (b"n" * 256, 0, 1, 1, 1),
                 (b"n", 0, 1 << 32, 10, 10), (b"n", 0, 1, 1 << 64, 1), ("str", 0, 1, 1, 1), (b"n", -1, 1, 1, 1)):
        with pytest.raises(SealError):
            PartContext(*args)
    ctx = PartContext(b"n", 0, 1, 10, 10)
    with pytest.raises(SealError):
        sealer.seal_into(ctx, b"x" * 9, bytearray(26))
    with pytest.raises(SealError):
        sealer.seal_into(ctx, b"x" * 10, bytearray(25))
    with pytest.raises(SealError):
        sealer.seal_into(ctx, b"x" * 10, b"\0" * 26)  # read-only output
    sealed = sealer.seal_into(ctx, b"x" * 10, out := bytearray(26))
    with pytest.raises(Unauthentic):
        sealer.open_into(ctx, sealed, out, bytearray(9))
    with pytest.raises(SealError):
        sealer.open_into(ctx, sealed, out, b"\0" * 10)  # read-only output


def test_no_secret_in_any_repr_str_or_message(key_path, keyring, tmp_path):
    keys = KeyFile.load(key_path)
    secrets = [keys.names, *keys.epochs.values(), keyring.key_id, keyring.tenant(SALT).tag,
               keyring.seal_key(1, keyring.tenant(SALT)), SALT.encode()]
    sealer = Sealer(keyring, "ssd", IDENTITY)
    name = name_of(keyring)
    ctx, sealed, blob = seal(sealer, b"p" * 64, name)
    secrets += [name[2:], sealed.nonce, sealed.tag,
                aead_module.part_key(keyring.seal_key(1, keyring.tenant(SALT)), sealed.nonce)]
    texts = [repr(keys), str(keys), repr(keyring), repr(keyring.tenant(SALT)), repr(sealed), str(sealed), repr(ctx),
             str(ctx), repr(sealer)]
    failures = []
    for attempt in (lambda: sealer.open_into(ctx, sealed, blob[:-1] + bytes([blob[-1] ^ 1]), bytearray(64)),
                    lambda: sealer.open_into(ctx, SealedPart(9, sealed.nonce, sealed.tag), blob, bytearray(64)),
                    lambda: keyring.tenant_of(name[2:-1]), lambda: retire_epoch(key_path, 1),
                    lambda: keyring.seal_key(7, keyring.tenant(SALT)),
                    lambda: Sealer(keyring, "ssd", IDENTITY).open_into(ctx, sealed, blob[:5], bytearray(64))):
        try:
            attempt()
        except SealError as exc:
            failures.append(exc)
    assert len(failures) == 6
    texts += [str(e) for e in failures] + [repr(e) for e in failures]
    for text in texts:
        assert "\n" not in text
        for secret in secrets:
            for form in (secret.hex(), secret.hex().upper(), repr(secret)[2:-1]):
                assert form not in text, f"a secret in: {text[:60]}"


# ------------------------------------------------------------------ the documented format, independently


def _hkdf(key, info, length=32):
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(key)


def test_derivations_and_associated_data_are_the_documented_ones(key_path, keyring):
    """Recompute a chunk id, the seal key and the associated data from the formulas in keys.py's and
    aead.py's docstrings, and open a sealed part with plain AESGCM: saria's format is what it says."""
    keys = KeyFile.load(key_path)
    block = os.urandom(32)
    tag = _hkdf(keys.names, b"saria tenant v1" + hashlib.sha256(SALT.encode()).digest(), 16)
    name_key = _hkdf(keys.names, b"saria names v1" + tag)
    h = hmac.digest(name_key, b"saria chunk v1" + struct.pack("<I", len(SCOPE)) + SCOPE + block, "sha256")
    mask = hmac.digest(_hkdf(keys.names, b"saria mask v1"), h, "sha256")[:16]
    chunk_id = bytes(a ^ b for a, b in zip(tag, mask)) + h
    assert keyring.chunk_ids(keyring.tenant(SALT), SCOPE, [block]) == [chunk_id]
    key_id = _hkdf(keys.names, b"saria key id v1", 8)
    assert keyring.key_id == key_id
    seal_key = _hkdf(keys.epochs[1], b"saria seal v1" + tag + struct.pack("<I", 1))
    name = object_key(chunk_id, "kv")
    sealer = Sealer(keyring, "cluster", IDENTITY)
    plaintext = os.urandom(777)
    ctx, sealed, blob = seal(sealer, plaintext, name, 2, 5, 4000)
    assert sealed.version == 2 and len(sealed.nonce) == 24
    r = sealed.nonce
    ad = (b"saria sealed v2" + struct.pack("<HB", 2, 7) + b"cluster" + struct.pack("<I", len(IDENTITY))
          + IDENTITY.encode() + struct.pack("<B", len(name)) + name + tag + key_id
          + struct.pack("<IIIQQ", 1, 2, 5, 4000, 777) + r)
    part_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=r[:16], info=b"saria part v2").derive(seal_key)
    assert AESGCM(part_key).decrypt(r[16:] + bytes(4), blob, ad) == plaintext
    with pytest.raises(InvalidTag):  # not under K_eT itself, nor with version 1's associated data
        AESGCM(seal_key).decrypt(r[16:] + bytes(4), blob, ad)


def seal_v1(sealer, plaintext: bytes, name: bytes, index=0, count=1, object_length=None):
    """A part sealed as saria's format version 1 sealed it (before per-part keys; the code path
    removed from aead.py, kept here as it was): a 12-byte random nonce, directly under K_eT, the
    version-1 associated data."""
    ctx = PartContext(name, index, count, object_length or len(plaintext), len(plaintext))
    tenant = sealer.tenant_of_name(name)
    epoch = sealer.keyring.current_epoch
    nonce = os.urandom(12)
    blob = AESGCM(sealer.keyring.seal_key(epoch, tenant)).encrypt(nonce, plaintext,
                                                                  sealer.associated_data(ctx, tenant, epoch))
    return ctx, SealedPart(epoch, nonce, blob[-16:]), blob


def test_version_1_parts_still_open_and_cannot_be_mixed_with_version_2(key_path, keyring):
    """A part sealed by format version 1 opens; its nonce, tag or bytes changed, or given as a
    version-2 part (and a version-2 part given as version 1), it fails. The version-1 associated
    data is the documented one."""
    keys = KeyFile.load(key_path)
    sealer = Sealer(keyring, "ssd", IDENTITY)
    name = name_of(keyring)
    plaintext = os.urandom(300)
    ctx, sealed, blob = seal_v1(sealer, plaintext, name, 1, 3, 900)
    assert sealed.version == 1
    assert opened(sealer, ctx, sealed, blob) == plaintext
    tag = keyring.tenant(SALT).tag
    ad = (b"saria sealed v1" + struct.pack("<HB", 1, 3) + b"ssd" + struct.pack("<I", len(IDENTITY))
          + IDENTITY.encode() + struct.pack("<B", len(name)) + name + tag + keyring.key_id
          + struct.pack("<IIIQQ", 1, 1, 3, 900, 300))
    seal_key = _hkdf(keys.epochs[1], b"saria seal v1" + tag + struct.pack("<I", 1))
    assert AESGCM(seal_key).decrypt(sealed.nonce, blob, ad) == plaintext
    for bit in range(0, 96, 7):
        nonce = bytearray(sealed.nonce)
        nonce[bit // 8] ^= 1 << (bit % 8)
        refused(sealer, ctx, SealedPart(sealed.epoch, bytes(nonce), sealed.tag), blob)
    refused(sealer, ctx, sealed, blob[:-1] + bytes([blob[-1] ^ 1]))
    refused(sealer, ctx, SealedPart(sealed.epoch, sealed.nonce + bytes(12), sealed.tag), blob)  # as version 2
    ctx2, sealed2, blob2 = seal(sealer, plaintext, name, 1, 3, 900)
    refused(sealer, ctx2, SealedPart(sealed2.epoch, sealed2.nonce[16:] + bytes(4), sealed2.tag), blob2)  # as v1
    refused(sealer, ctx2, SealedPart(sealed2.epoch, sealed2.nonce[:12], sealed2.tag), blob2)

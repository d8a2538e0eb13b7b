"""The cluster store's lookups beyond a batch: whether objects are complete, and dropping them.

Both run on the store's thread pool (:class:`~saria.dataplane.cluster.store.ClusterStore` waits for
them with its timeout). Metadata values are fetched with ``get_batch`` (a copy through the client's
local buffer), parts only checked or removed, never read.

Whoever reaches Mooncake may plant any value under a metadata key, so nothing here trusts one for
its size or its part count: a value's size is learned first (``batch_get_replica_desc``, no bytes
moved; ``get_size`` where a replica does not say), and a value larger than the largest metadata an
object of its layout may have (:attr:`~.layout.Layout.max_meta_bytes`: at most
:data:`~.layout.MAX_PARTS` parts) is never fetched; a value that claims more parts than that does
not parse. Either is junk: a clean miss, counted (``junk_meta``), never a key per claimed part.
"""

from __future__ import annotations

from typing import Any

from saria.dataplane.cluster.errors import ClusterOff
from saria.dataplane.cluster.layout import Layout, Meta


def value_sizes(client: Any, keys: list[str]) -> list[int | None]:
    """The stored size of each value of ``keys`` without moving it (``None``: absent or unknown)."""
    if not keys:
        return []
    sizes: list[int | None] = [None] * len(keys)
    try:
        replicas = client.batch_get_replica_desc(keys)
    except Exception:  # noqa: BLE001 - an older client: ask each key
        replicas = {}
    for i, key in enumerate(keys):
        for replica in replicas.get(key, ()):
            try:
                if replica.is_memory_replica():
                    sizes[i] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
            except Exception:  # noqa: BLE001 - a replica that does not say: asked below
                pass
        if sizes[i] is None:
            size = client.get_size(key)
            sizes[i] = size if size >= 0 else None
    return sizes


def fetch_metadata(client: Any, objects: list[tuple[Layout, bytes]], counters: Any = None) -> list[bytes | None]:
    """Each object's metadata value, fetched only when it exists and is no larger than its
    layout's largest (``None`` otherwise; junk counted in ``counters.junk_meta``)."""
    keys = [layout.meta_key(k) for layout, k in objects]
    sizes = value_sizes(client, keys)
    fetch = [i for i, ((layout, _), size) in enumerate(zip(objects, sizes))
             if size is not None and 0 < size <= layout.max_meta_bytes]
    junk = sum(1 for size in sizes if size is not None) - len(fetch)
    out: list[bytes | None] = [None] * len(objects)
    for i, value in zip(fetch, client.get_batch([keys[i] for i in fetch]) if fetch else []):
        out[i] = bytes(value) if len(value) else None
    if junk and counters is not None:
        counters.add(junk_meta=junk)
    return out


def exists(conn: Any, objects: list[tuple[Layout, bytes]], counters: Any = None) -> list[bool]:
    """Whether each object (a layout, i.e. an identity's keys, and an object key) is complete now:
    its metadata exists and parses, and every part it names exists (four calls: metadata
    existence, their sizes, the values no larger than a layout's metadata may be, part existence,
    each one batch over every object). A sealed layout's metadata is read from its clear fields,
    without a key: a hint, as every answer here. Junk metadata (module docstring) is a miss,
    counted in ``counters.junk_meta``."""
    client = conn.client()
    if client is None:
        raise ClusterOff("cluster tier off")
    codes = client.batch_is_exist([layout.meta_key(k) for layout, k in objects])
    if conn.check(codes, "batch_is_exist"):
        raise ClusterOff("master unreachable")
    found = [i for i, c in enumerate(codes) if c == 1]
    values = fetch_metadata(client, [objects[i] for i in found]) if found else []
    parts: list[tuple[int, str]] = []
    junk = 0
    for i, value in zip(found, values):
        if value is None:
            junk += 1  # gone since, or larger than any object's metadata: not fetched
            continue
        layout, key = objects[i]
        try:
            names = layout.peek_part_keys(key, value)
        except ValueError:
            junk += 1  # an unreadable metadata value: not an object (a get drops it)
            continue
        parts += [(i, pk) for pk in names]
    if junk and counters is not None:
        counters.add(junk_meta=junk)
    present = {i for i, _ in parts}
    codes = client.batch_is_exist([pk for _, pk in parts]) if parts else []
    if conn.check(codes, "batch_is_exist"):
        raise ClusterOff("master unreachable")
    for (i, _), c in zip(parts, codes):
        if c != 1:
            present.discard(i)
    return [i in present for i in range(len(objects))]


def drop(store: Any, client: Any, objects: list[tuple[bytes, Meta | None]]) -> int:
    """Remove objects from Mooncake, forced (a reader's lease does not stop it): their metadata
    and the parts it names (read here when not given: the parts a stored metadata value names,
    unchecked, if it is no larger than the layout's largest and names at most
    :data:`~.layout.MAX_PARTS` parts). How many metadata values were there."""
    layout = store._layout
    need = [k for k, m in objects if m is None]
    keys = [layout.meta_key(k) for k, _ in objects]
    for k, m in objects:
        if m is not None:
            keys += layout.part_keys(k, m)
    if need:
        for k, value in zip(need, fetch_metadata(client, [(layout, k) for k in need], store._counters)):
            if value is None:
                continue
            try:
                keys += layout.peek_part_keys(k, value)
            except ValueError:
                store._counters.add(junk_meta=1)
    codes = client.batch_remove(keys, True)
    removed = sum(1 for c in codes[:len(objects)] if c == 0)
    store._counters.add(dropped=removed)
    return removed

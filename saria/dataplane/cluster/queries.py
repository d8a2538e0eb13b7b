"""The cluster store's lookups beyond a batch: whether objects are complete, and dropping them.

Both run on the store's thread pool (:class:`~saria.dataplane.cluster.store.ClusterStore` waits for
them with its timeout). Metadata values are fetched with ``get_batch`` (a copy through the client's
local buffer: their size is not known here), parts only checked or removed, never read.
"""

from __future__ import annotations

from typing import Any

from saria.dataplane.cluster.errors import ClusterOff
from saria.dataplane.cluster.layout import Layout, Meta


def exists(conn: Any, objects: list[tuple[Layout, bytes]]) -> list[bool]:
    """Whether each object (a layout, i.e. an identity's keys, and an object key) is complete now:
    its metadata exists and parses, and every part it names exists (three calls: metadata
    existence, metadata values, part existence, each one batch over every object). A sealed
    layout's metadata is read from its clear fields, without a key: a hint, as every answer here."""
    client = conn.client()
    if client is None:
        raise ClusterOff("cluster tier off")
    codes = client.batch_is_exist([layout.meta_key(k) for layout, k in objects])
    if conn.check(codes, "batch_is_exist"):
        raise ClusterOff("master unreachable")
    found = [i for i, c in enumerate(codes) if c == 1]
    values = client.get_batch([objects[i][0].meta_key(objects[i][1]) for i in found]) if found else []
    parts: list[tuple[int, str]] = []
    for i, value in zip(found, values):
        layout, key = objects[i]
        try:
            names = layout.peek_part_keys(key, value)
        except ValueError:
            continue  # an unreadable metadata value: not an object (a get drops it)
        parts += [(i, pk) for pk in names]
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
    unchecked). How many metadata values were there."""
    layout = store._layout
    need = [k for k, m in objects if m is None]
    keys = [layout.meta_key(k) for k, _ in objects]
    for k, m in objects:
        if m is not None:
            keys += layout.part_keys(k, m)
    if need:
        for k, value in zip(need, client.get_batch([layout.meta_key(k) for k in need])):
            try:
                keys += layout.peek_part_keys(k, value)
            except ValueError:
                pass
    codes = client.batch_remove(keys, True)
    removed = sum(1 for c in codes[:len(objects)] if c == 0)
    store._counters.add(dropped=removed)
    return removed

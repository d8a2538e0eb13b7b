"""SSD recovery: taking over the objects a previous run left on the drives (``ControlPlane.recover_ssd``).

A recovered object holds its SSD bytes at once (``Residency.recovered``: when SSD room is needed,
these go first, oldest first, before any copy in the SSD LRU; under hints restored from a previous
control plane, a pinned chunk's never and a retained chunk's last) but has no node until a request's
chunks reach it: then the run of recovered chunks right after the known prefix joins the context
tree (:meth:`SsdRecovery.adopt_run`) and a plan reloads it like any SSD copy (a recovered chunk
that a request recomputes keeps its SSD copy). Dropped at once: objects that do not fit, objects
the tree already knows without an SSD copy (this run computed them: the drives' copy is stale to
it) and state objects of a model without any. An object this run wrote or is writing is left to
that write.
"""

from __future__ import annotations

from saria.control.counters import Counters
from saria.control.residency import PendingChanges, Residency
from saria.control.tree import ABSENT, ContextTree, Node
from saria.orders import KV, STATE, ObjectKey

__all__ = ["SsdRecovery"]


class SsdRecovery:
    """Recovered SSD objects of one control plane: taken over, then adopted by new nodes."""

    def __init__(self, tiers: Residency, tree: ContextTree, counters: Counters, *, kv_bytes: int,
                 state_bytes: int) -> None:
        """``kv_bytes`` / ``state_bytes``: what a recovered object takes of the SSD tier (its
        charge: whole parts of its SSD size under ``ssd_dtype``; 0: a kind the model has none of)."""
        self._tiers = tiers
        self._tree = tree
        self._counters = counters
        self._sizes = {KV: kv_bytes, STATE: state_bytes}

    def take_over(self, keys: list[ObjectKey], changes: PendingChanges, waiting: PendingChanges) -> None:
        """Hold each of ``keys`` (checked by ``checks.check_recovered``) or drop it into ``changes``;
        ``waiting``: drops decided earlier and not yet emitted (a repeat of one counts once)."""
        tiers, counters, sizes = self._tiers, self._counters, self._sizes
        dropped = set(waiting.recovered_drops)
        for key in keys:
            if key in tiers.recovered or key in dropped:
                continue
            node = self._tree.nodes.get(key.chunk)
            obj = None if node is None else (node if key.kind == KV else node.state)
            if node is not None and obj is not None and obj.ssd != ABSENT:
                continue  # this run's write of it supersedes the drives' copy
            if node is not None or not sizes[key.kind] or tiers.ssd.free < sizes[key.kind]:
                changes.recovered_drops.append(key)
                counters.recovered_dropped += 1
                continue
            tiers.recovered[key] = sizes[key.kind]
            tiers.ssd.used += sizes[key.kind]
            counters.recovered += 1

    def adopt_run(self, hashes: tuple, nodes: list[Node | None], now: float, waiting: PendingChanges) -> None:
        """Give the run of recovered chunks right after the known prefix its nodes (``nodes``
        filled in), so that a plan can reload them."""
        recovered = self._tiers.recovered
        if not recovered or nodes[-1:] != [None]:
            return
        first = end = nodes.index(None)
        while end < len(hashes) and ObjectKey(hashes[end], KV) in recovered:
            end += 1
        if end > first:
            nodes[first:end] = made = self._tree.extend(hashes[first:end], nodes[first - 1] if first else None, now)
            self.adopt(made, waiting)

    def adopt(self, made: list[Node], waiting: PendingChanges) -> None:
        """New nodes take over their recovered SSD objects; a recovered state object of a chunk that
        keeps none is dropped (into ``waiting``)."""
        tiers = self._tiers
        if not tiers.recovered:
            return
        for node in made:
            tiers.adopt_recovered(node)
            if node.state is not None:
                tiers.adopt_recovered(node.state)
            elif ObjectKey(node.key, STATE) in tiers.recovered:
                tiers.drop_recovered(ObjectKey(node.key, STATE), waiting)

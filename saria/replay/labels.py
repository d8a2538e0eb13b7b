"""Labels from the oracle for the ``learned`` admission rule, collected inside a replay's pass.

:class:`EvictionLabels` is the control plane's eviction observer (``ControlPlane(observer=...)``):
at every DRAM eviction of a kv object it records the chunk's :data:`saria.control.learned.FEATURES`
(computed by the control plane from what it knows at that moment) and asks the replay's
:class:`~saria.replay.oracle.TraceFuture` what the oracle would do: **admit** when a request not
yet planned references the chunk no later than now plus the SSD's current retention age (the
``oracle`` admission rule's test, exactly). The future is the only thing a label knows that the
features do not. Beside the label it keeps how many such requests come within that horizon (the
reuses one admission now would serve), whether the chunk had no SSD copy (only then does
admission decide anything) and the bytes a write would put on the SSD.

:func:`episode_labels` turns these into Baleen-style labels (Wong et al., FAST '24): each
deciding eviction is an *episode* whose benefit is the reuses it would serve, ranked by reuses per
byte written, admitted from the best down until the bytes reach a write budget.
"""

from __future__ import annotations

import math
from typing import Hashable

from saria.control.tree import ABSENT
from saria.replay.oracle import TraceFuture

__all__ = ["EvictionLabels", "episode_labels"]


class EvictionLabels:
    """Per kv-object DRAM eviction of one replay: ``rows`` (features), ``labels`` (the oracle's
    0/1), ``reuses`` (unplanned requests within the horizon), ``decides`` (no SSD copy at the
    eviction), ``times``, ``keys`` and ``nbytes`` (SSD bytes a write of it takes)."""

    def __init__(self, future: TraceFuture, ssd_kv_bytes: int) -> None:
        self.future = future
        self.ssd_kv_bytes = ssd_kv_bytes
        self.rows: list[list[float]] = []
        self.labels: list[int] = []
        self.reuses: list[int] = []
        self.decides: list[bool] = []
        self.times: list[float] = []
        self.keys: list[Hashable] = []

    def __call__(self, node, features: list[float], now: float, ssd_retention: float) -> None:
        future = self.future
        next_use = future.next_use(node.key, now)
        admit = next_use < math.inf and next_use - now <= ssd_retention
        self.rows.append(features)
        self.labels.append(1 if admit else 0)
        self.reuses.append(future.uses_within(node.key, now, ssd_retention) if admit else 0)
        self.decides.append(node.ssd == ABSENT)
        self.times.append(now)
        self.keys.append(node.key)

    def __len__(self) -> int:
        return len(self.labels)

    def deciding(self) -> tuple[list[list[float]], list[int]]:
        """Rows and labels of the evictions where admission decides (no SSD copy then)."""
        keep = [i for i, d in enumerate(self.decides) if d]
        return [self.rows[i] for i in keep], [self.labels[i] for i in keep]

    @property
    def nbytes(self) -> int:
        return self.ssd_kv_bytes


def episode_labels(labels: EvictionLabels, budget_bytes: float) -> list[int]:
    """Baleen-style labels of ``labels``' evictions: the deciding ones with reuses, best reuses
    per byte written first (ties: the earlier), admitted while the bytes written stay within
    ``budget_bytes``; every other eviction 0."""
    if not (budget_bytes >= 0):
        raise ValueError(f"the episodes' write budget must be >= 0 bytes, got {budget_bytes!r}")
    nbytes = labels.ssd_kv_bytes
    ranked = sorted((i for i in range(len(labels)) if labels.decides[i] and labels.reuses[i] > 0),
                    key=lambda i: (-labels.reuses[i] / nbytes, labels.times[i], i))
    out = [0] * len(labels)
    spent = 0
    for i in ranked:
        if spent + nbytes > budget_bytes:
            break
        out[i] = 1
        spent += nbytes
    return out

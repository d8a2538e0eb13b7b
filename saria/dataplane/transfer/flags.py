"""``LayerFlags``: one step's per-layer "done" flags behind one condition variable.

A step used to hold one ``threading.Event`` per layer and path (and per layer of its saves): with
36 layers, ~75 events a step, each a lock and a condition built on the hook's thread (~5 us
apiece on a busy host). The flags give the same guarantees (a flag once set stays set; a waiter
wakes once its flag is set, or at its timeout) with one lock for the whole step, and a wait on a
flag already set takes no lock at all.
"""

from __future__ import annotations

import threading
import time


class LayerFlags:
    """``n`` flags, all clear at first; :meth:`set` one, :meth:`set_all`, :meth:`wait` for one or
    :meth:`wait_all`. Thread-safe; a flag is never cleared. The condition its waiters sleep on is
    built (on its lock) by the first caller that has to wait: a step makes its flags on a hook's
    thread, and most are set before anyone waits."""

    __slots__ = ("_flags", "_left", "_lock", "_cond")

    def __init__(self, n: int):
        self._flags = [False] * n
        self._left = n
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None

    def __len__(self) -> int:
        return len(self._flags)

    def is_set(self, i: int) -> bool:
        return self._flags[i]

    def all_set(self) -> bool:
        """Whether every flag is set (no lock: set flags stay set)."""
        return not self._left

    def set(self, i: int) -> None:
        """Set flag ``i`` (again: nothing changes) and wake its waiters."""
        with self._lock:
            if not self._flags[i]:
                self._flags[i] = True
                self._left -= 1
                if self._cond is not None:
                    self._cond.notify_all()

    def set_all(self) -> None:
        with self._lock:
            if self._left:
                self._flags[:] = [True] * len(self._flags)
                self._left = 0
                if self._cond is not None:
                    self._cond.notify_all()

    def _waiting(self) -> threading.Condition:
        """The condition (on ``_lock``, which the caller holds), built on first need."""
        cond = self._cond
        if cond is None:
            cond = self._cond = threading.Condition(self._lock)
        return cond

    def wait(self, i: int, timeout: float | None = None) -> bool:
        """Wait until flag ``i`` is set; whether it is (``False``: ``timeout`` seconds passed)."""
        if self._flags[i]:  # set flags stay set: no lock needed to see one
            return True
        with self._lock:
            return self._waiting().wait_for(lambda: self._flags[i], timeout)

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait until every flag is set; whether they are (``False``: ``timeout`` seconds passed)."""
        if not self._left:
            return True
        with self._lock:
            return self._waiting().wait_for(lambda: not self._left, timeout)

    def first_clear(self) -> int | None:
        """The lowest flag not set (``None``: all are), to name it in a timeout."""
        for i, flag in enumerate(self._flags):
            if not flag:
                return i
        return None


class LazyEvent:
    """A ``threading.Event`` for the hot path (``set``, ``is_set``, ``wait``, the same guarantees):
    a flag and a lock, the event itself (a condition and its lock, ~3 us to build) made only for a
    caller that has to wait before it is set. A step makes several that nobody waits on (the
    waiter usually comes after the set, or never)."""

    __slots__ = ("_flag", "_event", "_lock")

    def __init__(self):
        self._flag = False
        self._event: threading.Event | None = None
        self._lock = threading.Lock()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._lock:
            self._flag = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set; whether it is (``False``: ``timeout`` seconds passed)."""
        if self._flag:
            return True
        with self._lock:
            if self._flag:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

"""What happens once the device reached an event, done off the hooks' thread.

The hot-path rule (docs/architecture.md, "No host wait on the device in a per-step hook"): a vLLM
hook never blocks its thread until the device has run something. Where the forward must come after
a copy, its stream waits on the copy's event (``Streams.wait``); what may only happen once the
copy *ran* (host staging given back, a stored object published and its completion reported, the
staged objects of a cluster fetch dropped) is handed to a :class:`Retirer`: one thread per
transfer engine that blocks on the events (``Event.synchronize``, which releases the GIL on CUDA)
and then runs the work, in the order handed over.

On the CPU the events are :class:`~saria.dataplane.transfer.streams.HostEvent` twins, the same
code runs, and a test stands in an event whose ``synchronize`` fails when called from a hook.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterable

from saria.dataplane.transfer.streams import Event

log = logging.getLogger("saria.dataplane")


class Retirer:
    """One thread that runs ``then()`` after the device reached ``events`` (module docstring).
    ``on_start``: run first on the thread (binds the engine's device)."""

    def __init__(self, name: str = "saria-retire", on_start: Callable[[], None] | None = None):
        self._name = name
        self._on_start = on_start
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pending = 0
        self._idle = threading.Condition(self._lock)

    def after(self, events: Iterable[Event | None], then: Callable[[], None], *,
              wait: Callable[[], None] | None = None) -> None:
        """Run ``then()`` on the retire thread once ``wait()`` (if given: a host-side wait such as
        a path's flags) returned and every event of ``events`` (``None``: nothing) was reached.
        ``then`` must not raise (an exception is logged and dropped). Once closed, runs at once on
        the caller's thread, after synchronizing: nothing is left behind."""
        events = [event for event in events if event is not None]
        with self._lock:
            if not self._closed:
                self._pending += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
                self._queue.put((events, then, wait))
                return
        self._run(events, then, wait)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over so far ran (a reset, a new epoch, sleep, tests).
        Whether it did within ``timeout``. Never call it from the retire thread itself."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    @property
    def pending(self) -> int:
        """Work handed over that has not run yet."""
        with self._lock:
            return self._pending

    def close(self) -> None:
        """Run what is queued, stop the thread; later work runs on the caller's thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # noqa: BLE001 - the thread must run the work all the same
                log.warning("retire thread start: %s", exc)
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                self._run(*work)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    @staticmethod
    def _run(events: list[Event], then: Callable[[], None], wait: Callable[[], None] | None) -> None:
        try:
            if wait is not None:
                wait()
            for event in events:
                event.synchronize()
        except Exception as exc:  # noqa: BLE001 - a device fault: the work still runs (it frees, fails, reports)
            log.warning("waiting for the device before retiring work failed: %s", exc)
        try:
            then()
        except Exception as exc:  # noqa: BLE001
            log.warning("retiring work failed: %s", exc)

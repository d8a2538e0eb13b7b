"""A CPU twin of a device that runs behind the host, to check the hot-path rule (docs/architecture.md,
"No host wait on the device in a per-step hook") without a GPU.

:class:`LaggingDevice` stands in for the engine's events (``HostEvent``): while its gate is shut,
``query()`` says the device has not reached any event, and ``synchronize()`` blocks until the gate
opens, as a GPU still running the forward would. Called from a thread that is inside one of the
worker's per-step hooks, ``synchronize()`` instead records a violation and raises: the hook would
have blocked the engine's thread until the device ran. Tests assert that ``violations`` stays
empty."""

from __future__ import annotations

import functools
import threading
import traceback

from saria.dataplane.transfer.streams import HostEvent
from saria.integrations.vllm.worker import SariaWorker

# SariaConnector's per-step worker hooks (docs/vllm.md, "Hook order"): none may wait for the device.
HOOKS = ("before_forward", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "build_worker_meta", "take_error_blocks", "take_failed_requests")


class LaggingDevice:
    def __init__(self, monkeypatch, *, shut: bool = True):
        self.gate = threading.Event()
        if not shut:
            self.gate.set()
        self.violations: list[str] = []
        self.synchronized = 0  # synchronize() calls off the hooks (the retire thread, closing)
        self._in_hook = threading.local()
        device = self

        def query(event: HostEvent) -> bool:
            return device.gate.is_set()

        def synchronize(event: HostEvent) -> None:
            hook = getattr(device._in_hook, "name", None)
            if hook is not None:
                device.violations.append(f"{hook}: {''.join(traceback.format_stack(limit=8))}")
                raise AssertionError(f"the {hook} hook waited for the device")
            device.synchronized += 1
            if not device.gate.wait(60):
                raise TimeoutError("the lagging device twin was never let run")

        monkeypatch.setattr(HostEvent, "query", query)
        monkeypatch.setattr(HostEvent, "synchronize", synchronize)
        for name in HOOKS:
            monkeypatch.setattr(SariaWorker, name, self._hook(name, getattr(SariaWorker, name)))

    def _hook(self, name, method):
        device = self

        @functools.wraps(method)
        def hook(*args, **kwargs):
            outer = getattr(device._in_hook, "name", None)
            device._in_hook.name = name
            try:
                return method(*args, **kwargs)
            finally:
                device._in_hook.name = outer

        return hook

    def run(self) -> None:
        """The device catches up: every event recorded so far (and later) is reached."""
        self.gate.set()

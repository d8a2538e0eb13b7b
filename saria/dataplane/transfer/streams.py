"""The transfer engine's CUDA streams and events, and their CPU twins.

:class:`Streams` gives each path (``dram``, ``ssd``, ``offload``) its own CUDA stream and makes
the events the paths synchronize on. Every event is an :class:`Event` of this module: a
:class:`CudaEvent` (a ``torch.cuda.Event`` that remembers how it was made and whether it was
recorded) or, on a machine without CUDA, its twin :class:`HostEvent`. Both check CUDA's rules in
Python, so a misuse fails the CPU tests instead of the first GPU run:

* ``elapsed_time`` needs both events created with ``enable_timing=True`` (CUDA raises
  ``ValueError: Both events must be created with argument 'enable_timing=True'``) and both
  recorded;
* a stream told to wait for an event that was never recorded is refused (CUDA silently waits for
  nothing, which is always a bug here: the work it should have ordered after is unordered);
* an event of another device (a CUDA event on a CPU engine, or the reverse) is refused.

Every event the engine makes is recorded at once on a named stream (:meth:`Streams.record`) or on
the caller's current stream (:meth:`Streams.caller_event`); events that a timeline reads are made
with ``timing=True`` (timing costs a little on a GPU, so only those are).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

STREAMS = ("dram", "ssd", "offload")

_TIMING_ERROR = "Both events must be created with argument 'enable_timing=True'."


class Event:
    """An event of the engine's, with CUDA's rules checked on every device (module docstring)."""

    device_type = ""

    def __init__(self, enable_timing: bool = False):
        self.enable_timing = bool(enable_timing)
        self.recorded = False

    def record(self, stream=None) -> None:
        raise NotImplementedError

    def query(self) -> bool:
        """Whether the work before the event has run (an event never recorded counts as reached)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the host until the event is reached."""
        raise NotImplementedError

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds from this event to ``end_event`` (both recorded, both timing, same kind)."""
        if type(end_event) is not type(self):
            raise TypeError(f"elapsed_time between a {type(self).__name__} and a {type(end_event).__name__}")
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError(_TIMING_ERROR)
        if not (self.recorded and end_event.recorded):
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return self._elapsed_ms(end_event)

    def _elapsed_ms(self, end_event) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timing={self.enable_timing}, recorded={self.recorded})"


class CudaEvent(Event):
    """A ``torch.cuda.Event`` (``.event``) with :class:`Event`'s checks."""

    device_type = "cuda"

    def __init__(self, enable_timing: bool = False):
        super().__init__(enable_timing)
        self.event = torch.cuda.Event(enable_timing=self.enable_timing)

    def record(self, stream=None) -> None:
        self.event.record(stream)
        self.recorded = True

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def _elapsed_ms(self, end_event: "CudaEvent") -> float:
        return self.event.elapsed_time(end_event.event)


class HostEvent(Event):
    """The CPU twin of :class:`CudaEvent`. CPU work is synchronous, so a recorded event has always
    been reached: :meth:`query` is ``True`` and :meth:`synchronize` returns at once;
    :meth:`elapsed_time` is host time between the two :meth:`record` calls."""

    device_type = "cpu"

    def __init__(self, enable_timing: bool = False):
        super().__init__(enable_timing)
        self._when = 0.0

    def record(self, stream=None) -> None:
        self._when = time.perf_counter()
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def _elapsed_ms(self, end_event: "HostEvent") -> float:
        return (end_event._when - self._when) * 1e3


class Streams:
    """One CUDA stream per path on a CUDA device; on the CPU, no streams (:meth:`on` is a no-op
    context) and :class:`HostEvent` twins for the events."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._streams = {name: torch.cuda.Stream(self.device) for name in STREAMS} if self.cuda else {}

    def _stream(self, name: str):
        if name not in STREAMS:
            raise ValueError(f"unknown stream {name!r}; the engine's streams are {STREAMS}")
        return self._streams.get(name)

    def on(self, name: str):
        """A context that makes ``name``'s stream current (CUDA)."""
        stream = self._stream(name)
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def event(self, timing: bool = False) -> Event:
        """A new, unrecorded event for this device (``timing``: usable with ``elapsed_time``)."""
        return CudaEvent(timing) if self.cuda else HostEvent(timing)

    def record(self, name: str, timing: bool = False) -> Event:
        """An event recorded on ``name``'s stream now (on the CPU: a recorded :class:`HostEvent`)."""
        stream = self._stream(name)
        event = self.event(timing)
        event.record(stream)
        return event

    def caller_event(self, timing: bool = False) -> Event:
        """An event recorded on the caller's current stream: a path's work waits for it (so the
        engine's copies come after whatever the caller queued before handing work over)."""
        event = self.event(timing)
        event.record(torch.cuda.current_stream(self.device) if self.cuda else None)
        return event

    def wait(self, name: str | None, event: Event) -> None:
        """Make ``name``'s stream (``None``: the caller's current stream) wait for ``event`` without
        blocking the host. Refuses what is not one of this device's events, and an event never
        recorded (CUDA would let the stream wait for nothing)."""
        if not isinstance(event, Event):
            raise TypeError(f"a stream waits for an Event of saria.dataplane.transfer.streams, got {type(event).__name__}")
        if event.device_type != self.device.type:
            raise ValueError(f"a {event.device_type} event cannot order work on {self.device}")
        if not event.recorded:
            raise RuntimeError("a stream was told to wait for an event that was never recorded: it would wait "
                               "for nothing")
        if self.cuda:
            stream = self._stream(name) if name is not None else torch.cuda.current_stream(self.device)
            stream.wait_event(event.event)

    def synchronize(self, name: str) -> None:
        """Wait for everything queued on ``name``'s stream (CUDA)."""
        stream = self._stream(name)
        if stream is not None:
            stream.synchronize()

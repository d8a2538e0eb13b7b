"""The engine's device on every thread saria starts.

vLLM makes a worker's GPU current (``torch.cuda.set_device(local_rank)``) on its main thread
only. A thread saria starts begins with device 0 current: a copy, an event, a
``cudaHostRegister`` or a Triton launch made there either runs on the wrong GPU or makes CUDA
create a context on GPU 0 for it (under TP >= 2, every rank >= 1 then holds hundreds of MiB on
GPU 0 that vLLM does not account for). So every thread and pool worker saria starts calls
:func:`bind_thread` with the engine's device before it does any work: a thread's first line, a
pool's ``initializer`` (:func:`pool_initializer`).

:func:`bind_thread` also records, per thread, the device it bound: the CPU twin of CUDA's
per-thread current device, which tests read (:func:`bound_device`) to check that every thread a
data plane started bound the engine's device, on a machine with no GPU.

Threads that are not saria's and that saria's work may run on: kvikio's own I/O threads make the
context of the buffer's device current themselves (kvikio pushes the pointer's context around each
cuFile call); Mooncake's transfer threads move host memory only (the cluster tier's slots are
host memory).
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

__all__ = ["bind_thread", "bound_device", "current_device", "pool_initializer", "resolve"]

_lock = threading.Lock()
_bound: "weakref.WeakKeyDictionary[threading.Thread, torch.device]" = weakref.WeakKeyDictionary()


def resolve(device: torch.device | str | None = None) -> torch.device:
    """``device`` with its index filled in: a CUDA device without one is the device current on the
    calling thread (call this on the thread that knows it, e.g. the engine's main thread, never on
    a thread saria started). ``None``: :func:`current_device`."""
    if device is None:
        return current_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def current_device() -> torch.device:
    """The device current on the calling thread: ``cuda:N`` where CUDA is initialized, else the CPU
    (never initializes CUDA: a process that never used it, vLLM's scheduler, keeps it so)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bind_thread(device: torch.device | str) -> torch.device:
    """Make ``device`` current on the calling thread (CUDA: ``torch.cuda.set_device``; any other
    device has no current-device state) and record it (:func:`bound_device`). Returns it.

    A CUDA device must name its index (:func:`resolve` on the thread that knows it)."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            raise ValueError("bind_thread needs a CUDA device with its index (resolve() it on the engine's thread)")
        torch.cuda.set_device(device.index)
    with _lock:
        _bound[threading.current_thread()] = device
    return device


def pool_initializer(device: torch.device | str) -> Callable[[], None]:
    """A ``ThreadPoolExecutor(initializer=...)`` that binds each worker to ``device`` before its
    first task."""
    device = torch.device(device)

    def initializer() -> None:
        bind_thread(device)

    return initializer


def bound_device(thread: threading.Thread | None = None) -> torch.device | None:
    """The device ``thread`` (default: the calling thread) bound with :func:`bind_thread`, or
    ``None`` if it never did."""
    with _lock:
        return _bound.get(thread if thread is not None else threading.current_thread())

"""Which implementation of a kernel op runs: the Triton kernel or the torch path.

Triton decides once, when a ``@triton.jit`` function is defined, whether it is compiled for the GPU
or run by its interpreter (``TRITON_INTERPRET=1``). An interpreted kernel dereferences raw host
addresses, so it may only ever see CPU tensors; a compiled kernel only CUDA tensors.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator, Literal

import torch

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
# The page copies (pack_pages, unpack_pages, prepare_scattered) also take "null": a benchmark's
# backend that checks and prepares exactly as "auto" would, then moves no byte (bench/bench_host.py).
COPY_BACKENDS: tuple[str, ...] = BACKENDS + ("null",)

# Read at import, like Triton itself: the kernels in this package are defined right after.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton's interpreter patches triton.language globally while a kernel runs: two threads
# interpreting at once corrupt each other. Compiled launches need no lock.
_INTERPRETER_LOCK = threading.Lock()


def launch_guard() -> ContextManager:
    """Hold around a kernel launch: serializes launches under the interpreter, free otherwise."""
    return _INTERPRETER_LOCK if INTERPRETED else nullcontext()


_NULL_COPIES = False  # null_copies() is active: every page copy of this process is "null"


@contextmanager
def null_copies() -> Iterator[None]:
    """For benchmarks only: while active, every page copy in this process (``pack_pages``,
    ``unpack_pages``, ``ScatteredCopy.launch``, whatever thread runs it) runs all its checks and
    preparation as its backend would, then copies nothing, as if ``backend="null"`` had been passed
    (the pages and buffers keep whatever they held). Lets ``bench/bench_host.py`` measure saria's own
    host cost on the hot path without the copies. Process-wide, not nestable across threads:
    never use it while serving."""
    global _NULL_COPIES
    before, _NULL_COPIES = _NULL_COPIES, True
    try:
        yield
    finally:
        _NULL_COPIES = before


# What resolve_backend answered, by (backend, device): a pure function of them (INTERPRETED is fixed
# at import), asked on every page copy. Errors are not cached.
_RESOLVED: dict[tuple[str, torch.device], Literal["triton", "torch"]] = {}


def resolve_copy_backend(backend: str, device: torch.device) -> tuple[Literal["triton", "torch"], bool]:
    """For the page copies: the implementation to check and prepare for (as :func:`resolve_backend`
    picks it; ``null`` as ``auto``), and whether to move the bytes (False for ``null`` or under
    :func:`null_copies`)."""
    which = _RESOLVED.get((backend, device)) if type(backend) is str else None
    if which is None:
        if not isinstance(backend, str) or backend != "null" and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {COPY_BACKENDS}, got {backend!r}")
        which = _RESOLVED[(backend, device)] = resolve_backend("auto" if backend == "null" else backend, device)
    return which, backend != "null" and not _NULL_COPIES


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch"]:
    """Pick the implementation for tensors on ``device``.

    ``auto`` is Triton on CUDA (compiled) or on CPU under ``TRITON_INTERPRET=1`` (interpreted),
    and the torch path otherwise. Asking for ``triton`` where it cannot run is an error,
    not a silent fallback.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if device.type == "cuda":
        runnable = not INTERPRETED
        why = ("TRITON_INTERPRET=1 is set, so saria's kernels were defined for the interpreter, "
               "which cannot touch CUDA memory; unset it to run them on the GPU")
    elif device.type == "cpu":
        runnable = INTERPRETED
        why = ("Triton kernels run on CPU tensors only under its interpreter: set TRITON_INTERPRET=1 "
               "before saria.kernels is first imported")
    else:
        runnable = False
        why = f"Triton kernels support CUDA (or CPU through the interpreter), not {device.type!r}"
    if runnable:
        return "triton"
    if backend == "auto":
        return "torch"
    raise ValueError(f"backend='triton' cannot run on {device}: {why}")


def default_backend(device: torch.device) -> str:
    """What ``auto`` resolves to on ``device`` (for ``saria doctor``)."""
    return resolve_backend("auto", device)

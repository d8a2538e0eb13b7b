"""The compiled variants of saria's Triton kernels: which ones exist, warming them before serving,
and one lock around any compile that can still happen.

Triton compiles a kernel once per *variant*: the values of its constexprs, ``num_warps``, and, for
every other argument, the specialization its launcher computes (an int's type, and unless the
argument is in ``do_not_specialize`` whether it equals 1 or is a multiple of 16; a pointer's
16-byte alignment unless it is in ``do_not_specialize_on_alignment``). A new variant met while
serving is a compile of hundreds of milliseconds on the thread that meets it, and Triton's compile
path is not reliably thread-safe (triton#5933). So:

* every int of saria's kernels that varies per call is in ``do_not_specialize`` and every pointer
  whose alignment the kernel does not use in ``do_not_specialize_on_alignment``;
* :func:`variant_key` computes a launch's variant with Triton's own specialization function
  (``native_specialize_impl``, the one its launcher calls; it runs on the CPU too), and
  :func:`note` records it in :data:`SEEN`: the variants launched or warmed in this process;
* the data plane warms every variant it can launch on the main thread when it opens
  (:func:`saria.kernels.warm.warm_kernels`), and a variant first met later is compiled under
  :data:`COMPILE_LOCK`, counted in :data:`LATE` (tests assert it stays empty while serving).

Under the interpreter (``TRITON_INTERPRET=1``) nothing is compiled, but the keys are computed
exactly as on a GPU, so the CPU tests count what a GPU would compile.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

import torch

from .backend import INTERPRETED, launch_guard

try:  # Triton's launcher's specialization of one argument (C++; no GPU needed)
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
except ImportError:  # pragma: no cover - an older Triton: keys by type and value class instead
    BaseBackend = native_specialize_impl = None

# Where this Triton allows it (3.3 onwards), the scattered copies launch through the compiled
# kernel's own launcher, skipping Triton's argument dispatch (~10-20 us of host time a launch).
FAST_LAUNCH = True

COMPILE_LOCK = threading.Lock()  # around every compile (a warm-up, or a variant first met late)
SEEN: dict[tuple, str] = {}  # variant key -> "warm" (warmed at start) or "late" (first met when launched)
LATE: list[tuple] = []  # the variants first met by a launch (not warmed): each a compile while serving
LAUNCHES: Counter = Counter()  # variant key -> launches through Triton's dispatch (launch(): the CPU, tests)
_COMPILED: dict[tuple, object] = {}  # (variant key, device index) -> the compiled kernel (CUDA)


_FLAGS: dict[int, tuple] = {}  # id(kernel) -> (name, per argument: (specialize, align))


def _flags(kernel) -> tuple:
    """The kernel's name and, per argument in order, whether Triton specializes its value and its
    alignment (``do_not_specialize`` / ``do_not_specialize_on_alignment``), computed once."""
    flags = _FLAGS.get(id(kernel))
    if flags is None:
        kw = getattr(kernel, "kwargs", None)
        if kw is None:  # a JITFunction: its params carry the flags
            params = getattr(kernel, "params", ())
            no_spec = {p.name for p in params if p.do_not_specialize}
            no_align = {p.name for p in params if p.do_not_specialize_on_alignment}
        else:  # an InterpretedFunction: the decorator's arguments
            no_spec = set(kw.get("do_not_specialize") or ())
            no_align = set(kw.get("do_not_specialize_on_alignment") or ())
        name = getattr(kernel, "__name__", None) or getattr(kernel.fn, "__name__", "?")
        flags = _FLAGS[id(kernel)] = (name, tuple((n not in no_spec, n not in no_align) for n in kernel.arg_names))
    return flags


def _arg_names(kernel) -> list[str]:
    return list(kernel.arg_names)


_I32, _I64, _U64 = ("i32", None), ("i64", None), ("u64", None)
_TENSOR_SPECS: dict = {}  # (dtype, specialize) -> a tensor's specialization when its alignment is not specialized


def _spec(arg, specialize: bool, align: bool):
    # The cases saria's launches meet most, without the C++ call (~1 us a tensor): an unspecialized
    # int is its type alone, a tensor without alignment its dtype alone (tests check both against
    # Triton's own function).
    kind = type(arg)
    if kind is int and not specialize:
        return _I32 if -2**31 <= arg < 2**31 else _I64 if -2**63 <= arg < 2**63 else _U64
    if not align and kind is torch.Tensor:
        spec = _TENSOR_SPECS.get((arg.dtype, specialize))
        if spec is None and native_specialize_impl is not None:
            spec = _TENSOR_SPECS[(arg.dtype, specialize)] = native_specialize_impl(BaseBackend, arg, False,
                                                                                   specialize, False)
        if spec is not None:
            return spec
    if native_specialize_impl is not None:
        return native_specialize_impl(BaseBackend, arg, False, specialize, align)
    if isinstance(arg, torch.Tensor):  # pragma: no cover
        return (str(arg.dtype), align and arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):  # pragma: no cover
        return ("u1",)
    if isinstance(arg, int):  # pragma: no cover
        kind = "i32" if -2**31 <= arg < 2**31 else "i64"
        return (kind, None if not specialize else ("1" if arg == 1 else "D" if arg % 16 == 0 else ""))
    return (type(arg).__name__,)  # pragma: no cover


def variant_key(kernel, args: tuple, consts: dict, num_warps: int) -> tuple:
    """The variant Triton compiles for a launch of ``kernel`` with positional ``args`` (every
    non-constexpr argument, in order), constexprs ``consts`` and ``num_warps``."""
    name, flags = _flags(kernel)
    specs = tuple([_spec(a, s, al) for a, (s, al) in zip(args, flags)])
    return (name, specs, tuple(sorted(consts.items())), num_warps)


def note(key: tuple, how: str) -> bool:
    """Record ``key``; True if it is new (the caller compiles it, under :data:`COMPILE_LOCK`)."""
    if key in SEEN:
        return False
    SEEN[key] = how
    if how == "late":
        LATE.append(key)
    return True


def launch(kernel, grid: tuple, args: tuple, consts: dict, num_warps: int) -> None:
    """Launch ``kernel`` through Triton's dispatch: a variant not warmed is recorded (:data:`LATE`)
    and, on a GPU, compiled under :data:`COMPILE_LOCK`."""
    key = variant_key(kernel, args, consts, num_warps)
    LAUNCHES[key] += 1
    if key in SEEN:
        with launch_guard():
            kernel[grid](*args, **consts, num_warps=num_warps)
        return
    with COMPILE_LOCK:
        note(key, "late")
        with launch_guard():
            kernel[grid](*args, **consts, num_warps=num_warps)


def warm(kernel, device: torch.device, args: tuple, consts: dict, num_warps: int) -> tuple:
    """Compile (CUDA; under the interpreter only record) the variant of a launch with these
    arguments, without launching it. Returns its key."""
    key = variant_key(kernel, args, consts, num_warps)
    with COMPILE_LOCK:
        new = key not in SEEN
        if new:
            SEEN[key] = "warm"
        if device.type == "cuda" and not INTERPRETED and (key, device.index) not in _COMPILED:
            with torch.cuda.device(device):
                grid = (1, 1, 1)
                _COMPILED[(key, device.index)] = kernel.warmup(*args, **consts, num_warps=num_warps, grid=grid)
    return key


def launcher_for(kernel, device: torch.device, grid: tuple, args: tuple, consts: dict, num_warps: int) -> Callable:
    """``run(stream=None)``: one launch of ``kernel`` over ``grid``. On CUDA, where this Triton
    allows it, through the compiled kernel's own launcher (the variant compiled at most once per
    process, under :data:`COMPILE_LOCK`); else through :func:`launch`."""

    def dispatch(stream=None):
        launch(kernel, grid, args, consts, num_warps)

    if device.type != "cuda" or INTERPRETED or not FAST_LAUNCH:
        return dispatch
    key = variant_key(kernel, args, consts, num_warps)
    index = device.index
    compiled = _COMPILED.get((key, index))
    if compiled is None:
        with COMPILE_LOCK:
            note(key, "late")
            compiled = _COMPILED.get((key, index))
            if compiled is None:
                with torch.cuda.device(device):
                    compiled = kernel.warmup(*args, **consts, num_warps=num_warps, grid=grid)
                _COMPILED[(key, index)] = compiled
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    names = _arg_names(kernel)
    # This Triton's launcher takes every argument, constexprs included, in order (3.3 onwards).
    if not isinstance(signature, dict) or list(signature) != names or any(
            signature[c] != "constexpr" for c in consts):
        return dispatch
    with torch.cuda.device(device):  # the first one loads the module into this device's context
        runner = compiled[grid + (1,) * (3 - len(grid))]  # the launcher reads three axes
    values = args + tuple(consts[name] for name in names[len(args):])

    def fast(stream=None):
        runner(*values, stream=stream)

    return fast

"""What kvikio would do on this machine, decided once for ``saria doctor`` and the SSD store.

:func:`kvikio_status` says it (not usable and why, or ``"gds"`` / ``"compat"`` mode):
:func:`kvikio_facts` observes (every kvikio query guarded: a broken install never breaks the
doctor or the store) and the pure :func:`decide_kvikio` decides. :func:`choose_backend` turns it
into the store's payload backend; :func:`~saria.dataplane.ssd.backends.open_payload_io` and
``saria doctor`` read that one decision, so they cannot disagree (on the first H200 run the doctor
said "import failed" while the store used kvikio). kvikio 26 reads its settings with
``kvikio.defaults.get(name)``; ``compat_mode()`` is gone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from saria.dataplane.ssd.errors import StoreConfigError

BACKENDS = ("auto", "posix", "kvikio")

KVIKIO_DISTRIBUTIONS = ("kvikio-cu13", "kvikio-cu12", "kvikio")
KVIKIO_HINT = "pip install 'saria[gds]' on a GPU machine"
NO_CUDA = "no CUDA device here (kvikio loads libcuda even in compat mode)"
# kvikio's C++ ``enum class CompatMode : uint8_t { OFF, ON, AUTO }``, for a value seen as a plain int.
_COMPAT_NAMES = {0: "OFF", 1: "ON", 2: "AUTO"}


@dataclass(frozen=True)
class KvikioStatus:
    """What kvikio would do on this machine: decided by :func:`decide_kvikio` from the facts
    :func:`kvikio_facts` observes (:func:`kvikio_status` does both). ``saria doctor`` and the SSD
    store's backend choice (:func:`choose_backend`, :func:`open_payload_io`) read the same one.

    * ``installed`` / ``version``: a kvikio distribution (or an importable ``kvikio``) and its version.
    * ``cuda``: torch sees a CUDA device (kvikio needs libcuda even in compat mode).
    * ``usable``: the SSD store's ``auto`` backend would use kvikio; ``reason`` says why (not).
    * ``compat_mode``: the compat mode asked for (``kvikio.defaults.get("compat_mode")``: ``"OFF"``,
      ``"ON"`` or ``"AUTO"``; ``KVIKIO_COMPAT_MODE`` sets it).
    * ``compat_preferred``: ``kvikio.defaults.is_compat_mode_preferred()``: kvikio does its own
      POSIX I/O (ON, or AUTO without cuFile).
    * ``gds_available``: ``kvikio.cufile_driver.get("is_gds_available")`` (the nvidia-fs driver
      behind cuFile); queried only when compat mode is not preferred.
    * ``gds_active``: cuFile with GPUDirect Storage moves the bytes: usable, compat mode not
      preferred and GDS available. ``mode``: ``"gds"`` or ``"compat"`` when usable, else ``None``.
    * ``errors``: the kvikio queries that raised, ``{query: "Error: message"}``.
    """

    installed: bool
    version: str | None
    cuda: bool
    usable: bool
    reason: str
    compat_mode: str | None = None
    compat_preferred: bool | None = None
    gds_available: bool | None = None
    gds_active: bool = False
    mode: str | None = None
    libcufile_version: str | None = None
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str | None:
        """The SSD store's ``backend_name`` when it uses kvikio: ``"kvikio (GDS)"`` or
        ``"kvikio (compat mode)"``; ``None`` when kvikio is not usable."""
        if not self.usable:
            return None
        return "kvikio (GDS)" if self.mode == "gds" else "kvikio (compat mode)"

    @property
    def description(self) -> str | None:
        """One line for people (``saria doctor``'s storage backend), ``None`` when not usable."""
        if not self.usable:
            return None
        if self.mode == "gds":
            return "kvikio (GDS)"
        if self.compat_preferred:
            return "kvikio (compat mode: kvikio's POSIX reads, no GPUDirect)"
        return "kvikio (compat mode: cuFile's POSIX fallback, no GPUDirect)"

    @property
    def brief(self) -> str:
        """A few words: ``"GDS"``, ``"compat mode"``, or why kvikio is not used."""
        if self.usable:
            return "GDS" if self.mode == "gds" else "compat mode"
        if not self.installed:
            return "not installed" + ("" if self.cuda else ", no CUDA device")
        if not self.cuda:
            return "installed, but no CUDA device"
        if self.reason.startswith("import failed"):
            return "import failed"
        return "compat mode could not be queried"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


def decide_kvikio(*, installed: bool, cuda: bool, version: str | None = None, import_error: str | None = None,
                  compat_mode: str | None = None, compat_preferred: bool | None = None,
                  gds_available: bool | None = None, libcufile_version: str | None = None,
                  errors: dict[str, str] | None = None) -> KvikioStatus:
    """What kvikio would do, from observed facts (a pure function: the arguments are what
    :func:`kvikio_facts` saw; ``None`` for a fact means it could not be observed).

    kvikio is used when it is installed, CUDA is there, it imports and its compat-mode query
    answers. Its mode is ``"gds"`` only when compat mode is not preferred and GDS is available
    (cuFile then does GPUDirect Storage); otherwise ``"compat"``: kvikio's own POSIX path (compat
    mode preferred), or cuFile's POSIX fallback (cuFile loaded but no nvidia-fs, or GDS
    availability unknown: GDS is never claimed without being seen).
    """
    errors = dict(errors or {})
    base = dict(installed=installed, version=version, cuda=cuda, compat_mode=compat_mode,
                compat_preferred=compat_preferred, gds_available=gds_available,
                libcufile_version=libcufile_version, errors=errors)

    def refused(reason: str) -> KvikioStatus:
        return KvikioStatus(usable=False, reason=reason, **base)

    def used(mode: str, reason: str) -> KvikioStatus:
        return KvikioStatus(usable=True, reason=reason, mode=mode, gds_active=mode == "gds", **base)

    if not installed:
        return refused(f"not installed ({KVIKIO_HINT})" + ("" if cuda else f"; and {NO_CUDA}"))
    if not cuda:
        return refused(NO_CUDA)
    if import_error is not None:
        return refused(f"import failed: {import_error}")
    if compat_preferred is None:
        seen = "; ".join(f"{k}: {v}" for k, v in errors.items())
        return refused("cannot tell whether kvikio would use GDS or its compat mode"
                       + (f" ({seen})" if seen else ""))
    asked = f"compat mode {compat_mode or 'unknown'}"
    if compat_preferred:
        why = {"ON": "compat mode ON was asked for (KVIKIO_COMPAT_MODE or kvikio.defaults)",
               "AUTO": "compat mode AUTO chose compat: kvikio finds cuFile unavailable here"}.get(
                   compat_mode, f"{asked}, compat preferred")
        return used("compat", f"{why}; kvikio reads and writes with its own POSIX path, no GPUDirect")
    if gds_available:
        return used("gds", f"{asked}, GDS available: cuFile with GPUDirect Storage (under AUTO a file "
                           "whose filesystem cuFile cannot register still falls back to compat mode)")
    if gds_available is False:
        why = "GDS is not available (no nvidia-fs driver)"
    else:
        why = "GDS availability is unknown (" + errors.get("is_gds_available", "not observed") + ")"
    return used("compat", f"{asked}, cuFile loaded but {why}: cuFile's POSIX fallback, no GPUDirect")


def _compat_name(value) -> str:
    """``"OFF"`` / ``"ON"`` / ``"AUTO"`` for a ``kvikio.CompatMode`` (an enum whose ``str`` is its
    number on Python >= 3.11), a plain int, or an older kvikio's bool."""
    if isinstance(value, bool):
        return "ON" if value else "OFF"
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name.upper()
    try:
        return _COMPAT_NAMES.get(int(value), str(value))
    except (TypeError, ValueError):
        return str(value).rsplit(".", 1)[-1].upper()


def _installed_version() -> tuple[bool, str | None]:
    for dist in KVIKIO_DISTRIBUTIONS:
        try:
            return True, importlib.metadata.version(dist)
        except Exception:  # PackageNotFoundError, or broken metadata
            continue
    try:
        return importlib.util.find_spec("kvikio") is not None, None
    except Exception:
        return False, None


def kvikio_facts(cuda: bool | None = None) -> dict:
    """What this machine shows about kvikio, as keyword arguments of :func:`decide_kvikio`. Every
    kvikio query is guarded: one that raises is recorded in ``errors`` and its fact is ``None``.
    kvikio is imported only when CUDA is there (``cuda``: ``None`` asks torch)."""
    errors: dict[str, str] = {}
    if cuda is None:
        try:
            cuda = bool(torch.cuda.is_available())
        except Exception as exc:
            cuda = False
            errors["torch.cuda.is_available"] = f"{type(exc).__name__}: {exc}"
    installed, version = _installed_version()
    facts: dict = {"installed": installed, "cuda": cuda, "version": version, "errors": errors}
    if not installed or not cuda:
        return facts
    try:
        import kvikio
        import kvikio.defaults as defaults
    except Exception as exc:  # a broken install: missing libkvikio, libcuda, wrong CUDA major...
        facts["import_error"] = f"{type(exc).__name__}: {exc}"
        return facts
    facts["version"] = version or getattr(kvikio, "__version__", None)

    def query(what: str, fn):
        try:
            return fn()
        except Exception as exc:
            errors[what] = f"{type(exc).__name__}: {exc}"
            return None

    if hasattr(defaults, "get"):  # kvikio >= 25: defaults.get(name); compat_mode() is gone in 26.x
        compat = query("compat_mode", lambda: defaults.get("compat_mode"))
    else:
        compat = query("compat_mode", lambda: defaults.compat_mode())
    facts["compat_mode"] = None if compat is None else _compat_name(compat)
    if hasattr(defaults, "is_compat_mode_preferred"):
        preferred = query("is_compat_mode_preferred", defaults.is_compat_mode_preferred)
    else:  # an older kvikio: ON / OFF say it, AUTO cannot be told
        preferred = {"ON": True, "OFF": False}.get(facts["compat_mode"])
        if preferred is None:
            errors["is_compat_mode_preferred"] = "not in this kvikio version"
    facts["compat_preferred"] = None if preferred is None else bool(preferred)

    def driver():
        import kvikio.cufile_driver
        return kvikio.cufile_driver

    if preferred is False:  # cuFile will be used: is GDS behind it?
        gds = query("is_gds_available", lambda: driver().get("is_gds_available"))
        facts["gds_available"] = None if gds is None else bool(gds)
    major_minor = query("libcufile_version", lambda: tuple(driver().libcufile_version()))
    if major_minor and tuple(major_minor) != (0, 0):  # (0, 0): none, or older than cuFile 1.8
        facts["libcufile_version"] = ".".join(str(v) for v in major_minor)
    return facts


def kvikio_status(cuda: bool | None = None) -> KvikioStatus:
    """:func:`decide_kvikio` on this machine's :func:`kvikio_facts`. Never raises."""
    return decide_kvikio(**kvikio_facts(cuda))


@dataclass(frozen=True)
class StorageChoice:
    """The SSD store's payload backend for one ``backend`` setting, and why.

    ``name`` is what :attr:`SSDStore.backend_name` reports (``"posix"``, ``"kvikio (GDS)"``,
    ``"kvikio (compat mode)"``); ``description`` is ``saria doctor``'s storage backend line."""

    backend: str  # "posix" or "kvikio"
    mode: str | None  # kvikio's "gds" / "compat"; None for posix
    name: str
    description: str
    reason: str
    kvikio: KvikioStatus

    def as_dict(self) -> dict:
        return {"backend": self.backend, "mode": self.mode, "name": self.name, "description": self.description,
                "reason": self.reason, "gds_active": self.kvikio.gds_active if self.backend == "kvikio" else False}


POSIX_DESCRIPTION = "posix (pread/pwrite on a thread pool"


def choose_backend(backend: str, status: KvikioStatus) -> StorageChoice:
    """The payload backend for ``backend`` (``auto``: kvikio when ``status`` says it is usable,
    else POSIX). ``backend="kvikio"`` where kvikio cannot run is a :class:`StoreConfigError`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "posix":
        reason = "backend='posix' was asked for"
        return StorageChoice("posix", None, "posix", f"{POSIX_DESCRIPTION}; asked for)", reason, status)
    if status.usable:
        return StorageChoice("kvikio", status.mode, status.name, status.description, status.reason, status)
    if backend == "kvikio":
        if not status.cuda:
            raise StoreConfigError("backend='kvikio' needs CUDA: kvikio loads libcuda even in compat mode, and "
                                   "this machine has no usable CUDA device; use backend='posix' or 'auto'")
        if not status.installed:
            raise StoreConfigError("backend='kvikio' but kvikio is not installed; install saria[gds] or use "
                                   "backend='posix'")
        raise StoreConfigError(f"backend='kvikio' but kvikio is not usable here ({status.reason}); "
                               "use backend='posix' or 'auto'")
    return StorageChoice("posix", None, "posix", f"{POSIX_DESCRIPTION}; kvikio {status.brief})",
                         f"kvikio {status.reason}", status)


def probe_kvikio_open(path: str | os.PathLike) -> str | None:
    """Open and close a ``kvikio.CuFile`` on a temporary file in directory ``path``, as the SSD
    store opens its drive files: ``None`` when that works, else why not (never raises)."""
    name = None
    try:
        import kvikio

        fd, name = tempfile.mkstemp(prefix=".saria-kvikio-probe-", dir=path)
        os.close(fd)
        f = kvikio.CuFile(name, "r+")
        f.close()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if name is not None:
            try:
                os.unlink(name)
            except OSError:
                pass



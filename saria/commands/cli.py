"""The ``saria`` command."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from saria.argtypes import host_port, int_range


def _cmd_serve(args: argparse.Namespace) -> int:
    from saria.commands import serve
    return serve.main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from saria.commands import doctor
    report = doctor.collect(ssd_path=args.ssd_path, cluster=args.cluster, secret_file=args.secret_file)
    print(json.dumps(report, indent=2) if args.json else doctor.render(report))
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    from saria.commands import cluster
    return cluster.main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from saria.commands import demo
    return demo.main(args)


def _cmd_roundtrip(args: argparse.Namespace) -> int:
    from saria.commands import roundtrip
    return roundtrip.main(args)


def _cmd_keys(args: argparse.Namespace) -> int:
    from saria.commands import keys
    return keys.main(args)


def one_line_errors(p: argparse.ArgumentParser) -> None:
    """Bad arguments: one line and exit 2, without the usage (serve's, with its passthrough, is long;
    cluster start's would bury the one line that matters)."""

    def error(message: str):
        print(f"{p.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    p.error = error  # type: ignore[method-assign]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="saria",
        description="saria: KV-cache tiering for LLM agent serving (GPU <-> pinned DRAM <-> NVMe SSD).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from saria.commands import serve  # light: vLLM is imported only when the server starts

    p = sub.add_parser("serve", help="start vLLM's OpenAI-compatible server with saria as its KV connector",
                       usage=serve.USAGE, description=serve.__doc__, epilog=serve.EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    serve.add_arguments(p)
    one_line_errors(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("doctor", help="report torch / triton / CUDA / NVML / kvikio and the backends saria would use",
                       description="Report what this machine offers saria: torch, triton, CUDA devices, NVML, "
                                   "kvikio, which kernel and storage backends would be used, pinned-memory limits, "
                                   "which tiers are sealed (--secret-file); with --cluster, whether a Mooncake master is usable as saria's cluster tier. "
                                   "The exit status is 0 whatever the report finds (--json: cluster.ok says "
                                   "whether the cluster is usable).")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--ssd-path", metavar="DIR", default=None,
                   help="directory to probe for O_DIRECT (the SSD store's drive path; default: the system temp dir)")
    p.add_argument("--cluster", metavar="HOST:PORT", type=host_port, default=None,
                   help="also check this Mooncake master (its RPC address, as given to saria serve --cluster): "
                        "Mooncake importable, the port open, a client that sets up against it and answers a "
                        "probe (within a few seconds, whatever the master does)")
    p.add_argument("--secret-file", metavar="PATH", default=None,
                   help="also load this key file as saria serve --secret-file would (refused if group or other "
                        "can read it) and report which tiers it seals (without it: which tiers are unsealed)")
    p.set_defaults(func=_cmd_doctor)

    from saria.commands import cluster  # light: Mooncake is imported only when a cluster starts

    p = sub.add_parser("cluster", help="run Mooncake Store for saria's cluster tier on this host (cluster start)",
                       description="Mooncake Store for saria's cluster tier (docs/cluster.md). `saria cluster start "
                                   "--help` for the one action: a master and a storage node on this host, in the "
                                   "foreground.")
    start = cluster.add_arguments(p)
    one_line_errors(p)
    one_line_errors(start)
    start.set_defaults(func=_cmd_cluster)

    from saria.commands import keys  # light: the seal package is imported only when an action runs

    p = sub.add_parser("keys", help="make, show, rotate, retire and rekey the key file that seals shared tiers",
                       description=keys.__doc__, epilog=keys.EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for action in keys.add_arguments(p):
        one_line_errors(action)
        action.set_defaults(func=_cmd_keys)
    one_line_errors(p)

    from saria.commands import demo  # light: vLLM is imported only by the session subprocesses

    p = sub.add_parser("demo", help="run the main job: a multi-turn agent session through vLLM with saria",
                       description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("roundtrip", help="pack / checksum / unpack a Qwen3-8B-shaped paged cache, verified",
                       description="Pack chunks of a Qwen3-8B-shaped paged KV cache (36 layers, 8 KV heads, head dim "
                                   "128, bf16, 16-token pages) into staging, checksum them, unpack into a fresh cache "
                                   "and verify every byte, with the Triton kernels (compiled on CUDA, interpreted on "
                                   "CPU) and the fast torch path.")
    p.add_argument("--chunks", type=int_range(1, 4096), default=None,
                   help="chunks to pack in one call (default 2 on CUDA, 1 on CPU where the interpreter is slow)")
    p.add_argument("--chunk-tokens", type=int_range(16, 1 << 20), default=512,
                   help="tokens per chunk, a multiple of the 16-token page (default 512, 32 pages)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.set_defaults(func=_cmd_roundtrip)

    from saria.replay.cli import add_commands as add_replay_commands  # replay, sweep, tune, synth

    add_replay_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit status: 0 done; 2 bad arguments, input or environment (one message
    naming what is wrong, no traceback); 1 a bug in saria (said so, with the traceback); 130
    interrupted."""
    from saria.replay.replay import ReplayInternalError

    parser = build_parser()
    # bad arguments: argparse's usage error, status 2. `serve` passes what it does not know to vLLM.
    args, unknown = parser.parse_known_args(argv)
    if args.command == "serve":
        args.vllm_args = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    name = getattr(args, "command_name", args.command)  # "cluster start": the parser's own prog
    try:
        return args.func(args)
    except ReplayInternalError as exc:  # a bug, not bad input: one line that says so, then the traceback
        print(f"saria {name}: {exc}", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
        return 1
    except ValueError as exc:  # bad input: every check in saria raises a ValueError that says what is wrong
        print(f"saria {name}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine refused: a file, a folder, memory for pinned pages, a child process
        where = f": {exc.filename}" if exc.filename else ""
        print(f"saria {name}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"saria {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - anything else is a bug: say so, with what to report
        print(f"saria {name}: internal error (a bug in saria; please report it with the traceback "
              f"below): {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""``saria replay --replicas N --router R --cluster-gb G ...``: the fleet options and their command.

The options are registered on ``saria replay`` by :func:`add_fleet_options`; a command line with
more than one replica or a cluster tier runs :func:`fleet_replay` (``saria.replay.fleet``) instead
of the single-server replay. See docs/replay.md#fleet-replay.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from saria.argtypes import float_range, int_range
from saria.outputs import write_output
from saria.replay.experiment import Experiment
from saria.replay.fleet import CLUSTER_ADMISSIONS, MAX_REPLICAS, ROUTERS, FleetSettings, check_fleet_config
from saria.replay.fleet_report import FleetJob, format_fleet_table, run_fleets, summarize_fleet
from saria.replay.layerwise import LAYERWISE_SUFFIX
from saria.replay.report import json_text, write_csv

__all__ = ["add_fleet_options", "fleet_replay", "fleet_wanted"]

_GBPS = float_range(1e-3, 1e5)  # as saria.replay.cli's bandwidths


def add_fleet_options(p: argparse.ArgumentParser) -> None:
    """The fleet options of ``saria replay``."""
    g = p.add_argument_group("fleet (docs/replay.md#fleet-replay)")
    g.add_argument("--replicas", type=int_range(1, MAX_REPLICAS), default=1, metavar="N",
                   help="simulate N replicas, each with its own DRAM and SSD tiers (the capacities above) under the "
                        "policy, sharing the trace's arrivals through --router (default 1: one server)")
    g.add_argument("--router", choices=ROUTERS, default="session",
                   help="random (seeded by --seed), session (sticky: a session's requests to one replica, by hash; "
                        "default) or least-loaded (fewest outstanding prompt tokens)")
    g.add_argument("--cluster-gb", type=float_range(0.0, 1e7), default=0.0, metavar="GB",
                   help="a cluster tier shared by the replicas (a Mooncake Store pool: LRU by bytes), in GB (1e9 "
                        "bytes); each run is reported without it and with it. Default 0: no cluster tier")
    g.add_argument("--cluster-gbps", type=_GBPS, default=25.0, metavar="GB/s",
                   help="cluster reads and puts per replica (its network link; default 25, a 200 Gb/s NIC)")
    g.add_argument("--cluster-admission", choices=CLUSTER_ADMISSIONS, default="all",
                   help="what the cluster tier is given: all (every chunk a replica computes; default), evicted "
                        "(chunks leaving a replica's DRAM) or shared (chunks referenced by a second session)")


def fleet_wanted(args: argparse.Namespace) -> bool:
    """Whether the command line asks for a fleet replay rather than the single-server one."""
    return args.replicas > 1 or args.cluster_gb > 0


def fleet_replay(args: argparse.Namespace, exp: Experiment, specs, configs, description: str,
                 layerwise: list[bool] = (False,)) -> int:
    """Run ``saria replay``'s fleet: every policy without and (``--cluster-gb`` > 0) with the cluster
    tier, under each reload model of ``layerwise`` (True: layer-wise; with both, the layer-wise rows
    are labelled NAME+lw); print the table and write ``--json`` / ``--csv``."""
    for config in configs:
        check_fleet_config(config)
    cluster_bytes = round(args.cluster_gb * 1e9)
    variants = [FleetSettings(args.replicas, args.router, 0, args.cluster_gbps, args.cluster_admission, args.seed)]
    if cluster_bytes:
        variants.append(FleetSettings(args.replicas, args.router, cluster_bytes, args.cluster_gbps,
                                      args.cluster_admission, args.seed))
    both = len(layerwise) > 1
    jobs = [FleetJob(spec.label + (LAYERWISE_SUFFIX if lw and both else ""), config, fleet,
                     replace(exp.settings, layerwise=lw) if both else None)
            for spec, config in zip(specs, configs) for fleet in variants for lw in layerwise]
    print(description + (f"; reloads sequential and layer-wise ({LAYERWISE_SUFFIX})" if both else ""))
    print(f"fleet: {args.replicas} replicas, router {args.router} (seed {args.seed}), each with the capacities above"
          + (f"; cluster tier {args.cluster_gb:g} GB at {args.cluster_gbps:g} GB/s per replica, admission "
             f"{args.cluster_admission}, against none" if cluster_bytes else "; no cluster tier"))
    runs = run_fleets(exp.trace, exp.chunks, exp.schedule(None), jobs, exp.settings, workers=args.jobs)
    rows = [summarize_fleet(run) for run in runs]
    print(format_fleet_table(rows))
    if args.json:
        config = exp.config_dict([])
        config["fleet"] = {"replicas": args.replicas, "router": args.router, "seed": args.seed,
                           "cluster_bytes": cluster_bytes, "cluster_gbps": args.cluster_gbps,
                           "cluster_admission": args.cluster_admission}
        write_output(args.json, json_text({"trace": args.trace, "config": config, "results": rows}), "--json")
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, rows, "--csv")
        print(f"wrote {args.csv}")
    return 0

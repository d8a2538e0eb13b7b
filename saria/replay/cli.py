"""``saria replay``, ``saria sweep``, ``saria tune`` and ``saria synth``: argument parsing and output.

``saria.commands.cli`` registers these commands with :func:`add_commands`; everything they do lives in
the ``saria.replay`` modules.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from saria.argtypes import float_range, fraction, int_range, listed, parse_size, positive_float, positive_int, tokens
from saria.config import MAX_DRIVES, MAX_THRESHOLD, POLICY_PRESETS, Bandwidths, WriteBudget
from saria.models import MODELS
from saria.replay.arrivals import ARRIVAL_MODES
from saria.replay.experiment import REFERENCES, Experiment, Point, open_trace
from saria.replay.hints import HINT_SOURCES
from saria.replay.fleet_cli import add_fleet_options, fleet_replay, fleet_wanted
from saria.replay.layerwise import LAYERWISE_SUFFIX
from saria.replay.layerwise_cli import add_step_options, describe_step, layerwise_runs, one_reload_model, run_both, \
    step_settings
from saria.replay.policies import BaseSettings, parse_policy
from saria.replay.replay import ReplaySettings
from saria.outputs import atomic_output, check_output, is_stream, same_file_check, write_output
from saria.replay.report import (PlotUnavailable, check_plot_path, format_table, json_text, plot_results,
                                 plot_tradeoffs, write_csv, write_json)
from saria.replay.synth import SessionStats, synthesize
from saria.replay.timing import LOADING_MODES
from saria.replay.traces import MAX_SPAN_S, MAX_TOKENS
from saria.ssd_dtype import SSD_DTYPES

__all__ = ["add_commands"]

DEFAULT_POLICIES = ("saria", "full-duplicate", "dram-only", "lmcache-plus")
# Physical settings within orders of magnitude of any real machine: outside, a value is a typo.
_GBPS = float_range(1e-3, 1e5)  # 1 MB/s to 100 TB/s
_HOURS = float_range(1e-3, MAX_SPAN_S / 3600)  # 3.6 s to the longest span a trace may have
_CHUNK_TOKENS = int_range(1, MAX_TOKENS)
_THRESHOLD = int_range(1, MAX_THRESHOLD)

# ========================================================================================= arguments
def _add_common(p: argparse.ArgumentParser, *, budget_required: bool = False) -> None:
    p.add_argument("trace", metavar="TRACE",
                   help="Mooncake JSON Lines (timestamp ms, input_length, output_length, hash_ids, optional "
                        "session_id), TraceLab rounds JSON Lines, or synth[:key=value,...] for the synthetic "
                        "agent-session generator (paper §5.1 TraceLab statistics; keys: "
                        + ", ".join(f.name for f in fields(SessionStats)) + ")")
    g = p.add_argument_group("trace")
    g.add_argument("--format", choices=("auto", "mooncake", "tracelab"), default="auto",
                   help="trace format (default: from the first record)")
    g.add_argument("--block-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens per trace block: 512 for Mooncake traces, 64 for ../shared/traces/agent_*; default: "
                        "inferred from hash_ids lengths (each request has ceil(input_length / N)); for TraceLab the "
                        "reconstruction's block size (default 64)")
    g.add_argument("--time-unit", choices=("ms", "s"), default="ms",
                   help="unit of Mooncake timestamps (default ms, as the format specifies); arrivals that only make "
                        "sense in the other unit are an error that says so")
    g.add_argument("--no-time-check", action="store_true", help="skip the timestamp unit checks")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="load every well-formed line and report the malformed ones (default: any malformed line is "
                        "an error listing them all by line number)")
    g = p.add_argument_group("model and cache")
    g.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b",
                   help="KV footprint (saria.models; sources noted there). Default qwen3-8b")
    g.add_argument("--dram-tokens", type=tokens, default=1_000_000, metavar="N",
                   help="DRAM cache capacity in full-attention tokens (default 1M, the paper's)")
    g.add_argument("--ssd-tokens", type=tokens, default=10_000_000, metavar="N",
                   help="SSD cache capacity in full-attention tokens (default 10M, the paper's)")
    g.add_argument("--chunk-tokens", type=_CHUNK_TOKENS, default=None, metavar="N",
                   help="tokens per cached chunk, a multiple of the trace block (default 512; 1024 for hybrid models)")
    g.add_argument("--checkpoint-tokens", type=_CHUNK_TOKENS, default=16_384, metavar="N",
                   help="hybrid models: a GDN checkpoint every N tokens (default 16384)")
    g.add_argument("--ssd-dtype", choices=SSD_DTYPES, default="auto",
                   help="how the SSD tier stores kv objects: auto (as the cache holds them, bf16; default) or fp8 "
                        "(FP8 e4m3 with a float32 scale per 128 elements: 0.516x the bytes). --ssd-tokens stays the "
                        "same bytes on the drives, so fp8 holds ~1.94x the chunks; SSD writes, reads, the write "
                        "budget and reload times count the fp8 bytes; DRAM copies and GDN states stay full size")
    g = p.add_argument_group("model of time")
    g.add_argument("--b-gpu", type=_GBPS, default=48.0, metavar="GB/s", help="GPU ingress (default 48)")
    g.add_argument("--b-disk", type=_GBPS, default=20.0, metavar="GB/s",
                   help="SSD read bandwidth per drive, GDS (default 20)")
    g.add_argument("--drives", type=int_range(1, MAX_DRIVES), default=1,
                   help=f"SSDs objects are striped over, 1 to {MAX_DRIVES} (default 1)")
    g.add_argument("--b-dram", type=_GBPS, default=48.0, metavar="GB/s",
                   help="DRAM -> GPU copies, and GPU -> DRAM stores and promotions (default 48)")
    g.add_argument("--b-disk-write", type=_GBPS, default=None, metavar="GB/s",
                   help="SSD write bandwidth per drive (default: --b-disk)")
    g.add_argument("--loading", choices=LOADING_MODES, default="coordinated",
                   help="how a plan's DRAM and SSD parts share ingress: coordinated (Eq. 4, default), overlap "
                        "(uncoordinated), serial, or ideal; plans of serial-loading policies (lmcache-plus) load "
                        "serially whatever this says")
    add_step_options(g)
    g.add_argument("--inflight", type=positive_int, default=4,
                   help="requests loading or computing at once (default 4)")
    g = p.add_argument_group("arrivals")
    g.add_argument("--arrivals", choices=ARRIVAL_MODES, default="auto",
                   help="recorded: the trace's timestamps; rewindow: keep each session's requests and gaps, draw "
                        "session starts with Gamma(k=1) gaps within --window-hours (sessions inferred by prefix "
                        "chaining when the trace has no session ids); auto (default): rewindow when the trace "
                        "has session ids, else recorded")
    g.add_argument("--window-hours", type=_HOURS, default=12.0, metavar="H",
                   help="session-start window of re-windowed arrivals (default 12, the paper's lower load)")
    g.add_argument("--seed", type=int_range(0), default=0, help="seed of the session starts (default 0)")
    g.add_argument("--truncate-hours", type=_HOURS, default=None, metavar="H",
                   help="replay only requests arriving within H hours of the first (the paper truncates at 24); "
                        "the write budget then covers exactly H hours (default: everything, first arrival to "
                        "last event)")
    g = p.add_argument_group("SSD endurance")
    g.add_argument("--dwpd", type=positive_float, default=1.0, required=budget_required,
                   help="rated drive writes per day" + ("" if budget_required else " (default 1)"))
    g.add_argument("--ssd-capacity", type=parse_size, default=None, required=budget_required, metavar="SIZE",
                   help="capacity the endurance budget is rated on, e.g. 3.84TB or 800GiB"
                        + ("" if budget_required else " (default: the SSD cache capacity, --ssd-tokens)"))
    g = p.add_argument_group("execution")
    g.add_argument("--jobs", type=positive_int, default=None,
                   help="replays run at once in separate processes (default: one per CPU)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (it only shows on a terminal anyway)")


def _base(args: argparse.Namespace, auto: bool = False) -> BaseSettings:
    budget = WriteBudget(dwpd=args.dwpd, capacity_bytes=args.ssd_capacity, auto=auto)
    return BaseSettings(model=args.model, dram_tokens=args.dram_tokens, ssd_tokens=args.ssd_tokens,
                        chunk_tokens=args.chunk_tokens, checkpoint_tokens=args.checkpoint_tokens,
                        bandwidth=Bandwidths(args.b_gpu, args.b_disk, args.drives, args.b_dram), write_budget=budget,
                        ssd_dtype=args.ssd_dtype)


def _experiment(args: argparse.Namespace, auto: bool = False) -> Experiment:
    trace = open_trace(args.trace, fmt=args.format, block_tokens=args.block_tokens, time_unit=args.time_unit,
                       skip_bad_lines=args.skip_bad_lines, check_units=not args.no_time_check)
    for line in trace.skipped[:10]:
        print(f"skipped {line}", file=sys.stderr)
    if len(trace.skipped) > 10:
        print(f"skipped {len(trace.skipped) - 10} more malformed lines", file=sys.stderr)
    settings = ReplaySettings(inflight=args.inflight, loading=args.loading, disk_write_gbps=args.b_disk_write,
                              truncate_hours=args.truncate_hours, **step_settings(args))
    return Experiment(trace, args.trace, _base(args, auto), settings, arrivals=args.arrivals,
                      window_hours=args.window_hours, seed=args.seed, workers=args.jobs, progress=not args.no_progress)


def _policy(spec: str, flag: str):
    """``spec`` parsed, an error naming ``flag``."""
    try:
        return parse_policy(spec)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path the command was given, checked before any work (see saria.outputs)."""
    outputs = {f"--{flag}": getattr(args, flag, None) for flag in ("json", "csv", "plot")}
    for flag, path in outputs.items():
        if flag == "--plot" and path is not None:
            check_plot_path(path)
        elif path is not None:
            check_output(path, flag)
    same_file_check(outputs, {"TRACE": args.trace})


def _describe(exp: Experiment) -> str:
    trace, base, chunk = exp.trace, exp.base, exp.base.chunk()
    schedule = exp.schedule(None)
    refs = sum(len(c) for c in exp.chunks)
    if schedule.mode == "rewindow":
        how = (f"re-windowed: {len(schedule.sessions):,} sessions"
               f"{' (inferred by prefix chaining)' if schedule.inferred_sessions else ''} starting within "
               f"{exp.window_hours:g} h, seed {exp.seed}")
    else:
        how = f"as recorded over {trace.span_s:,.0f} s"
    return (f"trace {exp.trace_name}: {len(trace.requests):,} requests ({trace.fmt}, "
            f"{trace.block_tokens}-token blocks), {refs:,} chunk references; arrivals {how}\n"
            f"model {base.model}: {chunk.chunk_tokens}-token chunks of {chunk.kv_bytes / 2**20:,.1f} MiB"
            + (f" + {chunk.state_bytes / 2**20:,.1f} MiB GDN checkpoint every {chunk.checkpoint_tokens:,} tokens"
               if chunk.hybrid else "")
            + f"; DRAM {base.dram_tokens:,} tokens, SSD {base.ssd_tokens:,} tokens"
            + (f" of bf16 bytes, kv objects stored as fp8 ({chunk.ssd_kv_bytes('fp8') / 2**20:,.1f} MiB each)"
               if base.ssd_dtype == "fp8" else "") + "\n"
            f"time: GPU {base.bandwidth.gpu_gbps:g} / SSD {base.bandwidth.disk_gbps_per_drive:g} x "
            f"{base.bandwidth.drives} / DRAM {base.bandwidth.dram_gbps:g} GB/s, {exp.settings.loading} loading, "
            f"{exp.settings.inflight} in flight, {describe_step(exp)}")


def _report_plot(draw, path: str, command: str) -> None:
    try:
        draw()
        print(f"wrote {path}")
    except PlotUnavailable as exc:
        print(f"saria {command}: --plot {path} skipped: {exc}", file=sys.stderr)


def _queueing_note(exp: Experiment, runs) -> None:
    """Recorded arrivals that the modeled server cannot keep up with: say so."""
    if exp.schedule(None).mode != "recorded" or exp.trace.span_s <= 0:
        return
    worst = max(runs, key=lambda run: run.duration_s)
    if worst.duration_s > 1.5 * exp.trace.span_s:
        print(f"note: the modeled server cannot keep up with the recorded arrivals ({worst.name} needs "
              f"{worst.duration_s:,.0f} s for a {exp.trace.span_s:,.0f} s trace), so TTFT is mostly queueing; "
              f"raise --prefill-tps or --inflight, or use --arrivals rewindow", file=sys.stderr)


# ============================================================================================ replay
def _cmd_replay(args: argparse.Namespace) -> int:
    specs = [_policy(p, "--policy") for p in (args.policy or DEFAULT_POLICIES)]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a policy is listed twice: {labels}")
    if fleet_wanted(args) and args.hints:
        raise ValueError("--hints: a fleet replay (--replicas > 1 or --cluster-gb > 0) replays no hints yet")
    if fleet_wanted(args) and args.plot:
        raise ValueError("--plot: a fleet replay (--replicas > 1 or --cluster-gb > 0) draws no plot; use --json "
                         "or --csv")
    _check_outputs(args)
    exp = _experiment(args, auto=args.write_budget == "auto")
    configs = [exp.config_for(spec) for spec in specs]
    if args.write_budget == "auto" and not any(c.write_budget.auto for c in configs):
        raise ValueError("--write-budget auto: none of the policies has eviction-based admission to govern "
                         "(saria, zero-promotion, full-promotion do)")
    if fleet_wanted(args):
        return fleet_replay(args, exp, specs, configs, _describe(exp), layerwise_runs(args))
    description = _describe(exp)
    points = [Point(spec.label, config) for spec, config in zip(specs, configs)]
    if args.hints:  # each policy (but the references and the oracle) again, with the application's hints
        points += [Point(f"{spec.label}+hints", config, hint_accuracy=args.hint_accuracy, hint_kind=args.hints)
                   for spec, config in zip(specs, configs)
                   if spec.label not in REFERENCES and config.policy.admission != "oracle"]
        description += (f"; +hints: an application's cache hints derived from the trace ({args.hints}, "
                        f"accuracy {args.hint_accuracy:g})")
    if args.layerwise == "both":
        print(description + f"; reloads sequential and layer-wise ({LAYERWISE_SUFFIX})")
        results, runs = run_both(exp, points)
    else:
        print(description)
        results, runs = exp.run(points)
    print(format_table(results))
    for run in runs:
        if run.governor_history is not None:
            thetas = [theta for _, theta in run.governor_history]
            print(f"governor {run.name}: theta_E {thetas[0]:g} -> {thetas[-1]:.2f}, time-weighted mean "
                  f"{run.governor_mean_theta:.2f}, range {min(thetas):.2f}-{max(thetas):.2f}, "
                  f"{len(thetas) - 1} changes over {run.duration_s / 3600:,.1f} h")
    _queueing_note(exp, runs)
    if args.json:
        write_json(args.json, args.trace, exp.config_dict(runs), results, "--json")
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, results, "--csv")
        print(f"wrote {args.csv}")
    if args.plot:
        _report_plot(lambda: plot_results(args.plot, results, f"{args.trace}: {exp.base.model}"), args.plot, "replay")
    return 0


def _add_hints(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--hints", choices=HINT_SOURCES, default=None,
                   help=f"{what} the cache hints an application could send (trace: traces with multi-turn sessions "
                        "send next_turn_s and done, others pin prefixes shared across sessions; sessions: the "
                        "session hints only; pins: the platform's pins only; docs/replay.md)")
    p.add_argument("--hint-accuracy", type=fraction, default=1.0, metavar="P",
                   help="with --hints: the share of next_turn_s hints that are right (the rest drawn at random "
                        "from the trace's gaps, seeded by --seed)")


def _hinted(args: argparse.Namespace, exp: Experiment) -> None:
    """sweep, tune: every replay but the references' with the hints of --hints."""
    if args.hints:
        exp.hint_accuracy = args.hint_accuracy
        exp.hint_kind = args.hints
        print(f"with an application's cache hints derived from the trace (accuracy {args.hint_accuracy:g}; "
              f"references without)")


# ============================================================================================= sweep
def _cmd_sweep(args: argparse.Namespace) -> int:
    from saria.replay.sweep import SweepGrid, run_sweep

    one_reload_model(args, "sweep")
    base = _policy(args.policy, "--policy")
    grid = SweepGrid(args.theta_e or (), args.theta_r or (), args.r or (), args.windows or ())
    if not any((grid.theta_E, grid.theta_R, grid.r, grid.window_hours)):
        raise ValueError("nothing to sweep: give --theta-e, --theta-r, --r and/or --windows")
    references = [_policy(p, "--reference") for p in (args.reference or ["full-duplicate"]) if p != "none"]
    _check_outputs(args)
    exp = _experiment(args)
    print(_describe(exp))
    _hinted(args, exp)
    rows = run_sweep(exp, base, grid, references)
    print(format_table(rows))
    if args.csv:
        write_csv(args.csv, rows, "--csv")
        print(f"wrote {args.csv}")
    if args.json:
        write_output(args.json, json_text({"trace": args.trace, "config": exp.config_dict([]), "rows": rows}),
                     "--json")
        print(f"wrote {args.json}")
    if args.plot:
        _report_plot(lambda: plot_tradeoffs(args.plot, rows, f"{args.trace}: {exp.base.model} sweep"), args.plot,
                     "sweep")
    return 0


# ============================================================================================== tune
def _cmd_tune(args: argparse.Namespace) -> int:
    from saria.replay.tune import DEFAULT_THETA_E, DEFAULT_THETA_R, tune

    one_reload_model(args, "tune")
    base = _policy(args.policy, "--policy")
    _check_outputs(args)
    exp = _experiment(args)
    print(_describe(exp))
    _hinted(args, exp)
    budget = exp.base.write_budget
    print(f"budget: {budget.dwpd:g} DWPD on {budget.capacity_bytes / 1e12:,.3f} TB = "
          f"{budget.dwpd * budget.capacity_bytes / 86_400 / 1e6:,.1f} MB/s over the replayed duration")
    result = tune(exp, base, theta_E=args.theta_e or DEFAULT_THETA_E, theta_R=args.theta_r or DEFAULT_THETA_R,
                  objective=args.objective)
    learned = "learned_tau" in result.best
    print(f"{'theta_E':>7} {'theta_R':>7}{'     tau' if learned else ''} {'writes GiB':>11} {'budget':>7} {'CHAR':>7} "
          f"{'P25 bad':>7} {'TTFT ms':>9}  fits")
    for row in result.rows:
        tau = f" {row['learned_tau']:>7}" if learned else ""
        print(f"{row['theta_E']:>7} {row['theta_R']:>7}{tau} {row['ssd_write_bytes'] / 2**30:>11,.1f} "
              f"{row['write_budget_ratio']:>7.3f} {_pct(row['char_mean']):>7} {_pct(row['char_p25_bad']):>7} "
              f"{row['ttft_ms_mean']:>9,.1f}  {'yes' if row['feasible'] else 'no'}")
    best = result.best
    tau = f" learned_tau={best['learned_tau']}" if learned else ""
    print(f"best within budget: theta_E={best['theta_E']} theta_R={best['theta_R']}{tau}: CHAR {_pct(best['char_mean'])} "
          f"(P25 bad {_pct(best['char_p25_bad'])}), {best['write_budget_ratio']:.3f} of the budget")
    print(f"use: --policy {result.spec}")
    if args.json:
        write_output(args.json, json_text({"trace": args.trace, "config": exp.config_dict([]), "best": best,
                                           "spec": result.spec, "probes": result.rows}), "--json")
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, result.rows, "--csv")
        print(f"wrote {args.csv}")
    return 0


def _pct(value) -> str:
    return "-" if value is None or value != value else f"{value:.1%}"


# ============================================================================================= synth
def _cmd_synth(args: argparse.Namespace) -> int:
    stats = SessionStats(**{f.name: getattr(args, f.name) for f in fields(SessionStats)})
    check_output(args.out, "OUT")
    trace = synthesize(stats)
    with atomic_output(args.out, "OUT") as f:
        for r in trace.requests:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000.0, 3), "session_id": r.session,
                                "input_length": r.input_tokens, "output_length": r.output_tokens,
                                "hash_ids": list(r.blocks)}) + "\n")
    sessions = len({r.session for r in trace.requests})
    mean = sum(r.input_tokens for r in trace.requests) / len(trace.requests)
    print(f"wrote {args.out}: {len(trace.requests):,} requests in {sessions} sessions "
          f"({len(trace.requests) / sessions:.1f} per session), mean prompt {mean:,.0f} tokens, "
          f"{stats.block_tokens}-token blocks", file=sys.stderr if is_stream(args.out) else sys.stdout)
    return 0


# ========================================================================================== register
def add_commands(sub) -> None:
    """Add replay, sweep, tune and synth to the ``saria`` command's subparsers."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    policies = ", ".join(POLICY_PRESETS)
    p = sub.add_parser(
        "replay", help="replay a trace through the control plane under several policies, side by side",
        description="Replay a request trace through saria's control plane (a real ControlPlane per policy) on a "
                    "logical clock, modelling transfers from the bandwidths and prefill at --prefill-tps, and "
                    "print SSD writes and reads, CHAR (cache hit achievement rate, mean and P25 bad), hit "
                    "ratio, transfer time and TTFT per policy. Policies: " + policies + "; override fields as "
                    "NAME:key=value,... (e.g. saria:theta_E=3,theta_R=none, full-duplicate:r=0.5), and "
                    "write_budget=auto runs the endurance governor for that policy. admission=RULE+RULE picks "
                    "the admission rules (eq1, deferred, session, prefix, cost; e.g. "
                    "saria:admission=eq1+session,session_p=0.4); eq1&learned (both admit: fewer writes) or "
                    "eq1|learned (either: more retention) joins a model trained on the oracle's labels to Eq. 1 "
                    "(saria:admission=eq1&learned+deferred,learned_tau=0.3; learned_model=PATH, "
                    "learned_retrain_s=S); oracle is the offline ceiling, which knows every chunk's next use. Every policy is reported with its useful write fraction and its "
                    "retention against dram-only and full-duplicate replayed alongside.")
    _add_common(p)
    p.add_argument("--policy", action="append", metavar="NAME",
                   help=f"a policy to replay (repeat for several; default: {', '.join(DEFAULT_POLICIES)})")
    add_fleet_options(p)
    p.add_argument("--write-budget", choices=("off", "auto"), default="off",
                   help="auto: the endurance governor moves theta_E (and theta_R with it) online to hold writes "
                        "at --dwpd on --ssd-capacity, for every policy with eviction-based admission")
    _add_hints(p, "also replay each policy as NAME+hints, its requests carrying")
    p.add_argument("--json", metavar="PATH", help="write {trace, config, results} as JSON")
    p.add_argument("--csv", metavar="PATH", help="write one CSV row per policy")
    p.add_argument("--plot", metavar="PATH", help="draw the comparison (PNG; needs matplotlib: saria[plot])")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser(
        "sweep", help="sweep theta_E / theta_R / r / session-start window: the write / CHAR / TTFT trade-off",
        description="Replay one policy over the product of the given threshold, promotion-ratio and window "
                    "lists (plus reference policies), print and write the results, and plot normalized SSD writes "
                    "against CHAR P25 bad and TTFT (paper Figures 10, 11, 13).")
    _add_common(p)
    p.add_argument("--policy", default="saria", metavar="NAME", help="the policy swept (default saria)")
    p.add_argument("--theta-e", type=listed(_THRESHOLD), metavar="LIST",
                   help="theta_E values, e.g. 1,2,3,4,6 (none: off)")
    p.add_argument("--theta-r", type=listed(_THRESHOLD), metavar="LIST", help="theta_R values, e.g. 4,8,16,none")
    p.add_argument("--r", type=listed(fraction), metavar="LIST", help="promotion ratios, e.g. 0,0.5,1 (none: r*)")
    p.add_argument("--windows", type=listed(_HOURS, allow_none=False), metavar="HOURS",
                   help="session-start windows in hours, e.g. 0.1667,0.3333,0.5,0.6667 (needs re-windowed arrivals)")
    p.add_argument("--reference", action="append", metavar="NAME",
                   help="reference policies replayed alongside (default full-duplicate; none for no reference)")
    p.add_argument("--csv", metavar="PATH", help="write one CSV row per replay")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw the trade-off plot (PNG; needs matplotlib: saria[plot])")
    _add_hints(p, "replay every point (not the references) with")
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser(
        "tune", help="the theta_E / theta_R that meet an SSD write budget with the best CHAR",
        description="Search admission thresholds for the best CHAR whose SSD writes stay within --dwpd drive "
                    "writes per day of --ssd-capacity over the replayed duration (binary search over theta_E "
                    "for each theta_R, each probe a replay; a policy with the learned rule, e.g. "
                    "saria:admission=eq1&learned+deferred, searches learned_tau instead of theta_E).")
    _add_common(p, budget_required=True)
    p.add_argument("--policy", default="saria", metavar="NAME", help="the policy tuned (default saria)")
    p.add_argument("--theta-e", type=listed(_THRESHOLD), metavar="LIST",
                   help="theta_E ladder, ascending (default 1,2,3,4,5,6,8,10,12,16,none)")
    p.add_argument("--theta-r", type=listed(_THRESHOLD), metavar="LIST",
                   help="theta_R candidates (default none,4,8,16,32)")
    p.add_argument("--objective", choices=("char_mean", "char_p25_bad"), default="char_mean",
                   help="what 'best' maximizes (default char_mean)")
    p.add_argument("--json", metavar="PATH", help="write the probes and the answer as JSON")
    p.add_argument("--csv", metavar="PATH", help="write one CSV row per probe")
    _add_hints(p, "replay every probe (not the references) with")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser(
        "synth", help="write a synthetic agent-session trace (paper §5.1 TraceLab statistics) as Mooncake JSONL",
        description="Generate agent sessions (defaults: the paper's 350 TraceLab sessions, 18.4 requests per "
                    "session, 83.7K prompt tokens per request, 112.1 s mean gap) and write them in the Mooncake "
                    "format with session ids. `saria replay synth:key=value,...` replays one without a file.",
        formatter_class=fmt)
    p.add_argument("out", metavar="OUT", help="the JSONL file to write")
    for f in fields(SessionStats):
        kind = int if f.type in ("int", int) else float
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default)
    p.set_defaults(func=_cmd_synth)

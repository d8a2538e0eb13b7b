"""The step-model options of ``saria replay``, ``sweep`` and ``tune`` (``--prefill-tps``, ``--device``,
``--device-efficiency``, ``--layerwise``) and ``saria replay --layerwise both``.

The model itself is :mod:`saria.replay.layerwise`; see docs/replay.md#layer-wise-reloads.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from saria.argtypes import float_range
from saria.replay.experiment import Experiment, Point
from saria.replay.layerwise import DEVICES, LAYERWISE_MODES, LAYERWISE_SUFFIX

__all__ = ["DEFAULT_PREFILL_TPS", "add_step_options", "describe_step", "layerwise_runs", "one_reload_model",
           "run_both", "step_settings"]

DEFAULT_PREFILL_TPS = 6500.0  # the paper's
_TOKENS_PER_S = float_range(1.0, 1e9)
_EFFICIENCY = float_range(1e-3, 1.0)


def add_step_options(g) -> None:
    """The options, in the "model of time" group ``g``."""
    g.add_argument("--prefill-tps", type=_TOKENS_PER_S, default=None, metavar="TOKENS/s",
                   help="prefill speed: the logical clock advances this many computed tokens per second "
                        "(default 6500, the paper's; not with --device)")
    g.add_argument("--device", choices=tuple(DEVICES), default=None,
                   help="compute prefill from the model's FLOPs (2 x its non-embedding parameters per new token, "
                        "plus causal attention over the reused and new tokens) at this device's peak dense BF16 "
                        "FLOP/s x an efficiency (0.55 for the GPUs, an assumption; saria/replay/layerwise.py "
                        "names each peak's source) instead of at --prefill-tps; compute then grows with the "
                        "reused prefix too")
    g.add_argument("--device-efficiency", type=_EFFICIENCY, default=None, metavar="F",
                   help="the share of --device's peak FLOP/s a prefill forward achieves (default: the profile's)")
    g.add_argument("--layerwise", choices=LAYERWISE_MODES, default="off",
                   help="off (default): a reused prefix loads whole before the forward (TTFT counts load + "
                        "compute); on: the forward overlaps the reload layer by layer (issue 34: full-attention "
                        "layer k waits only for layer k's bytes), so a step takes its first layer's load, then per "
                        "layer the larger of load and compute; GDN states, SSD reads and cluster gets still load "
                        "whole first. both (saria replay only): every policy is replayed both ways, the "
                        "layer-wise one labelled NAME" + LAYERWISE_SUFFIX + ", so the table shows TTFT with and "
                        "without the overlap. The vLLM connector does this for dense models only: a hybrid "
                        "model's layer-wise rows are a what-if. docs/replay.md#layer-wise-reloads")


def step_settings(args: argparse.Namespace) -> dict:
    """The :class:`~saria.replay.replay.ReplaySettings` fields the options give (``both``: sequential;
    :func:`run_both` replays the layer-wise copy)."""
    if args.device is not None and args.prefill_tps is not None:
        raise ValueError("--prefill-tps and --device: give one (with --device, prefill is computed from the "
                         "model's FLOPs on the device)")
    return {"prefill_tps": args.prefill_tps or DEFAULT_PREFILL_TPS, "layerwise": args.layerwise == "on",
            "device": args.device, "device_efficiency": args.device_efficiency, "model": args.model}


def describe_step(exp: Experiment) -> str:
    """The description's prefill and reload model."""
    device = exp.settings.step_model().device
    text = (f"prefill {exp.settings.prefill_tps:,.0f} tokens/s" if device is None else
            f"prefill from FLOPs on {device.name} ({device.tflops:,.4g} TFLOP/s x {device.efficiency:g})")
    return text + (", layer-wise reloads" if exp.settings.layerwise else "")


def layerwise_runs(args: argparse.Namespace) -> list[bool]:
    """The reload models ``--layerwise`` asks for (True: layer-wise), in report order."""
    return {"off": [False], "on": [True], "both": [False, True]}[args.layerwise]


def one_reload_model(args: argparse.Namespace, command: str) -> None:
    """Refuse ``--layerwise both`` where a command replays one reload model."""
    if args.layerwise == "both":
        raise ValueError(f"--layerwise both: saria {command} replays one reload model; give on or off (saria "
                         f"replay --layerwise both shows the two side by side)")


def run_both(exp: Experiment, points: list[Point]):
    """Every point replayed with sequential and with layer-wise reloads (labelled NAME+lw), each
    with its retention against references replayed the same way; results and runs, each point's
    two side by side."""
    settings = exp.settings
    passes = []
    try:
        for layerwise in (False, True):
            exp.settings = replace(settings, layerwise=layerwise)
            passes.append(exp.run(points))
    finally:
        exp.settings = settings
    (results, runs), (lw_results, lw_runs) = passes
    for result, run in zip(lw_results, lw_runs):
        result["policy"] = run.name = run.name + LAYERWISE_SUFFIX
    return ([r for pair in zip(results, lw_results) for r in pair],
            [r for pair in zip(runs, lw_runs) for r in pair])

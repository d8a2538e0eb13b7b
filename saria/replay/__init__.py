"""Trace-driven evaluation of saria's policies: ``saria replay``, ``saria sweep``, ``saria tune``.

A trace (Mooncake JSON Lines, TraceLab rounds, or the synthetic agent-session generator) is
replayed on a logical clock through a real :class:`saria.control.ControlPlane` per policy; the data
plane is modelled from bandwidths (``timing``), not run. Never imports torch.

Modules, one job each:

* ``traces``: loaders, unit checks, chunk hashes of a request;
* ``synth``: the synthetic agent-session trace (paper §5.1 statistics);
* ``arrivals``: recorded or re-windowed session starts, session inference;
* ``timing``: transfer time of a plan (serial, overlap, coordinated Eq. 4, ideal);
* ``layerwise``: a prefill step's compute (``--prefill-tps`` or FLOPs on a device profile) and its
  reload overlapped with the forward layer by layer (issue 34); ``layerwise_cli``: its options;
* ``replay``: the discrete-event replay of one policy;
* ``fleet``, ``cluster_tier``, ``fleet_report``: N replicas behind a router with a shared cluster
  tier (a Mooncake Store pool), their records and table;
* ``metrics``: CHAR, P25 bad, percentiles, the result record;
* ``policies``: policy specs (``NAME:key=value,...``) and their configs;
* ``runner``: parallel replays with one progress bar;
* ``experiment``: one trace and shared settings, many replays;
* ``report``: table, JSON, CSV, plots;
* ``sweep`` and ``tune``: threshold sweeps and budget-constrained search;
* ``cli``: the commands.
"""

from saria.replay.arrivals import Schedule, SessionPlan, infer_sessions, make_schedule
from saria.replay.experiment import Experiment, Point, open_trace
from saria.replay.metrics import RESULT_KEYS, char, p25_bad, percentile, summarize
from saria.replay.policies import BaseSettings, PolicySpec, build_config, parse_policy
from saria.replay.replay import PolicyRun, ReplaySettings, replay
from saria.replay.synth import SessionStats, synthesize
from saria.replay.timing import LOADING_MODES, transfer_seconds
from saria.replay.traces import Request, Trace, TraceError, chunk_keys, load_trace

__all__ = ["BaseSettings", "Experiment", "LOADING_MODES", "PolicyRun", "PolicySpec", "Point", "RESULT_KEYS",
           "ReplaySettings", "Request", "Schedule", "SessionPlan", "SessionStats", "Trace", "TraceError",
           "build_config", "char", "chunk_keys", "infer_sessions", "load_trace", "make_schedule", "open_trace",
           "p25_bad", "parse_policy", "percentile", "replay", "summarize", "synthesize", "transfer_seconds"]

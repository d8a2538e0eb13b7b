"""Run several replays (policies, sweep points) of one trace, in parallel processes, with a progress bar.

Each replay is independent and single-threaded (the control plane is pure Python), so ``workers``
processes run that many at once; on Linux they are forked and inherit the parsed trace. One
progress bar counts completed requests over all replays (shown on a terminal only). Results come
back in job order and do not depend on ``workers``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Hashable, Sequence

from saria.config import SariaConfig
from saria.replay.arrivals import Schedule
from saria.replay.hints import derive_hints
from saria.replay.replay import PolicyRun, ReplaySettings, replay
from saria.replay.traces import Trace

__all__ = ["Job", "default_workers", "run_jobs"]


@dataclass(frozen=True)
class Job:
    """One replay: a name, its config, and which of the run's schedules it uses."""

    name: str
    config: SariaConfig
    schedule: int = 0
    hint_accuracy: float | None = None  # replay with an application's hints (saria.replay.hints) of this accuracy
    hint_seed: int = 0
    hint_kind: str = "trace"  # which hints (saria.replay.hints.HINT_SOURCES)


def job_hints(job: Job, schedule: Schedule, chunks: Sequence[tuple[Hashable, ...]]):
    """The hints a job replays with (:func:`saria.replay.hints.derive_hints`), or None."""
    if job.hint_accuracy is None:
        return None
    return derive_hints(schedule, chunks, accuracy=job.hint_accuracy, seed=job.hint_seed,
                        kind=job.hint_kind)


# Set in each worker (inherited by fork, or passed to the initializer under spawn).
_STATE: tuple | None = None


def _init(state: tuple) -> None:
    global _STATE
    _STATE = state


def _work(index: int) -> PolicyRun:
    trace, chunks, schedules, jobs, settings, counter = _STATE

    def progress(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    job = jobs[index]
    schedule = schedules[job.schedule]
    return replay(job.name, trace, chunks, schedule, job.config, settings, progress,
                  hints=job_hints(job, schedule, chunks))


def default_workers(jobs: int) -> int:
    """As many processes as jobs, at most the CPUs this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(jobs, cpus))


def run_jobs(trace: Trace, chunks: Sequence[tuple[Hashable, ...]], schedules: Sequence[Schedule],
             jobs: Sequence[Job], settings: ReplaySettings, *, workers: int | None = None, progress: bool = True,
             desc: str = "replay") -> list[PolicyRun]:
    """Replay every job; returns their runs in job order."""
    if not jobs:
        return []
    workers = default_workers(len(jobs)) if workers is None else max(1, min(workers, len(jobs)))
    total = sum(schedules[job.schedule].num_requests for job in jobs)
    bar = _bar(total, desc, progress)
    try:
        if workers == 1:
            update = bar.update if bar is not None else None
            return [replay(job.name, trace, chunks, schedules[job.schedule], job.config, settings, update,
                           hints=job_hints(job, schedules[job.schedule], chunks))
                    for job in jobs]
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        counter = ctx.Value("q", 0)
        state = (trace, chunks, tuple(schedules), tuple(jobs), settings, counter)
        with ctx.Pool(workers, initializer=_init, initargs=(state,)) as pool:
            pending = pool.map_async(_work, range(len(jobs)), chunksize=1)
            while not pending.ready():
                pending.wait(0.2)
                if bar is not None:
                    bar.update(counter.value - bar.n)
            runs = pending.get()
        if bar is not None:
            bar.update(counter.value - bar.n)
        return runs
    finally:
        if bar is not None:
            bar.close()


def _bar(total: int, desc: str, progress: bool):
    if not progress:
        return None
    from tqdm import tqdm

    if not sys.stderr.isatty():  # a bar only on a terminal: logs and pipes get the results alone
        return None
    # shutil falls back to 80 columns where the terminal reports none (some pseudo-terminals).
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5, ascii=_ascii_only(),
                ncols=shutil.get_terminal_size().columns)


def _ascii_only() -> bool:
    """Whether stderr cannot print tqdm's block characters (tqdm would silently give up)."""
    try:
        "\u2588".encode(sys.stderr.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return True
    return False

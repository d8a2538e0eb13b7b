"""Weights change, KV follows: vLLM's connector reset and sleep mode.

KV is a function of the model's weights. RL trainers (verl, OpenRLHF, ...) sleep vLLM or pause it,
load new weights, and wake it: KV computed before that must never be served again, in any tier,
after a restart neither. vLLM tells the connector in two ways:

* ``reset_cache()`` (scheduler process; vLLM 0.32-0.34): from ``sleep(level >= 1)`` and
  ``pause_generation(clear_cache=True)`` (vLLM resets its caches with ``reset_connector=True``
  before the weights change), from ``release_kv_cache_memory()`` and from
  ``reset_prefix_cache(reset_connector=True)``, which a caller who loads weights another way (e.g.
  ``collective_rpc``) calls afterwards. saria then:

  1. draws a new **weights generation**: a random nonce (:class:`WeightsGeneration`) that every
     chunk name depends on from now on (:class:`~.sealing.ChunkNames`: the seal scope's ``weights``
     field with a key file, a keyed BLAKE2b of vLLM's block hash without one). No object named
     before, in DRAM, on SSD, in the cluster tier, or on SSD after a restart (a restart names chunks
     as at start, by the weights it loads), can be found again: they are other names;
  2. replaces the control plane with an empty one under a new epoch (:meth:`.guard.SchedulerGuard.reset`;
     not a fault): requests in flight run on as misses, late reports are ignored;
  3. counts the reset in every metadata (``SariaConnectorMetadata.resets``). A worker that sees
     the count change (:func:`worker_reset`) waits for its loads and orders in flight, fails those
     loads, frees every host pool slot and deletes every SSD object of its rank, durably: the
     capacity is free again at once. Before any object of the new weights is written it leaves a
     marker (:data:`MARKER`) in the rank's store directories: the next start of the server (which
     loads the model's files, not the weights this run was given) deletes whatever that store
     holds, then the marker (:func:`forget_previous_weights`). The cluster tier's objects stay
     (other replicas may still run the old weights); the new names never meet them.

  It always answers True (the reset took: nothing computed before it will be served), also when
  the rebuild fails (saria turns off then) and when saria is off.

* vLLM 0.33+'s sleep hooks (worker processes): ``unregister_kv_caches()`` before the KV cache's
  memory is released (sleep, ``discard("kv_cache")``) and ``restore_kv_caches()`` after it is
  back. saria ends every copy that touches vLLM's pages first (:func:`suspend`: loads and orders
  in flight waited for; while suspended no load starts, it fails and vLLM recomputes), and on
  restore builds its page tables anew over the tensors where they moved (:func:`resume`: the data
  plane is reopened over them; DRAM copies go, which the reset vLLM makes before any sleep has
  dropped already). ``supports_sleep_mode`` says True. vLLM 0.32 has neither hook (its CPU and CUDA
  workers suspend KV memory without telling the connector): there the engine drains saria before
  the reset (the pause waits for work in flight, and vLLM empties its prefix cache only once no
  block is held for saria), and no copy into KV memory starts afterwards: no request is left.
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from saria.safe_files import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, file_problem, shown

if TYPE_CHECKING:
    from .guard import SchedulerGuard
    from .metadata import SariaConnectorMetadata
    from .worker import SariaWorker

log = logging.getLogger("saria.vllm")

NONCE_BYTES = 16
# in each of a rank's SSD store directories once a reset deleted its objects: what it writes from then
# on was computed with weights a restart does not load (it loads the model's files): the next start
# deletes every object of the store, then this file
MARKER = "saria-weights-updated"


class WeightsGeneration:
    """The scheduler half's weights generation: ``nonce`` is ``b""`` for the weights loaded at start
    (names as before, so a restart finds the SSD objects of a run that never reset), a fresh random
    value after each reset (never drawn twice: no restart can name a chunk as a reset run did)."""

    def __init__(self) -> None:
        self.nonce = b""

    def advance(self) -> None:
        self.nonce = os.urandom(NONCE_BYTES)


def reset_scheduler(guard: "SchedulerGuard", weights: WeightsGeneration) -> bool:
    """``reset_cache`` on the scheduler half: a new weights generation, then an empty control plane
    whose names depend on it (module docstring). Never raises; always True."""
    try:
        weights.advance()
        guard.reset()
    except Exception as exc:  # never reaches vLLM: without a rebuilt control plane saria must not serve
        log.error("saria: reset failed (%s); turning saria off", type(exc).__name__)  # never a message: it may name a chunk
        guard.off = True
    return True


# --- worker half ----------------------------------------------------------------------------------

def worker_reset(worker: "SariaWorker", meta: "SariaConnectorMetadata") -> None:
    """The metadata counts a reset this worker has not seen: wait for every load and order in flight,
    fail those loads, free every host pool slot, delete every SSD object of this rank (module
    docstring); take the metadata's epoch (the control plane was replaced with the reset)."""
    worker.resets, worker.epoch = meta.resets, meta.epoch
    # every SSD object goes, written or not: the rank reports an empty inventory (a control plane
    # that takes over the ranks' SSD objects, as at start, hears at once that there is nothing to wait for)
    worker._inventory = {}

    def drop_everything(unfinished: object) -> None:
        ssd = worker.data.ssd
        if ssd is not None:  # marked first: a crash from here on leaves a store the next start empties
            mark_updated(path.parent for path in ssd.paths)
        worker.saves.drop_everything()  # every host pool slot and every SSD object
        if ssd is not None:
            ssd.sync()
        log.info("saria worker: the connector was reset (weights may have changed): every cached object of "
                 "this rank dropped")

    worker._replace_control_plane(drop_everything, "reset", "it could not drop its objects on a reset")


def mark_updated(directories: Iterable[Path | str]) -> None:
    """Leave :data:`MARKER` in each of a rank's store directories, durably (the file and its
    directory entry synced): a restart then deletes what the store holds (:func:`forget_previous_weights`)."""
    for directory in directories:
        path = Path(directory) / MARKER
        if path.exists():
            continue
        # saria's own file in its own rank directory: never through a link, never a FIFO or another's file
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0o600)
        try:
            problem = file_problem(os.fstat(fd))
            if problem:
                raise OSError(errno.EPERM, f"{shown(path)} {problem}: refused, left as it is")
            os.write(fd, b"objects written after a reset of the connector: deleted at the next start\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def forget_previous_weights(ssd: Any, directories: Sequence[str]) -> int:
    """At start (:func:`~.worker_start.open_rank`): where a previous run of this rank reset the
    connector (:data:`MARKER` in one of its store ``directories``), its store holds objects computed
    with weights this run does not load (they have names no lookup makes, so they would only take
    room): delete them all, durably, then the markers. The number of objects deleted."""
    marked = [Path(d) / MARKER for d in directories if (Path(d) / MARKER).exists()]
    if not marked or ssd is None:
        return 0
    keys = ssd.keys()
    for key in keys:
        ssd.delete(key)
    ssd.sync()
    for path in marked:
        path.unlink(missing_ok=True)
    log.info("saria worker: a previous run reset the connector (its weights changed): %d SSD object(s) it left "
             "deleted", len(keys))
    return len(keys)


def suspend(worker: "SariaWorker") -> None:
    """``unregister_kv_caches``: vLLM's KV memory is about to be released. Wait for every load and
    order in flight (each reads or writes vLLM's pages, or may); from now on no load starts until
    :func:`resume`. Never raises (a fault turns the worker off, which closes the data plane after
    its copies ran)."""
    worker.suspended = True
    if worker.off or worker.data is None:
        return
    try:
        for _, job in list(worker._loads.values()):
            job.wait()  # reported finished by the next get_finished, as always
        wait(worker.saves.in_flight())
        engine = worker.engine
        engine.settle()  # the retire thread's work (staging given back, steps ended) ran too
        if engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize(engine.device)
        log.info("saria worker: KV cache memory suspended (sleep): no copy in flight")
    except Exception as exc:
        worker._give_up("unregister_kv_caches", exc)


def resume(worker: "SariaWorker") -> None:
    """``restore_kv_caches``: vLLM's KV memory is back. Where its tensors moved (a stale page table),
    reopen the data plane over them as they are now (new page tables; the host pool's copies go: the
    reset vLLM made before releasing the memory dropped them already). Never raises."""
    worker.suspended = False
    if worker.off or worker.data is None or worker.kv_caches is None:
        return
    try:
        if not worker.engine.pages_moved():
            return
        data, worker.data = worker.data, None
        worker.counters.keep(data)
        worker._close_cluster()
        data.close()
        worker.saves.turned_off()  # the host pool's objects and the states set aside are gone
        worker._open(worker.kv_caches, start=False)
        worker._inventory = None
        log.warning("saria worker: vLLM's KV cache moved while asleep: page tables rebuilt, DRAM copies dropped")
    except Exception as exc:
        worker._give_up("restore_kv_caches", exc)

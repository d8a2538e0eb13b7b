"""Test faults for engine runs, in this process: exceptions injected into saria's hooks
(:func:`patch_faults`), packs slowed down (:func:`slow_packs`), SSD objects corrupted on disk
(:func:`corrupt_ssd`)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

FAULT_TARGETS = ("plan", "commit_prefill", "complete", "update_state_after_alloc", "build_connector_meta", "ssd_load")


def patch_faults(turns_by_target: dict[str, list[int]]) -> tuple[Callable[[int], None], Callable[[], None]]:
    """Test faults, in this process: patch saria's classes so that each target raises
    ``RuntimeError`` once in each of its turns (0-based). Targets: the control plane's ``plan``,
    ``commit_prefill`` and ``complete``; the connector scheduler's ``update_state_after_alloc``
    (after vLLM was told to wait for a load) and ``build_connector_meta`` (in a step that schedules
    a request already running, its second step on: where vLLM 0.34, which removed a field saria
    read there, made it raise); ``ssd_load``: the transfer engine's reload of a plan that reads from
    SSD (whole, ``load``, or a layer-wise step that holds one, ``load_layers``). Returns
    ``(arm, restore)``: call ``arm(turn)`` before each turn, ``restore()`` at the end."""
    from saria.control import ControlPlane, Tier
    from saria.dataplane.transfer.engine import TransferEngine

    from saria.integrations.vllm.scheduler import SariaScheduler

    def reads_ssd(plan, *args, **kwargs) -> bool:
        return Tier.SSD in plan.kv_sources or plan.state_source is Tier.SSD

    def step_reads_ssd(loads, *args, **kwargs) -> bool:
        return any(reads_ssd(plan) for plan, _, _ in loads)

    def schedules_running(scheduler_output, *args, **kwargs) -> bool:
        return bool(getattr(getattr(scheduler_output, "scheduled_cached_reqs", None), "req_ids", None))

    where = {"plan": [(ControlPlane, "plan", None)], "commit_prefill": [(ControlPlane, "commit_prefill", None)],
             "complete": [(ControlPlane, "complete", None)],
             "ssd_load": [(TransferEngine, "load", reads_ssd), (TransferEngine, "load_layers", step_reads_ssd)],
             "update_state_after_alloc": [(SariaScheduler, "update_state_after_alloc", None)],
             "build_connector_meta": [(SariaScheduler, "build_connector_meta", schedules_running)]}
    unknown = sorted(set(turns_by_target) - set(where))
    if unknown:
        raise ValueError(f"unknown fault target(s) {unknown}; known: {', '.join(FAULT_TARGETS)}")
    armed: set[str] = set()

    def raising(target: str, original: Callable, applies: Callable[..., bool] | None) -> Callable:
        def method(self, *args, **kwargs):
            if target in armed and (applies is None or applies(*args, **kwargs)):
                armed.discard(target)
                raise RuntimeError(f"injected fault in {target}")
            return original(self, *args, **kwargs)
        return method

    originals = []
    for target in turns_by_target:
        for cls, name, applies in where[target]:
            originals.append((cls, name, getattr(cls, name)))
            setattr(cls, name, raising(target, getattr(cls, name), applies))

    def arm(turn: int) -> None:
        armed.clear()
        armed.update(target for target, turns in turns_by_target.items() if turn in turns)

    def restore() -> None:
        for cls, name, original in originals:
            setattr(cls, name, original)

    return arm, restore


def slow_packs(seconds: float, restore: Callable[[], None] | None) -> Callable[[], None]:
    """Make every pack the transfer engine runs on its own threads sleep ``seconds`` first (a test
    delay: stores still read their request's blocks when it finishes); returns the undo (after
    ``restore``, if given)."""
    import saria.dataplane.transfer.packing as packing_module

    original, caller = packing_module.pack_pages, threading.get_ident()

    def pack_pages(*args, **kwargs):
        if threading.get_ident() != caller:
            time.sleep(seconds)
        return original(*args, **kwargs)

    packing_module.pack_pages = pack_pages

    def undo() -> None:
        packing_module.pack_pages = original
        if restore is not None:
            restore()

    return undo


def corrupt_ssd(paths: list[str], rank: int | None = None) -> int:
    """Flip one byte in the payload of every committed SSD part in the rank stores (``rank<r>``
    directories; only rank ``rank``'s if given) under ``paths`` (test fault)."""
    from saria.dataplane.ssd.format import FILE_NAME, Geometry, SuperBlock, decode_header

    flipped = 0
    pattern = "rank*" if rank is None else f"rank{rank}"
    for file in sorted(f for directory in paths for f in Path(directory).glob(f"{pattern}/{FILE_NAME}")):
        fd = os.open(file, os.O_RDWR)
        try:
            sb = SuperBlock.decode(os.pread(fd, 4096, 0))
            geometry = Geometry(sb.part_bytes, sb.slots)
            for slot in range(sb.slots):
                if decode_header(os.pread(fd, 4096, geometry.header_offset(slot))) is None:
                    continue
                offset = geometry.payload_offset(slot) + 100
                byte = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
                flipped += 1
            os.fsync(fd)
        finally:
            os.close(fd)
    return flipped

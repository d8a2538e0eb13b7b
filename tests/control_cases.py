"""Small configurations and request drivers shared by the control-plane tests."""

from __future__ import annotations

from typing import Hashable, Iterable

from saria.config import POLICY_PRESETS, Capacity, ChunkSpec, Policy, SariaConfig
from saria.control import ControlPlane, DropOrder, ObjectKey, Order, ReloadPlan, WriteOrder

DENSE = ChunkSpec()  # Qwen3-8B sizes, 512-token chunks
HYBRID = ChunkSpec.for_model("qwen3-next-80b-a3b", checkpoint_tokens=4096)  # 1024-token chunks, state every 4

PRESETS = tuple(p for p in POLICY_PRESETS if p != "oracle")  # the oracle needs a replay's future


def config(preset: str = "saria", *, dram_chunks: int = 8, ssd_chunks: int = 32, chunk: ChunkSpec = DENSE,
           **policy: object) -> SariaConfig:
    """Capacities counted in chunks' worth of full-attention tokens."""
    return SariaConfig(dram=Capacity(tokens=dram_chunks * chunk.chunk_tokens),
                       ssd=Capacity(tokens=ssd_chunks * chunk.chunk_tokens),
                       chunk=chunk, policy=Policy.preset(preset, **policy))


def chain(name: str, n: int, start: int = 0) -> list[str]:
    """Prefix-chained hashes: chunk i of context ``name`` is ``"name:i"``."""
    return [f"{name}:{i}" for i in range(start, n)]


def drain(cp: ControlPlane, orders: Iterable[Order], now: float,
          fail: Iterable[Hashable | ObjectKey] = (), fail_writes: bool = False) -> list[Order]:
    """Complete every order (and the follow-ups completions return); objects named in ``fail``
    fail in whichever order carries them. Returns every order seen."""
    fail = list(fail)
    seen: list[Order] = []
    queue = list(orders)
    while queue:
        order = queue.pop(0)
        seen.append(order)
        if isinstance(order, DropOrder):
            continue
        carried = [f for f in fail if _carries(order, f)]
        ok = not (fail_writes and isinstance(order, WriteOrder))
        queue += cp.complete(order.order_id, ok, now, failed=carried if ok else ())
    return seen


def _carries(order: Order, name: Hashable | ObjectKey) -> bool:
    if isinstance(name, ObjectKey):
        return name.chunk in (order.kv if name.kind == "kv" else order.state)
    return name in order.kv or name in order.state


def request(cp: ControlPlane, hashes: list, now: float, *, complete: bool = True, fail=(),
            read_failures=()) -> tuple[ReloadPlan, list[Order]]:
    """plan + commit_prefill (+ completing everything): the plan and every order issued."""
    plan = cp.plan(hashes, now)
    orders = cp.commit_prefill(hashes, now, plan=plan, failed=read_failures)
    if complete:
        orders = drain(cp, orders, now, fail=fail)
    return plan, orders


def writes_of(orders: Iterable[Order], reason: str | None = None) -> list[WriteOrder]:
    return [o for o in orders if isinstance(o, WriteOrder) and (reason is None or o.reason == reason)]


def written_chunks(orders: Iterable[Order], reason: str | None = None) -> set:
    return {h for o in writes_of(orders, reason) for h in o.kv}


def snapshot(cp: ControlPlane, hashes: Iterable[Hashable]) -> tuple:
    """Everything observable about ``cp`` and these chunks."""
    return cp.counters(), cp.usage(), tuple(cp.chunk_info(h) for h in hashes)

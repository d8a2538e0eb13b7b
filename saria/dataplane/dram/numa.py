"""The host pool's memory on the GPU's NUMA node, where the machine says which.

A GPU sits on one socket's PCIe root; pinned memory on the other socket reaches it across the
socket link (lower bandwidth, and it contends with the other socket's traffic). The kernel says
which node a PCI device is on in ``/sys/bus/pci/devices/<address>/numa_node`` (``-1``: it does not
know, as on one-node machines and many VMs). :func:`pool_numa_node` reads it for the engine's
GPU (its PCI address from CUDA's device properties); :func:`bind_memory` sets the memory policy of
a host pool segment to that node with ``mbind(2)`` (a raw system call: libnuma not required)
after the segment is mapped and before anything touches it (``cudaHostRegister`` faults every page
in), so its pages are allocated there.

The policy is ``MPOL_PREFERRED``: pages go to the GPU's node, and to another only when that node is
full. ``MPOL_BIND`` would fail the registration (or kill the process) on a full node, where a pool
on the far node is only slower. A system call that is refused (a container's seccomp profile
without ``CAP_SYS_NICE``, a kernel without NUMA) leaves the pool unbound, in one warning line.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("saria.dataplane.dram")

MPOL_PREFERRED = 1
MPOL_F_ADDR = 2  # get_mempolicy: the policy of the page at an address
# (mbind, get_mempolicy) system call numbers per architecture
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of a PCI device's function 0: ``"0000:3b:00.0"``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def gpu_pci_address(index: int) -> str | None:
    """GPU ``index``'s PCI address, from CUDA's device properties (``None`` where it has none)."""
    props = torch.cuda.get_device_properties(index)
    try:
        return pci_address(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except AttributeError:  # a torch without the PCI fields
        return None


def numa_node_of(address: str, sysfs: str | os.PathLike = "/sys") -> int | None:
    """The NUMA node the kernel gives PCI device ``address`` (``<sysfs>/bus/pci/devices/<address>/numa_node``);
    ``None`` where it says ``-1`` (it does not know), the file is missing or holds no number."""
    try:
        node = int((Path(sysfs) / "bus" / "pci" / "devices" / address / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def pool_numa_node(device: torch.device | str, *, sysfs: str | os.PathLike = "/sys",
                   address_of: Callable[[int], str | None] = gpu_pci_address) -> int | None:
    """The node a host pool serving ``device`` is bound to, or ``None`` (not bound; one debug line
    says why): a CUDA device's node as the machine gives it for its PCI address (``address_of``:
    the device index's address, tests give their own, with a temp dir as ``sysfs``); the CPU's
    pool is not bound (the engine's threads run wherever the OS puts them)."""
    device = torch.device(device)
    if device.type != "cuda":
        log.debug("host pool: not NUMA-bound (the engine's device is the %s)", device.type.upper())
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    address = address_of(index)
    node = numa_node_of(address, sysfs) if address is not None else None
    if node is None:
        log.debug("host pool: not NUMA-bound (the machine does not say which node GPU %d, PCI %s, is on)",
                  index, address)
    return node


def _syscall(which: int) -> Callable[..., int] | None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    number = numbers[which]

    def call(*args) -> int:
        if libc.syscall(ctypes.c_long(number), *args) == 0:
            return 0
        return ctypes.get_errno() or errno.EINVAL

    return call


def _mask(node: int) -> tuple[ctypes.Array, int]:
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    return mask, words * 64 + 1  # the kernel reads maxnode - 1 bits


def bind_memory(address: int, nbytes: int, node: int) -> int:
    """Prefer node ``node`` for the pages of ``[address, address + nbytes)`` (page aligned, not yet
    touched): ``mbind(MPOL_PREFERRED)``. Returns 0, or the errno of a refusal (``ENOSYS`` on an
    architecture this does not know)."""
    if node < 0:
        raise ValueError(f"a NUMA node is >= 0, got {node}")
    mbind = _syscall(0)
    if mbind is None:
        return errno.ENOSYS
    mask, maxnode = _mask(node)
    return mbind(ctypes.c_void_p(address), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_PREFERRED), mask,
                 ctypes.c_ulong(maxnode), ctypes.c_uint(0))


def memory_policy(address: int) -> tuple[int, int | None] | None:
    """``(mode, node)`` of the page at ``address`` (``get_mempolicy(MPOL_F_ADDR)``; node ``None``
    when the mask names none), or ``None`` where it cannot be read. For tests and ``saria doctor``."""
    get_mempolicy = _syscall(1)
    if get_mempolicy is None:
        return None
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * 16)()
    if get_mempolicy(ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64), ctypes.c_void_p(address),
                     ctypes.c_ulong(MPOL_F_ADDR)) != 0:
        return None
    nodes = [w * 64 + b for w in range(16) for b in range(64) if mask[w] >> b & 1]
    return mode.value, (nodes[0] if nodes else None)

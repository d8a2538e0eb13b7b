"""The host pool on the GPU's NUMA node (saria.dataplane.dram.numa, issue 42 item 4): the node read
from a temp dir standing in for sysfs, the decision per device, and mbind on this machine's real
memory (node 0 exists on every Linux machine)."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from saria.dataplane.dram import numa
from saria.dataplane.dram.host_pool import HostPool

GPU = "0000:3b:00.0"


def sysfs_with(tmp_path, address: str, text: str | None):
    root = tmp_path / "sys"
    device = root / "bus" / "pci" / "devices" / address
    device.mkdir(parents=True)
    if text is not None:
        (device / "numa_node").write_text(text)
    return root


def test_pci_address_is_the_sysfs_name():
    assert numa.pci_address(0, 0x3B, 0) == GPU
    assert numa.pci_address(0x10, 0xDC, 0x1F) == "0010:dc:1f.0"


@pytest.mark.parametrize("text,node", [
    pytest.param("1\n", 1, id="node-1"),
    pytest.param("0", 0, id="node-0"),
    pytest.param("-1\n", None, id="unknown"),
    pytest.param("", None, id="empty"),
    pytest.param("one", None, id="garbage"),
    pytest.param(None, None, id="no-file"),
])
def test_numa_node_of_reads_the_machines_answer(tmp_path, text, node):
    root = sysfs_with(tmp_path, GPU, text)
    assert numa.numa_node_of(GPU, root) == node
    assert numa.numa_node_of("0000:99:00.0", root) is None  # a device sysfs does not list


def test_a_cuda_pool_goes_to_its_gpus_node_and_a_cpu_pool_is_not_bound(tmp_path, caplog):
    root = sysfs_with(tmp_path, GPU, "1\n")
    asked = []

    def address_of(index):
        asked.append(index)
        return GPU

    assert numa.pool_numa_node("cuda:3", sysfs=root, address_of=address_of) == 1 and asked == [3]
    (root / "bus" / "pci" / "devices" / GPU / "numa_node").write_text("-1\n")
    with caplog.at_level(logging.DEBUG, logger="saria.dataplane.dram"):
        assert numa.pool_numa_node("cuda:3", sysfs=root, address_of=address_of) is None
        assert numa.pool_numa_node("cuda:0", sysfs=root, address_of=lambda index: None) is None
        assert numa.pool_numa_node("cpu", sysfs=root, address_of=address_of) is None
    assert asked == [3, 3]  # the CPU's pool asks nothing
    lines = [r.getMessage() for r in caplog.records if r.name == "saria.dataplane.dram"]
    assert lines == ["host pool: not NUMA-bound (the machine does not say which node GPU 3, PCI 0000:3b:00.0, is on)",
                     "host pool: not NUMA-bound (the machine does not say which node GPU 0, PCI None, is on)",
                     "host pool: not NUMA-bound (the engine's device is the CPU)"]


def test_a_bound_pool_prefers_its_node_for_every_segment():
    with HostPool(4 * 4096, 4096, segment_bytes=2 * 4096, numa_node=0) as pool:
        if pool.numa_node is None:
            pytest.skip("this machine refuses mbind (a container without CAP_SYS_NICE?)")
        for address in pool.segment_addresses():
            assert numa.memory_policy(address) == (numa.MPOL_PREFERRED, 0)
        pool.slot(0).fill_(7)  # first touch after the policy: the memory works as before
        assert int(pool.slot(0)[-1]) == 7
    with HostPool(2 * 4096, 4096) as unbound:
        assert unbound.numa_node is None
        policy = numa.memory_policy(unbound.segment_addresses()[0])
        assert policy is None or policy[0] != numa.MPOL_PREFERRED  # the default policy


def test_a_refused_mbind_leaves_the_pool_unbound_in_one_line(monkeypatch, caplog):
    calls = []

    def refuse(address, nbytes, node):
        calls.append((nbytes, node))
        return errno.EPERM

    monkeypatch.setattr("saria.dataplane.dram.host_pool.bind_memory", refuse)
    with caplog.at_level(logging.WARNING, logger="saria.dataplane.dram"):
        with HostPool(4 * 4096, 4096, segment_bytes=2 * 4096, numa_node=1) as pool:
            assert pool.numa_node is None and pool.num_slots == 4
            pool.slot(3).fill_(1)
    assert calls == [(2 * 4096, 1)]  # asked once; the second segment is not bound either
    assert [r.getMessage() for r in caplog.records] == [
        "host pool: not NUMA-bound to node 1 (mbind refused: Operation not permitted); its memory goes where "
        "the OS puts it"]


@pytest.mark.parametrize("node", [-1, True, 1.0, "0"])
def test_a_bad_node_is_refused(node):
    with pytest.raises(ValueError, match="numa_node"):
        HostPool(4096, 4096, numa_node=node)


def test_bind_memory_refuses_a_negative_node():
    with pytest.raises(ValueError, match="NUMA node"):
        numa.bind_memory(0, 4096, -1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it)")
def test_on_cuda_the_gpus_node_is_read_from_its_pci_address(caplog):
    import re
    index = torch.cuda.current_device()
    address = numa.gpu_pci_address(index)
    assert address is not None and re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.0", address), address
    node = numa.pool_numa_node(torch.device("cuda", index))
    print(f"GPU {index} at PCI {address}: NUMA node {node}")
    if node is not None:
        with HostPool(2 * 4096, 4096, numa_node=node) as pool:
            assert pool.numa_node is None or numa.memory_policy(pool.segment_addresses()[0]) == (numa.MPOL_PREFERRED, node)

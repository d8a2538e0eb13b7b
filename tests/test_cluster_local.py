"""LocalCluster's process control, without Mooncake: ``pause_node`` returns only once the node can
run nothing more. ``kill(SIGSTOP)`` returns before every thread of a busy process has stopped; the
cluster store's timeout test once read an object from a "paused" node through a thread not yet
stopped. A stand-in node (a Python process whose threads append to a file without pause) shows it:
after ``pause_node`` the file must not grow."""

import os
import sys
import time

from saria.dataplane.cluster.local import LocalCluster, _stopped

BUSY = """
import os, sys, threading, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
def write():
    while True:
        os.write(fd, b"x")
        time.sleep(0.0002)
for _ in range(6):
    threading.Thread(target=write, daemon=True).start()
time.sleep(600)
"""


def test_a_paused_node_runs_nothing_until_resumed(tmp_path):
    out = tmp_path / "writes"
    cluster = LocalCluster(tmp_path / "logs")
    cluster.node_proc = cluster._spawn([sys.executable, "-c", BUSY, str(out)], "node")
    try:
        deadline = time.monotonic() + 20
        while not out.exists() or out.stat().st_size < 100:
            assert time.monotonic() < deadline and cluster.node_proc.poll() is None
            time.sleep(0.01)
        for _ in range(30):
            cluster.pause_node()
            assert _stopped(cluster.node_proc.pid)
            size = out.stat().st_size
            time.sleep(0.02)
            assert out.stat().st_size == size  # not one write after pause_node returned
            cluster.resume_node()
            grown = time.monotonic() + 10
            while out.stat().st_size == size:
                assert time.monotonic() < grown, "the node did not run again after resume_node"
                time.sleep(0.001)
    finally:
        cluster.stop()
    assert cluster.node_proc is None


def test_stopped_knows_running_stopped_and_gone(tmp_path):
    cluster = LocalCluster(tmp_path / "logs")
    cluster.node_proc = proc = cluster._spawn([sys.executable, "-c", "import time; time.sleep(600)"], "node")
    try:
        assert not _stopped(proc.pid)
        cluster.pause_node()
        assert _stopped(proc.pid)
        cluster.resume_node()
        deadline = time.monotonic() + 10
        while _stopped(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        cluster.stop()
    assert proc.returncode is not None and _stopped(proc.pid)  # reaped: no /proc entry
    assert _stopped(os.getpid()) is False

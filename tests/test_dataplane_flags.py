"""LayerFlags: the per-layer flags of a step (one condition instead of an Event per layer)."""

import threading
import time

from saria.dataplane.transfer.flags import LayerFlags


def test_set_wait_and_timeouts():
    flags = LayerFlags(4)
    assert len(flags) == 4 and flags.first_clear() == 0
    assert not flags.wait(2, timeout=0.01) and not flags.wait_all(timeout=0.01)
    flags.set(2)
    flags.set(2)  # again: nothing changes
    assert flags.is_set(2) and flags.wait(2, timeout=0) and not flags.is_set(1)
    assert flags.first_clear() == 0 and not flags.wait_all(timeout=0.01)
    for i in (0, 1, 3):
        flags.set(i)
    assert flags.wait_all(timeout=0) and flags.first_clear() is None


def test_waiters_wake_on_their_flag_and_on_set_all():
    flags = LayerFlags(3)
    woke: list[int] = []

    def waiter(i):
        assert flags.wait(i, timeout=5)
        woke.append(i)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    flags.set(1)
    threads[1].join(5)
    assert woke == [1]
    flags.set_all()
    for t in threads:
        t.join(5)
    assert sorted(woke) == [0, 1, 2] and flags.wait_all(timeout=0)

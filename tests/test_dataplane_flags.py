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


def test_lazy_event_behaves_as_an_event_for_waiters_before_and_after_the_set():
    import threading

    from saria.dataplane.transfer.flags import LazyEvent

    event = LazyEvent()
    assert not event.is_set() and event.wait(0.01) is False and event.wait(0) is False
    woke = []
    waiters = [threading.Thread(target=lambda: woke.append(event.wait(10))) for _ in range(4)]
    for w in waiters:
        w.start()
    event.set()
    for w in waiters:
        w.join()
    assert woke == [True] * 4 and event.is_set() and event.wait() is True and event.wait(0) is True
    event.set()  # again: stays set
    assert event.is_set()
    never = LazyEvent()
    never.set()  # set before anyone waited: no event is ever made
    assert never._event is None and never.wait() is True

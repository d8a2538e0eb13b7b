"""LayerFlags: the per-layer flags of a step (one condition instead of an Event per layer)."""

import threading
import time

import pytest

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


def test_a_running_future_builds_its_condition_only_when_used_and_is_a_future_otherwise():
    """RunningFuture (a layer-wise step's runs): done() and a finished result() need no condition;
    a waiter before the result, callbacks, exceptions and concurrent.futures.wait behave as with
    a Future."""
    import threading
    from concurrent.futures import Future, wait

    from saria.dataplane.transfer.results import RunningFuture

    f = RunningFuture()
    assert isinstance(f, Future) and f.running() and not f.done()
    f.set_result(3)
    h = RunningFuture()
    h._result, h._state = 5, "FINISHED"  # as set_result leaves it, without its condition
    assert h.done() and h.result() == 5 and "_condition" not in h.__dict__
    waiter = RunningFuture()
    got = []
    reader = threading.Thread(target=lambda: got.append(waiter.result(timeout=10)))
    reader.start()
    threading.Timer(0.05, lambda: waiter.set_result(7)).start()
    reader.join()
    assert got == [7] and f.result() == 3
    failing, called = RunningFuture(), []
    failing.add_done_callback(called.append)
    failing.set_exception(ValueError("bad"))
    assert called == [failing] and failing.done()
    with pytest.raises(ValueError, match="bad"):
        failing.result()
    late = RunningFuture()
    threading.Timer(0.05, lambda: late.set_result(1)).start()
    done, pending = wait([late], timeout=10)
    assert late in done and not pending

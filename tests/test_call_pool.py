"""``shifu.envs.pool.CallPool``, the threads environment calls run on: calls at once up to the pool's size, a
stuck call given up and its worker replaced, and no thread left behind once the pool is no longer used."""

from __future__ import annotations

import threading
import time

import pytest

from shifu.envs import pool as pool_module
from shifu.envs.pool import TIMED_OUT, CallPool

pytestmark = pytest.mark.unit


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name} #")]


def until(cond, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_calls_run_at_once_up_to_the_size_and_come_back_in_order():
    """Eight calls that each wait for all eight (a barrier) finish only if they run at the same time; the
    outcomes come back in the order given, errors as values."""
    pool, barrier = CallPool(8, "pool-at-once"), threading.Barrier(8, timeout=20)

    def call(i):
        barrier.wait()
        if i == 5:
            raise ValueError("five")
        return i * i

    out = pool.run([lambda i=i: call(i) for i in range(8)], None)
    assert [v for v, _ in out] == [0, 1, 4, 9, 16, None, 36, 49]
    assert isinstance(out[5][1], ValueError) and all(e is None for i, (_, e) in enumerate(out) if i != 5)
    assert pool.workers == 8


def test_a_pool_starts_only_the_workers_its_calls_need():
    pool = CallPool(64, "pool-lazy")
    assert pool.workers == 0 and not threads_named("pool-lazy")
    pool.run([lambda: 1, lambda: 2], None)
    assert pool.workers == 2 and len(threads_named("pool-lazy")) == 2


def test_callers_in_several_threads_get_workers_for_all_their_calls():
    """One caller's single call waits for another caller's single call (made while the first runs): they finish
    only if the pool gives the second its own worker rather than queueing it behind the busy one."""
    pool, barrier = CallPool(4, "pool-callers"), threading.Barrier(2, timeout=20)
    first: list = []
    caller = threading.Thread(target=lambda: first.extend(pool.run([barrier.wait], None)))
    caller.start()
    assert until(lambda: pool.workers == 1)
    (second,) = pool.run([barrier.wait], None)
    caller.join()
    assert first[0][1] is None and second[1] is None  # (a broken barrier: a BrokenBarrierError)
    assert pool.workers == 2


def test_idle_workers_end_and_the_next_run_starts_them_again(monkeypatch):
    monkeypatch.setattr(pool_module, "IDLE_S", 0.2)
    pool = CallPool(4, "pool-idle")
    assert [v for v, _ in pool.run([lambda i=i: i for i in range(6)], None)] == list(range(6))
    assert until(lambda: pool.workers == 0 and not threads_named("pool-idle"))
    assert [v for v, _ in pool.run([lambda: "again"], None)] == ["again"]
    assert until(lambda: not threads_named("pool-idle"))


def test_a_stuck_call_is_given_up_its_worker_replaced_and_its_thread_ends_with_it(monkeypatch):
    monkeypatch.setattr(pool_module, "IDLE_S", 5.0)  # longer than the call's limit: the fast worker waits on
    pool, release = CallPool(2, "pool-stuck"), threading.Event()
    out = pool.run([lambda: release.wait(30) and "late", lambda: "fast"], timeout_s=0.3)
    assert out[0] == (TIMED_OUT, None) and out[1] == ("fast", None)
    assert pool.workers == 2  # the replacement counts, the stuck worker does not
    assert [v for v, _ in pool.run([lambda: 1, lambda: 2], None)] == [1, 2]  # the pool still has its size
    release.set()  # the stuck call returns: its thread ends instead of serving again
    assert until(lambda: pool.workers == 0 and not threads_named("pool-stuck"))

"""A bounded pool of worker threads for slow user calls (environment resets and steps): many calls run at once,
each with its own time limit, and the caller reads the outcomes in the order it submitted them.

Workers are daemon threads, started as calls need them, so a call that never returns cannot keep the process
alive; the worker it holds is given up and replaced, so the pool keeps its size. A worker with nothing to do for
:data:`IDLE_S` seconds ends (the next :meth:`CallPool.run` starts what it needs again), so a pool that is no
longer used holds no threads. A call that returns a coroutine (an ``async def`` method) is run to completion on
an event loop of its worker.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

TIMED_OUT = object()  # an outcome: the call was still running when its time was up
IDLE_S = 5.0  # a worker that waited this long for a call ends


class _Call:
    __slots__ = ("fn", "started", "done", "value", "error", "abandoned")

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.started, self.done = fn, None, threading.Event()
        self.value, self.error, self.abandoned = None, None, False


class CallPool:
    """At most ``size`` daemon workers named ``name``; :meth:`run` runs a list of calls on them."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _live, _pending and the decision of a worker to end
        self._live = 0  # workers that will take a queued call (busy ones after their call)
        self._pending = 0  # calls queued or running, of every caller (not those given up)
        self._named = 0

    @property
    def workers(self) -> int:
        """Workers that will take a queued call now or after the one they run."""
        return self._live

    def _start(self, n: int) -> None:
        """``n`` more workers (``_lock`` held, ``_live`` not yet counting them)."""
        for _ in range(n):
            self._live += 1
            self._named += 1
            threading.Thread(target=self._work, name=f"{self.name} #{self._named}", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                call = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:  # run() queues under the lock: a call queued now finds this worker counted
                    if self._queue.empty():
                        self._live -= 1
                        return
                continue
            call.started = time.monotonic()
            try:
                call.value = resolved(call.fn())
            except BaseException as e:  # noqa: BLE001 (handed to the caller, who reports it)
                call.error = e
            with self._lock:
                call.done.set()
                if call.abandoned:  # no longer counted: its replacement took this worker's place
                    return
                self._pending -= 1

    def run(
        self, fns: list[Callable[[], Any]], timeout_s: float | None
    ) -> list[tuple[Any, BaseException | None]]:
        """Run every ``fn()`` on the pool (at most ``size`` at once); returns ``(value, error)`` per call in
        the order given: ``error`` is what the call raised, or None; ``value`` is :data:`TIMED_OUT` when the call
        ran longer than ``timeout_s`` seconds after it started (None: no limit)."""
        calls = [_Call(fn) for fn in fns]
        with self._lock:  # as many workers as the calls of every caller need, up to the pool's size
            for call in calls:
                self._queue.put(call)
            self._pending += len(calls)
            self._start(max(0, min(self.size, self._pending) - self._live))
        out = []
        for call in calls:
            if not _wait(call, timeout_s):
                with self._lock:  # the stuck worker is given up: a fresh one keeps the pool's size
                    if not call.done.is_set():  # (one that ended this very moment goes on)
                        call.abandoned = True
                        self._live -= 1
                        self._pending -= 1
                        self._start(1)
                out.append((TIMED_OUT, None))
                continue
            out.append((call.value, call.error))
        return out


def _wait(call: _Call, timeout_s: float | None) -> bool:
    """Whether ``call`` finished within ``timeout_s`` of its start (it may wait its turn in the queue first)."""
    while not call.done.is_set():
        if timeout_s is None:
            call.done.wait()
            break
        if call.started is None:  # queued behind busy workers: its clock has not started
            call.done.wait(0.01)
            continue
        left = call.started + timeout_s - time.monotonic()
        if left <= 0 or not call.done.wait(left):
            return call.done.is_set()
    return True


def resolved(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable (an ``async def`` method's coroutine), run to
    completion on an event loop of this thread."""
    return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value


async def _awaited(awaitable: Any) -> Any:
    return await awaitable

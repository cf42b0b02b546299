"""The batching queue of shifu's services: concurrent requests merged into one call of a batch function.

One asyncio task feeds one worker thread (the ``executor``, one thread: one call at a time). While a call
runs, the event loop keeps accepting requests; when it ends, the oldest pending item starts the next call
and every other pending item that :attr:`BatchQueue.joins` it goes along, in arrival order (an item that
does not join, being of another kind or over the call's budget, waits for a later call; the oldest item
always goes first, so none waits forever). With ``wait``, a call does not start as soon as an item is pending:
it waits up to ``wait(pending items)`` seconds after the oldest pending item arrived for more items to join (a
trainer's gateway waits for the calls of the episodes it is about to answer; ``math.inf``: until an arrival or
:meth:`BatchQueue.wake` lets it ask again). With ``order``, a call is formed from the pending items in the order
of their keys instead of their arrival (the same items make the same calls however they arrived). The reward
service merges token blocks into one forward
(:mod:`shifu.serve.batcher`); the gateway merges chat completions of one sampling setting into one sampler
call (:mod:`shifu.gateway.engine`). A failed call fails the requests in it, never the server.

With ``admitting``, a call is ``run(items, feed)`` and may take pending items while it runs (:class:`Feed`: the
oldest first, up to the first it refuses) and hand each item its result as soon as it has it; the gateway's
engine admits requests into a running decode so (:meth:`shifu.gateway.engine.Engine.run_admitting`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class _Job:
    future: asyncio.Future
    item: Any = None  # merged with other items into one call of the batch function
    alone: Callable | None = None  # a function run by itself between two calls
    arrived: float = 0.0  # the event loop's time when it was queued


class BatchQueue:
    """Pending items merged into calls of ``run(items) -> results`` (one result per item, in order) on
    ``executor`` (see the module docstring).

    ``joins(batch, item) -> bool`` says whether ``item`` may go into the call that holds the items ``batch``
    (the first); None: every item is a call of its own (no merging). ``wait(pending items) -> seconds``: how
    long after the oldest pending item arrived the next call may wait for more (0: start now; ``math.inf``:
    until asked again); None: never wait. ``order(item) -> key``: the items of a call are taken in the order of
    their keys (a stable sort: equal keys in arrival order); None: in arrival order. ``admitting``: calls are
    ``run(items, feed)`` (:class:`Feed`, module docstring)."""

    def __init__(
        self,
        run: Callable[[list], list],
        executor: ThreadPoolExecutor,
        joins: Callable[[list, Any], bool] | None = None,
        wait: Callable[[list], float] | None = None,
        order: Callable[[Any], Any] | None = None,
        admitting: bool = False,
    ):
        self.run, self.executor, self.joins, self.wait, self.order = run, executor, joins, wait, order
        self.admitting = admitting
        self._jobs: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._event_loop = asyncio.get_running_loop()
        self._task = self._event_loop.create_task(self._loop())

    def wake(self) -> None:
        """Ask ``wait`` again now (from any thread): what it depends on besides the pending items changed."""
        with contextlib.suppress(RuntimeError):  # (the event loop has closed: nothing waits any more)
            self._event_loop.call_soon_threadsafe(self._wake.set)

    async def submit(self, item) -> Any:
        """The result of ``item`` once a call of the batch function has run it (with whatever joined it)."""
        return (await self.submit_many([item]))[0]

    async def submit_many(self, items: list) -> list:
        """The results of ``items``, queued together (they may still run in different calls)."""
        loop = asyncio.get_running_loop()
        jobs = [_Job(loop.create_future(), item=x, arrived=loop.time()) for x in items]
        self._jobs.extend(jobs)
        self._wake.set()
        return [await j.future for j in jobs]

    async def run_alone(self, fn: Callable) -> Any:
        """``fn()`` on the worker thread by itself, after the calls that were pending before it started."""
        loop = asyncio.get_running_loop()
        job = _Job(loop.create_future(), alone=fn, arrived=loop.time())
        self._jobs.append(job)
        self._wake.set()
        return await job.future

    def pending(self) -> int:
        """Items and functions waiting for the worker thread (not counting the call that runs)."""
        return len(self._jobs)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _take(self) -> list[_Job]:
        """The next call's jobs: the first, then each later one that joins it (arrival order, or ``order``'s;
        a function run alone comes before the items)."""
        jobs = list(self._jobs)
        if self.order is not None:
            jobs.sort(key=lambda j: (j.alone is None, self.order(j.item) if j.alone is None else 0))
        head = jobs[0]
        batch, items = [head], [head.item]
        if head.alone is None and self.joins is not None:
            for job in jobs[1:]:
                if job.alone is None and self.joins(items, job.item):
                    batch.append(job)
                    items.append(job.item)
        taken = {id(j) for j in batch}
        self._jobs = deque(j for j in self._jobs if id(j) not in taken)  # the rest in arrival order
        return batch

    async def _gather(self, loop) -> None:
        """Wait for more items while ``wait`` allows it (each arrival asks again)."""
        while self.wait is not None and self._jobs:
            left = self._jobs[0].arrived + self.wait([j.item for j in self._jobs]) - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # (TimeoutError's alias from Python 3.11)
                await asyncio.wait_for(self._wake.wait(), None if math.isinf(left) else left)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._jobs:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._gather(loop)
                batch = self._take()
            except Exception as e:  # a failing wait, order or joins fails what is pending, not the queue
                jobs, self._jobs = list(self._jobs), deque()
                await _settle(jobs, _failed(loop, e))
                continue
            if batch[0].alone is not None:
                await _settle(batch, loop.run_in_executor(self.executor, batch[0].alone), alone=True)
            elif self.admitting:
                feed = Feed(self, loop, batch)
                work = loop.run_in_executor(self.executor, self.run, [j.item for j in batch], feed)
                await _settle(feed.jobs, work)
            else:
                work = loop.run_in_executor(self.executor, self.run, [j.item for j in batch])
                await _settle(batch, work)

    def _admit(self, feed: Feed, accept: Callable[[Any], bool], answer: concurrent.futures.Future) -> None:
        """On the event loop: the pending items, oldest first, up to the first one ``accept`` refuses (or a
        function to run alone), moved into ``feed``'s call; ``answer`` gets them."""
        if not answer.set_running_or_notify_cancel():  # (the worker stopped asking)
            return
        try:
            taken = []
            for job in self._jobs:
                if job.alone is not None or job.future.done() or not accept(job.item):
                    break
                taken.append(job)
        except Exception as e:  # a failing accept admits nothing; the call goes on
            answer.set_exception(e)
            return
        for _ in taken:
            self._jobs.popleft()
        feed.jobs.extend(taken)
        answer.set_result([j.item for j in taken])


class Feed:
    """What a call of an admitting queue (``admitting=True``: ``run(items, feed)``) sees of the queue from the
    worker thread: :meth:`more` admits pending items into the running call, :meth:`deliver` hands one item its
    result before the call ends. An item's index is its place among the call's first items, then those
    :meth:`more` returned, in order; ``run`` still returns every item's result (those delivered already are
    left as they are)."""

    def __init__(self, queue: BatchQueue, loop, jobs: list[_Job]):
        self.queue, self.loop, self.jobs = queue, loop, list(jobs)

    def more(self, accept: Callable[[Any], bool]) -> list:
        """The pending items, oldest first, up to the first that ``accept(item)`` refuses (called on the event
        loop, one item after the other: it may count what it accepted), now items of this call. A pending item
        that is refused, or a function to run alone, stops admission, so it waits for this call only."""
        if not self.queue._jobs:  # (a read from another thread: at worst a step late)
            return []
        answer: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.loop.call_soon_threadsafe(self.queue._admit, self, accept, answer)
        except RuntimeError:  # the event loop has closed
            return []
        try:
            return answer.result(timeout=5.0)
        except concurrent.futures.TimeoutError:
            if answer.cancel():  # not taken: nothing admitted
                return []
            return answer.result()

    def deliver(self, index: int, result) -> None:
        """Hand item ``index`` its result now (from the worker thread)."""
        future = self.jobs[index].future
        with contextlib.suppress(RuntimeError):  # (the event loop has closed)
            self.loop.call_soon_threadsafe(_resolve, future, result)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():  # a client that went away leaves a cancelled future
        future.set_result(result)


def _failed(loop, e: Exception) -> asyncio.Future:
    future = loop.create_future()
    future.set_exception(e)
    return future


async def _settle(jobs: list[_Job], work: asyncio.Future, alone: bool = False) -> None:
    """Await the worker thread's ``work`` and hand each job its result (or the exception)."""
    try:
        result = await work
    except Exception as e:  # a failed call fails the requests in it, not the server
        for j in jobs:
            if not j.future.done():
                j.future.set_exception(e)
        return
    for j, part in zip(jobs, [result] if alone else result):
        if not j.future.done():  # a client that went away leaves a cancelled future
            j.future.set_result(part)

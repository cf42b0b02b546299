"""Independent pieces of work side by side on one machine, one forked process and one torch thread each.

Models of the quickstart's size gain less from a second intra-op thread than from a core of their own: a decode
step of 64 rows is a few small matrix products, too small to split well between threads. :func:`map_forked`
runs ``fn(item)`` for each item, each with one torch thread: in forked processes at once when this process has
a torch thread for each (on Linux), else one after another here (with one thread meanwhile). Either way each
item's result is the one it gets alone on one thread, so the results do not depend on the thread count or on
whether the machine can fork.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from shifu.errors import ShifuError


def map_forked(
    fn: Callable[[Any, Callable[[int], None]], Any],
    items: Sequence[Any],
    what: str,
    on_progress: Callable[[int], object] | None = None,
) -> list:
    """``[fn(item, progress) for item in items]``, each call on one torch thread; side by side (forked, the
    results sent back pickled) when the process has a torch thread per item and can fork. ``progress(n)`` from
    inside ``fn`` reaches ``on_progress(n)`` here (a progress bar's ``update``). A failing call raises
    :class:`ShifuError` naming ``what`` and the item's index, with the call's traceback."""
    import multiprocessing

    import torch

    report = on_progress or (lambda n: None)
    threads = torch.get_num_threads()
    # fork only on Linux: macOS forbids forking a process whose threads used its system frameworks
    forkable = sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
    if len(items) < 2 or threads < len(items) or not forkable:
        torch.set_num_threads(1)
        try:
            return [fn(item, report) for item in items]
        finally:
            torch.set_num_threads(threads)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    sys.stdout.flush(), sys.stderr.flush()  # (a forked child would write what is buffered again)
    procs = [
        ctx.Process(target=_child, args=(fn, item, i, queue), daemon=True) for i, item in enumerate(items)
    ]
    results: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        while len(results) < len(items):
            message = _next(queue, procs)
            if message is None:  # every child has exited and nothing is left to read
                break
            kind, i, payload = message
            if kind == "progress":
                report(payload)
            elif kind == "error":
                raise ShifuError(f"{what} {i + 1} of {len(items)} failed in its process:\n{payload}")
            else:
                results[i] = payload
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join()
    missing = [i for i in range(len(items)) if i not in results]
    if missing:
        codes = ", ".join(f"{i + 1}: exit status {procs[i].exitcode}" for i in missing)
        raise ShifuError(
            f"{what}: the process of part(s) {codes} ended without a result (killed, or out of memory?)"
        )
    return [results[i] for i in range(len(items))]


def _next(queue, procs) -> tuple | None:
    """The next message of the children, or None once every child has exited and the queue is empty."""
    import time

    while queue.empty():
        if not any(p.is_alive() for p in procs):
            return None if queue.empty() else queue.get()
        time.sleep(0.01)
    return queue.get()


def _child(fn, item, i: int, queue) -> None:
    """One item of :func:`map_forked` in its forked process, on one torch thread."""
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(item, lambda n: queue.put(("progress", i, n)))
    except BaseException:  # everything reaches the parent, which names the part
        queue.put(("error", i, traceback.format_exc()))
        return
    queue.put(("done", i, result))

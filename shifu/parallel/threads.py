"""CPU threads of torch (``--threads`` or ``SHIFU_THREADS``), and glibc's malloc: freed memory kept for reuse
while a command runs, handed back between stages; large blocks handed back at once by a server."""

from __future__ import annotations

import os


def set_threads(n: int | None) -> None:
    """torch intra-op threads from --threads or SHIFU_THREADS; neither (or 0): torch's default, every core.
    One thread gives the same numbers on every machine of a CPU kind, and is best beside another busy process."""
    n = n or int(os.environ.get("SHIFU_THREADS", "0") or 0)
    if n > 0:
        import torch

        torch.set_num_threads(n)


MALLOC_ENV = "SHIFU_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -3, -4, -8  # <malloc.h>
SERVE_MMAP_THRESHOLD = 1 << 20  # bytes: a block this large or larger is mapped on its own, unmapped on free


def keep_freed_memory() -> str:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
    and unmaps it on ``free``, so each new one page-faults all its pages in again, zero-filled by the
    kernel. Training allocates such tensors several times a step (a (V, d) gradient of SmolLM2's 49152 x 576
    embedding is 113 MB; so are the logits of a few long rows). With ``M_MMAP_MAX = 0`` every block comes
    from the heap and with ``M_TRIM_THRESHOLD`` at 2 GiB the heap is not shrunk after each free, so a step
    reuses the last step's pages: a PPO iteration at the SmolLM2-135M shape spends far less kernel CPU on page
    faults, with no higher peak RSS (docs/benchmarks/throughput.md). The price: freed memory stays with the
    process until it exits, and glibc's heap may hold more than the live tensors need (a loop of one 64 MiB
    tensor settles at ~0.9 GB).

    With ``M_ARENA_MAX = 1`` every thread allocates from that one heap. Otherwise glibc gives each thread that
    allocates its own arena, and each arena would keep its own high-water mark: memory the agent gateway's
    sampling thread freed could not serve the trainer's update on the main thread, and the process would hold
    both peaks at once (a short SmolLM2 quickstart through an agent: 3244 MiB peak with an arena per thread,
    2322 MiB with one, and no more CPU time; docs/benchmarks/throughput.md).

    Called once by ``shifu`` before any command, and by the timed runs of ``shifu bench``.
    ``SHIFU_MALLOC=system``, or any ``MALLOC_*`` / ``GLIBC_TUNABLES`` setting or preloaded malloc of your own,
    leaves malloc as it is.
    Returns what was done: ``"kept"``, ``"system"`` (left as asked) or ``"unavailable"`` (not glibc)."""
    mallopt = _glibc_mallopt()
    if isinstance(mallopt, str):
        return mallopt
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok = ok and mallopt(M_ARENA_MAX, 1) == 1
    return "kept" if ok else "unavailable"


def return_freed_memory() -> str:
    """Make glibc's malloc hand a freed large block back to the kernel at once: what a serving process wants.

    A server's memory should follow the requests it holds, not the most they ever held. Its decode loop
    allocates large temporaries at every step (the logits of every row, the keys and values a step reads), of
    sizes that change with the rows decoding. :func:`keep_freed_memory` keeps each of them for reuse, and
    glibc's own default does too once a freed block has raised its mmap threshold (to at most 32 MiB): the
    heap then holds its high-water mark of temporaries, in fragments no later size fits well. Serving
    SmolLM2-135M to 32 agent sessions, that was about 1.8 GB of a 4.7 GB peak (benchmarks/agent_engine.py).
    Here every block of :data:`SERVE_MMAP_THRESHOLD` (1 MiB) or more is mapped on its own and unmapped on
    ``free``, the heap of smaller ones is trimmed once 2 MiB lies free at its top, and every thread allocates
    from one arena (as with :func:`keep_freed_memory`). The price is a page fault per page of each large
    block, paid again at each allocation (docs/how-to/policy-endpoint.md gives the measured cost).

    Called by ``shifu serve --policy`` once it starts (after ``shifu`` has called :func:`keep_freed_memory`:
    every setting of that one is replaced). ``SHIFU_MALLOC=system``, or any ``MALLOC_*`` / ``GLIBC_TUNABLES``
    setting or preloaded malloc of your own, leaves malloc as it is.
    Returns what was done: ``"returned"``, ``"system"`` (left as asked) or ``"unavailable"`` (not glibc)."""
    mallopt = _glibc_mallopt()
    if isinstance(mallopt, str):
        return mallopt
    ok = mallopt(M_MMAP_MAX, 65536) == 1  # glibc's default count of mapped blocks (keep_freed_memory: 0)
    ok = ok and mallopt(M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD) == 1  # fixed: no longer raised by a free
    ok = ok and mallopt(M_TRIM_THRESHOLD, 2 * SERVE_MMAP_THRESHOLD) == 1 and mallopt(M_ARENA_MAX, 1) == 1
    return "returned" if ok else "unavailable"


def _glibc_mallopt():
    """glibc's ``mallopt``, or why it is not to be called: ``"system"`` (the user's own malloc settings, or
    ``SHIFU_MALLOC=system``) or ``"unavailable"`` (not glibc)."""
    own = "GLIBC_TUNABLES" in os.environ or "malloc" in os.environ.get("LD_PRELOAD", "")  # jemalloc, tcmalloc
    if os.environ.get(MALLOC_ENV, "") == "system" or own or any(k.startswith("MALLOC_") for k in os.environ):
        return "system"
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return "unavailable"
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "unavailable"


def release_freed_memory() -> bool:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim(0)``); False where that is not glibc.

    ``shifu`` keeps freed memory for reuse while a trainer runs (:func:`keep_freed_memory`); a
    pipeline calls this after each trainer stage, so the next stage (new models, other shapes) does not grow
    on top of what the last one left: the pipeline's peak is its largest stage, not their sum."""
    import ctypes
    import gc
    import platform

    gc.collect()
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0) >= 0)
    except (OSError, AttributeError):
        return False

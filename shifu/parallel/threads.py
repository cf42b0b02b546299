"""CPU threads of torch (``--threads`` or ``SHIFU_THREADS``), and handing freed memory back between stages."""

from __future__ import annotations

import os


def set_threads(n: int | None) -> None:
    """torch intra-op threads from --threads or SHIFU_THREADS; neither (or 0): torch's default, every core.
    One thread gives the same numbers on every machine of a CPU kind, and is best beside another busy process."""
    n = n or int(os.environ.get("SHIFU_THREADS", "0") or 0)
    if n > 0:
        import torch

        torch.set_num_threads(n)


def release_freed_memory() -> bool:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim(0)``); False where that is not glibc.

    ``shifu`` keeps freed memory for reuse while a trainer runs (``shifu.cli.main.keep_freed_memory``); a
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

"""CPU threads of torch: ``--threads`` or ``SHIFU_THREADS``."""

from __future__ import annotations

import os


def set_threads(n: int | None) -> None:
    """torch intra-op threads from --threads or SHIFU_THREADS; neither (or 0): torch's default, every core.
    One thread gives the same numbers on every machine of a CPU kind, and is best beside another busy process."""
    n = n or int(os.environ.get("SHIFU_THREADS", "0") or 0)
    if n > 0:
        import torch

        torch.set_num_threads(n)

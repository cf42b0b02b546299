"""The reward service's batching: token blocks merged into one forward by the shared queue
(:class:`shifu.http.batching.BatchQueue`), one forward at a time, the oldest request first. The blocks pending
when a forward ends are merged into the next one, right-padded to one width (:func:`stack_blocks`), up to
``--max-batch-tokens`` (rows x width); ``--exact`` runs each request alone, as sent. A failed forward fails
the requests in it, never the server.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from shifu.http.batching import BatchQueue


def split_rows(
    ids: torch.Tensor, mask: torch.Tensor, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a (B, T) block into pieces of at most ``max_tokens`` = rows x T (at least one row each)."""
    step = max(1, max_tokens // ids.shape[1])
    return [(ids[i : i + step], mask[i : i + step]) for i in range(0, ids.shape[0], step)]


def stack_blocks(
    blocks: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_i, T_i) blocks -> one (sum n_i, max T_i) batch, narrower blocks right-padded (mask 0).

    Right padding leaves every real position's value unchanged in exact arithmetic (position ids and the
    scored last token come from the mask; causal attention never looks right, and encoders mask padded
    keys), but not in float32: the scores of a merged forward can differ from the same rows scored alone
    by a few units in the last place.
    """
    width = max(ids.shape[1] for ids, _ in blocks)
    out_ids = torch.full((sum(ids.shape[0] for ids, _ in blocks), width), pad_id, dtype=torch.long)
    out_mask = torch.zeros_like(out_ids)
    row = 0
    for ids, mask in blocks:
        n, t = ids.shape
        out_ids[row : row + n, :t], out_mask[row : row + n, :t] = ids, mask
        row += n
    return out_ids, out_mask


@dataclass
class Batcher:
    """The reward service's queue (:class:`shifu.http.batching.BatchQueue`): one scoring thread (``executor``),
    one forward at a time, the oldest request first.

    ``merge=True``: the blocks pending when a forward ends go into the next forward together, right-padded
    to one width (:func:`stack_blocks`), up to ``max_batch_tokens`` = rows x width; a larger request is cut
    into pieces of that size. ``merge=False`` (``--exact``): each request is one forward exactly as sent,
    so its scores equal in-process scores of the same micro-batch bit for bit.
    """

    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    max_batch_tokens: int
    executor: ThreadPoolExecutor
    merge: bool = True
    pad_id: int = 0
    stats: dict = field(default_factory=lambda: {"requests": 0, "forwards": 0, "rows": 0})

    def __post_init__(self):
        self.queue = BatchQueue(self._forward, self.executor, self._joins if self.merge else None)

    def _joins(self, blocks: list[tuple[torch.Tensor, torch.Tensor]], block) -> bool:
        rows = sum(b[0].shape[0] for b in blocks) + block[0].shape[0]
        width = max(max(b[0].shape[1] for b in blocks), block[0].shape[1])
        return rows * width <= self.max_batch_tokens

    async def score_blocks(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """(sum n_i,) float32 scores of a request's (n_i, T_i) blocks, once the batcher has run them."""
        if self.merge:
            blocks = [piece for ids, mask in blocks for piece in split_rows(ids, mask, self.max_batch_tokens)]
        self.stats["requests"] += 1
        parts = await self.queue.submit_many(blocks)
        return torch.cat(parts) if parts else torch.zeros(0)

    async def run_alone(self, fn: Callable):
        """``fn()`` on the scoring thread, between two forwards."""
        self.stats["requests"] += 1
        return await self.queue.run_alone(fn)

    def pending(self) -> int:
        return self.queue.pending()

    async def close(self) -> None:
        await self.queue.close()

    def _forward(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """On the scoring thread: one forward over the blocks, split back into each block's scores."""
        ids, mask = blocks[0] if len(blocks) == 1 else stack_blocks(blocks, self.pad_id)
        parts = list(self.score(ids, mask).split([b[0].shape[0] for b in blocks]))
        self.stats["forwards"] += 1
        self.stats["rows"] += ids.shape[0]
        return parts

"""The batching queue of ``shifu serve``: one asyncio task feeds one scoring thread, one forward at a time, in
arrival order. The blocks pending when a forward ends are merged into the next one, right-padded to one width
(:func:`stack_blocks`), up to ``--max-batch-tokens`` (rows x width); ``--exact`` runs each request alone, as
sent. A failed forward fails the requests in it, never the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


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
class _Job:
    future: asyncio.Future
    block: tuple[torch.Tensor, torch.Tensor] | None = None  # a (n, T) block, merged with others
    call: Callable | None = None  # run alone (reward functions, ensembles of several tokenizers)


@dataclass
class Batcher:
    """The batching queue: one asyncio task takes pending jobs and runs them on ``executor`` (one thread:
    one forward at a time, in arrival order).

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
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._held: _Job | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def score_blocks(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """(sum n_i,) float32 scores of a request's (n_i, T_i) blocks, once the batcher has run them."""
        loop = asyncio.get_running_loop()
        if self.merge:
            blocks = [piece for ids, mask in blocks for piece in split_rows(ids, mask, self.max_batch_tokens)]
        jobs = [_Job(loop.create_future(), block=b) for b in blocks]
        for job in jobs:
            self.queue.put_nowait(job)
        self.stats["requests"] += 1
        parts = [await job.future for job in jobs]
        return torch.cat(parts) if parts else torch.zeros(0)

    async def run_alone(self, fn: Callable):
        """``fn()`` on the scoring thread, between two forwards."""
        job = _Job(asyncio.get_running_loop().create_future(), call=fn)
        self.queue.put_nowait(job)
        self.stats["requests"] += 1
        return await job.future

    def pending(self) -> int:
        return self.queue.qsize() + (self._held is not None)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _forward(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """On the scoring thread: one forward over the blocks, split back into each block's scores."""
        ids, mask = blocks[0] if len(blocks) == 1 else stack_blocks(blocks, self.pad_id)
        return list(self.score(ids, mask).split([b[0].shape[0] for b in blocks]))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = self._held or await self.queue.get()
            self._held = None
            if job.call is not None:
                await self._settle([job], loop.run_in_executor(self.executor, job.call), forward=False)
                continue
            batch, rows, width = [job], job.block[0].shape[0], job.block[0].shape[1]
            while self.merge and not self.queue.empty():  # what arrived during the last forward
                nxt = self.queue.get_nowait()
                if nxt.call is not None:
                    self._held = nxt
                    break
                n, t = nxt.block[0].shape
                if (rows + n) * max(width, t) > self.max_batch_tokens:
                    self._held = nxt
                    break
                batch.append(nxt)
                rows, width = rows + n, max(width, t)
            await self._settle(
                batch, loop.run_in_executor(self.executor, self._forward, [j.block for j in batch])
            )

    async def _settle(self, jobs: list[_Job], work: asyncio.Future, forward: bool = True) -> None:
        """Await the scoring thread's ``work`` and hand each job its part (or the exception)."""
        try:
            result = await work
        except Exception as e:  # a failed forward or function fails the requests in it, not the server
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(e)
            return
        parts = result if forward else [result]
        if forward:
            self.stats["forwards"] += 1
            self.stats["rows"] += sum(int(p.shape[0]) for p in parts)
        for j, part in zip(jobs, parts):
            if not j.future.done():  # a client that went away leaves a cancelled future
                j.future.set_result(part)

"""Paged keys and values for the admitting decode loop (:mod:`shifu.generation.continuous`): a pool of
fixed-size blocks under a byte budget, each row holding a table of the blocks its tokens are in (as vLLM's paged
attention), so that the memory held follows the live tokens.

A block holds :data:`~shifu.generation.kv_cache.BLOCK` tokens' keys and values for every layer (the prefix
cache's block size). A row's tokens fill its blocks in order from the first, so token ``t`` of a row is at offset
``t % BLOCK`` of its block ``t // BLOCK``; a row grows a block at a time as it decodes, and its blocks go back to
the pool as it ends. The pool never kills or evicts a row: a row *reserves* the blocks of its prompt and its whole
budget as it is admitted (:meth:`BlockPool.reserve`), so every block it will grow into is there when it needs it,
and a request whose rows the pool cannot reserve now waits until rows end (the gateway's engine leaves it in the
queue); one that needs more than the whole budget is refused. Only the blocks a row has filled are allocated:
reserved blocks cost nothing until then, and the storage is taken from the lowest free block first, so the
memory touched stays that of the most live tokens at once.

Each decode step writes the new token's keys and values into its row's block and gathers a layer's blocks of all
rows into one tensor ``(Hkv * B, blocks * BLOCK, D)`` (:class:`PagedStep`), the columns past a row's length
masked: a copy per layer and step of what the step reads anyway, into a working buffer the pool keeps (one
layer's keys and values of the rows held, outside the budget; a fresh tensor each time would cost a page fault
per page, ~6x the copy). The attention is the decoder's own arithmetic (scores by ``baddbmm`` with a key-padding
bias, softmax, ``bmm``), so a row's log-probs are those of the static path up to the float rounding of sums over
differently padded columns (~1e-7; ``tests/test_paged_kv.py``, ``tests/test_engine_admit.py``).
Blocks are zeroed as they are allocated: a masked key must still be a number (``0 * NaN`` survives a mask).
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from shifu.generation.kv_cache import BLOCK


def blocks_for(tokens: int, block: int = BLOCK) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block)


def block_bytes(shape: tuple[int, int, int], dtype: torch.dtype, block: int = BLOCK) -> int:
    """Bytes of one block's keys and values for a cache of ``shape`` (layers, key/value heads, head size;
    :func:`shifu.generation.decode.kv_shape`) in ``dtype``."""
    layers, heads, dim = shape
    return 2 * layers * heads * block * dim * torch.empty((), dtype=dtype).element_size()


class BlockPool:
    """Blocks of keys and values under ``budget_bytes`` (module docstring): ``k``, ``v`` ``(L, Hkv, blocks,
    BLOCK, D)``, allocated when the first block is reserved and let go when the last reservation ends.

    Its own accounting: :attr:`capacity` blocks in all, :attr:`reserved` promised to the rows held,
    :attr:`used` allocated (never above :attr:`reserved`, which is never above :attr:`capacity`), and
    :attr:`peak` the most ever allocated at once."""

    def __init__(self, budget_bytes: int, shape: tuple[int, int, int], like: Tensor, block: int = BLOCK):
        self.shape, self.block, self.dtype, self.device = shape, block, like.dtype, like.device
        self.block_bytes = block_bytes(shape, like.dtype, block)
        self.capacity = int(budget_bytes) // self.block_bytes
        if self.capacity < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no block of {self.block_bytes} bytes "
                f"({block} tokens of this model): give a larger budget"
            )
        self.reserved = self.used = self.peak = 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self._free: list[int] = []  # a heap: the lowest free block first
        self._gathered: Tensor | None = None  # the working buffer of gather()

    @property
    def budget_bytes(self) -> int:
        return self.capacity * self.block_bytes

    def reserve(self, blocks: int) -> bool:
        """Promise ``blocks`` blocks to a row if they are free of other promises; False (nothing promised) if not.
        More than :attr:`capacity` can never be promised: a ValueError."""
        if blocks > self.capacity:
            raise ValueError(
                f"a row needs {blocks} blocks of keys and values ({blocks * self.block} tokens), more than the "
                f"whole budget holds ({self.capacity} blocks, {self.budget_bytes} bytes)"
            )
        if self.reserved + blocks > self.capacity:
            return False
        if self.k is None:  # (the storage is only address space until blocks are written)
            layers, heads, dim = self.shape
            size = (layers, heads, self.capacity, self.block, dim)
            self.k = torch.empty(size, dtype=self.dtype, device=self.device)
            self.v = torch.empty(size, dtype=self.dtype, device=self.device)
            self._free = list(range(self.capacity))
        self.reserved += blocks
        return True

    def allocate(self, blocks: int) -> list[int]:
        """``blocks`` free blocks, zeroed, out of what was reserved."""
        if self.used + blocks > self.reserved:
            raise RuntimeError(
                f"{blocks} more blocks allocated than reserved ({self.used} of {self.reserved})"
            )
        got = [heapq.heappop(self._free) for _ in range(blocks)]
        if got:
            index = torch.tensor(got, device=self.device)
            self.k[:, :, index] = 0
            self.v[:, :, index] = 0
        self.used += blocks
        self.peak = max(self.peak, self.used)
        return got

    def release(self, blocks: list[int], reserved: int) -> None:
        """A row's ``blocks`` and the rest of its ``reserved`` blocks back to the pool."""
        for b in blocks:
            heapq.heappush(self._free, b)
        self.used -= len(blocks)
        self.reserved -= reserved
        if self.reserved == 0:
            self.k = self.v = self._gathered = None
            self._free = []

    def write(self, blocks: list[int], k: Tensor, v: Tensor) -> None:
        """Write ``k``, ``v`` ``(L, Hkv, n, D)``, a row's first ``n`` tokens, into its ``blocks``."""
        n, bs = k.shape[2], self.block
        pad = len(blocks) * bs - n
        if pad:
            k = torch.cat([k, k.new_zeros(k.shape[:2] + (pad,) + k.shape[3:])], dim=2)
            v = torch.cat([v, v.new_zeros(v.shape[:2] + (pad,) + v.shape[3:])], dim=2)
        index = torch.tensor(blocks, device=self.device)
        self.k[:, :, index] = k.unflatten(2, (len(blocks), bs))
        self.v[:, :, index] = v.unflatten(2, (len(blocks), bs))

    def read(self, blocks: list[int], n: int) -> tuple[Tensor, Tensor]:
        """The keys and values ``(L, Hkv, n, D)`` of a row's first ``n`` tokens (a copy)."""
        index = torch.tensor(blocks, device=self.device)
        k, v = self.k[:, :, index].flatten(2, 3), self.v[:, :, index].flatten(2, 3)
        return k[:, :, :n], v[:, :, :n]

    def gather(self, layer: int, index: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s keys and values of blocks ``index`` (n,), in that order: ``(Hkv, n, BLOCK, D)`` each,
        views of the working buffer (module docstring), good until the next call."""
        heads, n, bs, dim = self.k.shape[1], index.numel(), self.block, self.k.shape[-1]
        size = heads * n * bs * dim
        if (
            self._gathered is None or self._gathered.shape[1] < size
        ):  # grown with slack: rows grow a block a time
            self._gathered = torch.empty((2, size + size // 4), dtype=self.dtype, device=self.device)
        k = self._gathered[0, :size].view(heads, n, bs, dim)
        v = self._gathered[1, :size].view(heads, n, bs, dim)
        torch.index_select(self.k[layer], 1, index, out=k)
        torch.index_select(self.v[layer], 1, index, out=v)
        return k, v

    def counters(self) -> dict[str, int]:
        """The accounting in bytes (class docstring)."""
        return {
            "budget_bytes": self.budget_bytes,
            "block_bytes": self.block_bytes,
            "reserved_bytes": self.reserved * self.block_bytes,
            "bytes": self.used * self.block_bytes,
            "peak_bytes": self.peak * self.block_bytes,
        }


class PagedStep:
    """One decode step over ``pool`` (module docstring), set as the decoder's ``paged``: row ``b``'s new token
    goes to offset ``lengths[b] % BLOCK`` of block ``tables[b][lengths[b] // BLOCK]``, and it attends over its
    first ``lengths[b] + 1`` tokens."""

    def __init__(self, pool: BlockPool, tables: list[list[int]], lengths: list[int]):
        bs, device = pool.block, pool.device
        self.pool, self.rows = pool, len(tables)
        self.slot_block = torch.tensor([t[n // bs] for t, n in zip(tables, lengths)], device=device)
        self.slot_offset = torch.tensor([n % bs for n in lengths], device=device)
        width = max(len(t) for t in tables)
        # a short table is padded with its own last block (a number, masked)
        padded = [t + [t[-1]] * (width - len(t)) for t in tables]
        self.index = torch.tensor(padded, device=device).flatten()  # (B * blocks,)
        seen = torch.tensor(lengths, device=device).unsqueeze(1) + 1  # keys each row attends over
        cols = torch.arange(width * bs, device=device)
        bias = torch.zeros((self.rows, width * bs), dtype=pool.dtype, device=device)
        bias.masked_fill_(cols >= seen, float("-inf"))
        self.bias = bias.unsqueeze(1)  # (B, 1, S): expanded over the key/value heads per layer

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q (B, H, 1, D); k, v (B, Hkv, 1, D), written to the rows' blocks first -> (B, H, 1, D)."""
        B, H, _, D = q.shape
        keys, values = self.pool.k[layer], self.pool.v[layer]  # (Hkv, blocks, BLOCK, D)
        Hkv = keys.shape[0]
        keys[:, self.slot_block, self.slot_offset] = k[:, :, 0].transpose(0, 1)
        values[:, self.slot_block, self.slot_offset] = v[:, :, 0].transpose(0, 1)
        # (Hkv * B, S, D): head-major, so that the gather is one copy and a view
        keys, values = self.pool.gather(layer, self.index)
        keys, values = keys.view(Hkv * B, -1, D), values.view(Hkv * B, -1, D)
        # query heads sharing a key/value head (GQA: head h uses h // rep) are the rep rows of one group
        qg = q.reshape(B, Hkv, H // Hkv, D).transpose(0, 1).reshape(Hkv * B, H // Hkv, D)
        bias = self.bias.expand(Hkv, B, 1, -1).reshape(Hkv * B, 1, -1)
        scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=scale)
        out = torch.bmm(torch.softmax(scores, dim=-1), values)  # (Hkv * B, rep, D)
        return out.view(Hkv, B, H // Hkv, D).transpose(0, 1).reshape(B, H, 1, D)

"""Prefix reuse: the keys and values of token sequences already decoded, kept between sampler calls so that a
call prefills only the tokens after the longest cached prefix of each prompt.

A sequence's keys and values are kept in blocks of ``block`` tokens (:class:`PrefixCache`). A block is named by
its tokens and its parent (the block before it), so a block stands for the whole prefix up to its end: two
prompts that share their first tokens (an agent's next turn, which extends its last prompt and completion; the
same system prompt and tools block in every episode) share those blocks, stored once. Only whole blocks are
kept. The keys and values of a token depend on it and the tokens before it only (positions count from a row's
first real token, :func:`shifu.models.padding.position_ids_from_mask`, whatever the padding), so a cached
prefix holds what a full prefill would compute, up to float rounding: the log-probs read off the decode steps
differ from a full prefill's by ~1e-6, within the 1e-5 the trainer's recomputation is held to
(``tests/test_prefix_cache.py`` pins it, and that the sampled ids are the same).

The cache is held under a budget of bytes; past it the least recently used blocks go first. A block is always
used (and stored) together with its parents, and the parents are touched after it, so the least recently used
block is never the parent of a kept one. :meth:`PrefixCache.clear` (new weights: every kept value is stale)
drops everything, and a call that started before it stores nothing (:class:`CallPrefixes`).

One sampler call reads and fills the cache through :class:`CallPrefixes`, the ``prefix`` of
:func:`shifu.generation.rollout.sample`: its prompts are left-padded to one width ``P``, so one prefill covers
the last ``S`` columns of every row, ``S`` the longest part of a prompt not cached; each row's columns before
those are copied from its cached blocks (a row whose prompt fits in the last ``S`` columns is prefilled whole).
The decoders with a preallocated cache (:mod:`shifu.generation.decode`'s GPT-2 and Llama ones) take part; the
HF forward's cache (other architectures, adapters other than plain LoRA) prefills whole, as without a prefix cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

BLOCK = 16  # tokens per block: the prefix cache's and the admitting loop's pool's (shifu.generation.paged)


@dataclass
class Block:
    """``block`` tokens' keys and values ``(L, Hkv, block, D)`` each; ``id``: the name its children use."""

    id: int
    k: Tensor
    v: Tensor

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PrefixCache:
    """Blocks of keys and values of decoded prefixes under ``budget_bytes`` (module docstring).

    Counters, for a run's metrics and the gateway's health: ``rows`` (prompts looked up), ``hits`` (those
    that reused a cached prefix), ``prefill_tokens`` (prompt tokens computed) and ``reused_tokens`` (prompt
    tokens copied from the cache instead), ``evicted`` (blocks dropped for room)."""

    def __init__(self, budget_bytes: int, block: int = BLOCK):
        if budget_bytes < 0 or block < 1:
            raise ValueError(
                f"a prefix cache needs budget_bytes >= 0 and block >= 1, got {budget_bytes}, {block}"
            )
        self.budget, self.block = int(budget_bytes), int(block)
        self.blocks: OrderedDict[tuple[int, tuple[int, ...]], Block] = OrderedDict()  # oldest first
        self.bytes = 0
        self.generation = 0  # bumped by clear(): a call that began before stores nothing
        self._ids = 0  # the last block id given (0: the root, the parent of every first block)
        self._lock = threading.Lock()  # clear() comes from the thread that swaps the policy
        self.rows = self.hits = self.prefill_tokens = self.reused_tokens = self.evicted = 0

    def clear(self) -> None:
        """Drop every block (the weights changed)."""
        with self._lock:
            self.blocks.clear()
            self.bytes = 0
            self.generation += 1

    def match(self, ids: list[int]) -> list[Block]:
        """The cached blocks that begin ``ids``, first to last (touched: most recently used)."""
        with self._lock:
            chain, parent, bs = [], 0, self.block
            for start in range(0, len(ids) - bs + 1, bs):
                found = self.blocks.get((parent, tuple(ids[start : start + bs])))
                if found is None:
                    break
                chain.append(found)
                parent = found.id
            self._touch(ids, len(chain))
            return chain

    def keep(self, ids: list[int], k: Tensor, v: Tensor, generation: int) -> None:
        """Keep the whole blocks of ``ids``, whose keys and values are ``k``, ``v`` ``(L, Hkv, len(ids), D)``
        (views of a decoder's cache: copied), unless the cache was cleared since ``generation``. Blocks kept
        already stay as they are; the least recently used blocks make room."""
        with self._lock:
            if generation != self.generation:
                return
            parent, bs, n = 0, self.block, len(ids) // self.block
            for i in range(n):
                key = (parent, tuple(ids[i * bs : (i + 1) * bs]))
                found = self.blocks.get(key)
                if found is None:
                    size = 2 * k[:, :, :bs].numel() * k.element_size()
                    if not self._room(size, ids, i):
                        n = i
                        break
                    self._ids += 1
                    span = slice(i * bs, (i + 1) * bs)
                    found = Block(self._ids, k[:, :, span].clone(), v[:, :, span].clone())
                    self.blocks[key] = found
                    self.bytes += found.bytes
                parent = found.id
            self._touch(ids, n)

    def _room(self, size: int, ids: list[int], upto: int) -> bool:
        """Evict least recently used blocks until ``size`` more bytes fit, never one of the first ``upto``
        blocks of ``ids`` (the chain being stored); False when that is not enough."""
        self._touch(ids, upto)  # the chain so far is the most recent: evicted last
        protected = upto
        while self.bytes + size > self.budget and len(self.blocks) > protected:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old.bytes
            self.evicted += 1
        return self.bytes + size <= self.budget

    def _touch(self, ids: list[int], n: int) -> None:
        """Mark the first ``n`` blocks of ``ids`` most recently used, the last first (a parent stays more
        recent than its children)."""
        keys, parent, bs = [], 0, self.block
        for i in range(n):
            key = (parent, tuple(ids[i * bs : (i + 1) * bs]))
            keys.append(key)
            parent = self.blocks[key].id
        for key in reversed(keys):
            self.blocks.move_to_end(key)

    def counters(self) -> dict[str, float]:
        """The counters (class docstring), the hit rate and the bytes held."""
        return {
            "rows": self.rows,
            "hits": self.hits,
            "hit_rate": self.hits / self.rows if self.rows else 0.0,
            "prefill_tokens": self.prefill_tokens,
            "reused_tokens": self.reused_tokens,
            "evicted_blocks": self.evicted,
            "bytes": self.bytes,
            "budget_bytes": self.budget,
        }


class CallPrefixes:
    """One sampler call's use of a :class:`PrefixCache` (module docstring): ``prompts`` are the call's rows'
    prompt ids (unpadded, in row order). :func:`shifu.generation.rollout.sample` calls :meth:`load` before
    its prefill and :meth:`save` after its last step."""

    def __init__(self, cache: PrefixCache, prompts: list[list[int]]):
        self.cache, self.prompts = cache, prompts
        self.generation = cache.generation
        self.chains = [cache.match(p) for p in prompts]

    def load(self, dec, width: int) -> int:
        """Copy each row's cached prefix into ``dec``'s cache (prompts left-padded to ``width`` columns); the
        first column the prefill must compute (0: all of them)."""
        lengths = [len(p) for p in self.prompts]
        if not getattr(dec, "keeps_kv", False):
            self._count(lengths, [0] * len(lengths))
            return 0
        bs = self.cache.block
        # a prefill needs at least the last prompt token (its logits start the response)
        cached = [min(len(c) * bs, n - 1) for c, n in zip(self.chains, lengths)]
        start = width - max(n - c for n, c in zip(lengths, cached))
        copied = []
        for b, (chain, n) in enumerate(zip(self.chains, lengths)):
            first = width - n  # the row's first real column
            # its pad columns before ``start`` are never computed: zeros, not whatever the memory held (a NaN
            # there would survive the key mask: 0 * NaN)
            dec.k[:, b, :, : min(first, start)] = 0
            dec.v[:, b, :, : min(first, start)] = 0
            count = max(0, start - first)  # cached tokens before the prefilled columns
            for i in range(0, count, bs):
                take = min(bs, count - i)
                dec.k[:, b, :, first + i : first + i + take] = chain[i // bs].k[:, :, :take]
                dec.v[:, b, :, first + i : first + i + take] = chain[i // bs].v[:, :, :take]
            copied.append(count)
        self._count(lengths, copied)
        return start

    def _count(self, lengths: list[int], copied: list[int]) -> None:
        c = self.cache
        c.rows += len(lengths)
        c.hits += sum(1 for n in copied if n > 0)
        c.reused_tokens += sum(copied)
        c.prefill_tokens += sum(lengths) - sum(copied)

    def save(
        self,
        dec,
        width: int,
        response_ids: Tensor,
        ends: Tensor,
        steps: int,
        rows: Iterable[tuple[int, int]] | None = None,
    ) -> None:
        """Keep rows' prompts and responses in the cache: the tokens whose keys and values ``dec`` holds
        (every one fed to it: the response up to its last token, which is sampled, never fed). ``ends`` (B,):
        the index of each row's ending token (``steps`` or more: it did not end). ``rows``: (the decoder's
        cache row, the call's row) pairs; None: every row, in its own cache row."""
        if not getattr(dec, "keeps_kv", False) or self.cache.budget == 0:
            return
        fed = (ends + 1).clamp(max=steps) - 1  # response tokens fed per row
        for slot, b in enumerate(range(len(self.prompts))) if rows is None else rows:
            prompt = self.prompts[b]
            ids = prompt + response_ids[b, : int(fed[b])].tolist()
            first = width - len(prompt)
            span = slice(first, first + len(ids))
            self.cache.keep(ids, dec.k[:, slot, :, span], dec.v[:, slot, :, span], self.generation)

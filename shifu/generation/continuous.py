"""A decode loop that admits rows between its steps: :class:`Running`, the gateway engine's sampler for requests
that arrive while a call decodes (:meth:`shifu.gateway.engine.Engine.run_admitting`).

Each row's keys and values are kept in blocks of a pool under a byte budget (:mod:`shifu.generation.paged`): a
row reserves the blocks of its prompt and its whole budget as it is admitted (:meth:`Running.room` says
whether they are free), fills them as it decodes and gives them back as it ends, so no running row is ever
evicted and the memory held follows the live tokens. Rows admitted together are prefilled in runs of at most
:data:`PREFILL_TOKENS` (rows x width), each left-padded to one width in a cache of its own
(:meth:`~shifu.generation.decode._FastDecoder.scratch`) through the prefix cache (a run reuses the prompts
kept by the runs before it), and each row's real tokens are copied into its blocks. When the first of the rows
admitted together shares a block or more not yet cached with another (the same system prompt and tools block
in every episode or conversation), it is prefilled on its own first, so the others copy that head instead of
computing it each. Positions are a row's own (from its first real token), and a decode step attends over each
row's own tokens only, so a row's keys, values and logits are those a call of its own would compute, up to the
float rounding of forwards over other rows (~1e-6). A row leaves the decoder as it ends, its prompt and
response kept in the prefix cache (its prompt is kept there as it is admitted too, so that the rows admitted
after it reuse a shared system prompt and tools block), and is handed to ``on_end`` at once.

Each step samples every held row from ``log_softmax(logits / T)`` with :func:`~shifu.generation.rollout.sample_next`,
as :func:`~shifu.generation.rollout.sample` does: a row with a generator of its own draws its own numbers, so its
ids do not depend on which rows share its steps (``tests/test_engine_admit.py``: the same ids alone, in a static
batch and admitted mid-decode, log-probs within 1e-5 of the trainer's recomputation). Rows without one draw from
one shared generator, a number each per step. Only the decoders that keep their own cache take part
(``keeps_kv``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from shifu.generation.decode import decoder, kv_shape
from shifu.generation.kv_cache import CallPrefixes, PrefixCache
from shifu.generation.paged import BlockPool, PagedStep, blocks_for
from shifu.generation.rollout import SamplingParams, prefill, sample_next
from shifu.models.padding import pad_left, position_ids_from_mask


@dataclass
class Row:
    """One row to sample: ``prompt`` ids, at most ``budget`` tokens; ``stop(ids) -> bool`` (the ids sampled so
    far, a list) ends it at the token just sampled (besides EOS); ``generator``: its own, or None (the loop's
    shared one); ``top_logprobs``: how many of each step's most likely ids to keep; ``on_token(id, log_prob,
    top)`` after each of its tokens. What it sampled: ``ids``, ``log_probs``, ``entropy`` and, with
    ``top_logprobs``, ``top``: per token the most likely ``(id, log-prob)``, best first, read off the
    distribution its token was sampled from (None without)."""

    prompt: list[int]
    budget: int
    stop: Callable[[list[int]], bool] | None = None
    generator: torch.Generator | None = None
    on_token: Callable[[int, float, list[tuple[int, float]] | None], None] | None = None
    tag: object = None  # the caller's
    top_logprobs: int = 0
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    # its block table: the pool's blocks its tokens are in, in order
    blocks: list[int] = field(default_factory=list)
    reserved: int = 0  # the blocks the pool promised it (its prompt and whole budget)

    @property
    def need(self) -> int:
        """Tokens the row may hold: its prompt and whole budget (the blocks it reserves)."""
        return len(self.prompt) + self.budget


PREFILL_TOKENS = 4096  # the most (rows x width) tokens prefilled in one forward, besides one row's own


def _chunks(rows: list[Row], tokens: int) -> list[list[Row]]:
    """``rows`` in order, in runs whose rows x longest prompt stay within ``tokens`` (a run has at least one row):
    the scratch cache of a prefill holds that many tokens' keys and values, outside the pool."""
    out: list[list[Row]] = []
    width = 0
    for r in rows:
        wide = max(width, len(r.prompt))
        if out and (len(out[-1]) + 1) * wide <= tokens:
            out[-1].append(r)
            width = wide
        else:
            out.append([r])
            width = len(r.prompt)
    return out


def _shared(a: list[int], b: list[int]) -> int:
    """How many ids ``a`` and ``b`` begin with in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Running:
    """The loop (module docstring): :meth:`admit` rows, :meth:`step` until :attr:`rows` is empty; ``on_end(row)``
    for each row as it ends. ``generator``: the rows without one of their own draw from it; ``batch``: the rows
    expected (:func:`~shifu.generation.decode.head_product` reads the output embedding in the order measured
    fastest at that many rows); ``kv_budget_bytes``: the pool's budget (:attr:`pool`)."""

    def __init__(
        self,
        model,
        params: SamplingParams,
        eos_token_id: int,
        pad_token_id: int,
        on_end: Callable[[Row], None],
        generator: torch.Generator | None = None,
        prefix: PrefixCache | None = None,
        batch: int = 1,
        kv_budget_bytes: int = 2**30,
    ):
        self.model, self.params, self.eos, self.pad = model, params, eos_token_id, pad_token_id
        self.on_end, self.generator, self.prefix = on_end, generator, prefix
        self.generation = None if prefix is None else prefix.generation  # what was kept under these weights
        weight = next(model.parameters())
        # (batch: the rows the order its output embedding is read in is measured for)
        self.dec = decoder(model, batch, 1, weight, "auto")
        if not self.dec.keeps_kv:
            raise ValueError("admitting rows while decoding needs a decoder that keeps its own cache")
        self.pool = BlockPool(kv_budget_bytes, kv_shape(model), weight)
        self.rows: list[Row] = []
        self.logits: Tensor | None = None  # (rows, V) of the held rows' next tokens

    def room(self, *tokens: int) -> bool:
        """Whether rows that may hold ``tokens`` tokens each (:attr:`Row.need`) can be admitted now, together."""
        pool = self.pool
        return pool.reserved + sum(blocks_for(n, pool.block) for n in tokens) <= pool.capacity

    def admit(self, rows: list[Row]) -> None:
        """Prefill ``rows`` (through the prefix cache) and hold them from the next :meth:`step` on; each reserves
        its blocks (a ValueError if the pool cannot hold them now: ask :meth:`room` first)."""
        pool, done = self.pool, []
        try:
            for r in rows:
                r.reserved = blocks_for(r.need, pool.block)
                if not pool.reserve(r.reserved):
                    raise ValueError(
                        f"no room in the KV pool for a row of {r.need} tokens now "
                        f"({pool.reserved} of {pool.capacity} blocks reserved): admit it once rows have ended"
                    )
                done.append(r)
        except ValueError:
            for r in done:
                pool.release([], r.reserved)
            raise
        chunks = (
            [[rows[0]], *_chunks(rows[1:], PREFILL_TOKENS)]
            if self._leads(rows)
            else _chunks(rows, PREFILL_TOKENS)
        )
        logits = torch.cat([self._prefill(chunk) for chunk in chunks])
        held = bool(self.rows)
        self.rows.extend(rows)
        self.logits = logits if self.logits is None or not held else torch.cat([self.logits, logits])

    def _leads(self, rows: list[Row]) -> bool:
        """Whether the first of ``rows`` is to be prefilled on its own first: a prompt that shares a block or more
        not yet cached with another row's (the same system prompt and tools block), which the rows prefilled after
        it then reuse from the prefix cache instead of computing each."""
        if self.prefix is None or len(rows) < 2:
            return False
        first, block = rows[0].prompt, self.prefix.block
        known = len(self.prefix.match(first)) * block
        return any(_shared(first, r.prompt) >= known + block for r in rows[1:])

    def _prefill(self, rows: list[Row]) -> Tensor:
        """Prefill ``rows`` (left-padded to one width) in a cache of their own through the prefix cache, each
        row's tokens copied into its blocks; their (rows, V) logits."""
        dec, pool, width = self.dec, self.pool, max(len(r.prompt) for r in rows)
        enc = pad_left([r.prompt for r in rows], self.pad)
        ids, mask = enc["input_ids"].to(pool.device), enc["attention_mask"]
        calls = None
        if self.prefix is not None:
            calls = CallPrefixes(self.prefix, [r.prompt for r in rows])
            calls.generation = self.generation
        with dec.scratch(len(rows), width) as scratch:
            scratch.key_mask[:] = mask.bool()
            logits = prefill(scratch, ids, position_ids_from_mask(mask).to(pool.device), calls)
            for b, r in enumerate(rows):
                span = slice(width - len(r.prompt), width)
                k, v = scratch.k[:, b, :, span], scratch.v[:, b, :, span]
                r.blocks = pool.allocate(blocks_for(len(r.prompt), pool.block))
                pool.write(r.blocks, k, v)
                if self.prefix is not None:  # rows prefilled after it reuse its prompt (a shared tools block)
                    self.prefix.keep(r.prompt, k, v, self.generation)
        return logits

    def step(self) -> None:
        """Sample each held row's next token; the rows that end leave (``on_end``), the others are fed it."""
        params, logits = self.params, self.logits
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        probs = logp.exp()
        own = [r.generator for r in self.rows]
        generator = own if all(g is not None for g in own) else self.generator
        tok = sample_next(logits, params, generator, probs)
        lp = logp.gather(1, tok.unsqueeze(1)).squeeze(1).tolist()
        entropy = (-(probs * logp).sum(-1)).tolist()
        ended = []
        for b, (r, t) in enumerate(zip(self.rows, tok.tolist())):
            r.ids.append(t)
            r.log_probs.append(lp[b])
            r.entropy.append(entropy[b])
            top = None
            if r.top_logprobs:
                values, index = logp[b].topk(r.top_logprobs)
                top = list(zip(index.tolist(), values.tolist()))
                r.top.append(top)
            stop = r.stop is not None and r.stop(r.ids)
            if (params.stop_at_eos and t == self.eos) or stop or len(r.ids) >= r.budget:
                ended.append(b)
            if r.on_token is not None:
                r.on_token(t, lp[b], top)
        for b in reversed(ended):  # from the last: the rows before keep their places
            self._retire(b)
        self.logits = self._feed() if self.rows else None

    def _feed(self) -> Tensor:
        """The held rows' last tokens fed (each into its next free slot, a new block when its last is full): their
        next logits."""
        pool, dec, device = self.pool, self.dec, self.pool.device
        lengths = []
        for r in self.rows:
            n = len(r.prompt) + len(r.ids) - 1  # tokens held: the new one goes at index n
            if n // pool.block == len(r.blocks):
                r.blocks += pool.allocate(1)
            lengths.append(n)
        ids = torch.tensor([[r.ids[-1]] for r in self.rows], device=device)
        pos = torch.tensor([[n] for n in lengths], device=device)
        dec.paged = PagedStep(pool, [r.blocks for r in self.rows], lengths)
        try:
            return dec.forward(ids, pos)
        finally:
            dec.paged = None

    def _retire(self, slot: int) -> None:
        row = self.rows.pop(slot)
        if self.prefix is not None:  # its prompt and the response tokens fed (the last is sampled, never fed)
            ids = row.prompt + row.ids[:-1]
            k, v = self.pool.read(row.blocks, len(ids))
            self.prefix.keep(ids, k, v, self.generation)
        self.pool.release(row.blocks, row.reserved)
        row.blocks = []
        self.on_end(row)

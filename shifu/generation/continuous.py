"""A decode loop that admits rows between its steps: :class:`Running`, the gateway engine's sampler for requests
that arrive while a call decodes (:meth:`shifu.gateway.engine.Engine.run_admitting`).

Rows share the decoder's cache columns as in :func:`shifu.generation.rollout.sample`: every step writes one
column for every row held, and a row's prompt ends at the column where its first response token goes. Rows
admitted together are left-padded to one width and prefilled in a window of the cache (their rows, their
columns: :meth:`~shifu.generation.decode._FastDecoder.window`) so that their prompts end at the current column,
through the prefix cache; when a prompt is longer than the columns before it, or the rows or the columns run
out, the cache is laid out again (:meth:`~shifu.generation.decode._FastDecoder.relayout`), the columns no held
row uses dropped. Positions are a row's own (from its first real token), the columns before a row's first are
masked, so a row's keys, values and logits are those a call of its own would compute, up to the float rounding of
forwards over other rows (~1e-6). A row leaves the decoder as it ends (the last held row moves into its place),
its prompt and response kept in the prefix cache (its prompt is kept there as it is admitted too, so that the
rows admitted after it reuse a shared system prompt and tools block), and is handed to ``on_end`` at once.

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

from shifu.generation.decode import decoder
from shifu.generation.kv_cache import CallPrefixes, PrefixCache
from shifu.generation.rollout import SamplingParams, prefill, sample_next
from shifu.models.padding import pad_left, position_ids_from_mask


@dataclass
class Row:
    """One row to sample: ``prompt`` ids, at most ``budget`` tokens; ``stop(ids (1, t+1)) -> bool`` ends it at
    the token just sampled (besides EOS); ``generator``: its own, or None (the loop's shared one);
    ``on_token(id, log_prob)`` after each of its tokens. What it sampled: ``ids``, ``log_probs``, ``entropy``."""

    prompt: list[int]
    budget: int
    stop: Callable[[Tensor], bool] | None = None
    generator: torch.Generator | None = None
    on_token: Callable[[int, float], None] | None = None
    tag: object = None  # the caller's
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    first: int = 0  # the decoder's column of its first real prompt token


class Running:
    """The loop (module docstring): :meth:`admit` rows, :meth:`step` until :attr:`rows` is empty; ``on_end(row)``
    for each row as it ends. ``generator``: the rows without one of their own draw from it; ``batch``: the rows
    expected (:func:`~shifu.generation.decode.head_product` reads the output embedding in the order measured
    fastest at that many rows)."""

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
    ):
        self.model, self.params, self.eos, self.pad = model, params, eos_token_id, pad_token_id
        self.on_end, self.generator, self.prefix = on_end, generator, prefix
        self.generation = None if prefix is None else prefix.generation  # what was kept under these weights
        weight = next(model.parameters())
        # (batch: the rows the order its output embedding is read in is measured for)
        self.dec = decoder(model, batch, 1, weight, "auto")
        if not self.dec.keeps_kv:
            raise ValueError("admitting rows while decoding needs a decoder that keeps its own cache")
        self.dec.length = 0
        self.rows: list[Row] = []
        self.logits: Tensor | None = None  # (rows, V) of the held rows' next tokens

    def admit(self, rows: list[Row]) -> None:
        """Prefill ``rows`` (through the prefix cache) and hold them from the next :meth:`step` on."""
        dec, held = self.dec, len(self.rows)
        width = max(len(r.prompt) for r in rows)
        shift = max(0, width - dec.length)
        room = max(r.budget - len(r.ids) for r in (*self.rows, *rows))
        cap_rows, cap_cols = dec.k.shape[1], dec.k.shape[3]
        if shift or held + len(rows) > cap_rows or dec.length + room > cap_cols:
            drop = min((r.first for r in self.rows), default=dec.length)
            # the columns no held row uses go, as far as the new prompts still fit before the current one
            shift -= min(drop, dec.length + shift - width)
            keep = [(slot, r.first, slot) for slot, r in enumerate(self.rows)]
            new_rows = held + len(rows) + (held + len(rows)) // 4
            dec.relayout(new_rows, dec.length + shift + room + room // 2, keep, shift)
            for r in self.rows:
                r.first += shift
        enc = pad_left([r.prompt for r in rows], self.pad)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        start = dec.length - width
        span = slice(held, held + len(rows))
        calls = None
        if self.prefix is not None:
            calls = CallPrefixes(self.prefix, [r.prompt for r in rows])
            calls.generation = self.generation
        dec.k[:, span, :, :start] = 0  # never computed: zeros (a NaN would survive the mask)
        dec.v[:, span, :, :start] = 0
        dec.key_mask[span] = True
        dec.key_mask[span, :start] = False
        with dec.window(span, start) as win:
            win.key_mask[:, :width] = mask.bool()
            logits = prefill(win, ids.to(dec.k.device), position_ids_from_mask(mask).to(dec.k.device), calls)
        for slot, r in enumerate(rows, held):
            r.first = dec.length - len(r.prompt)
            if self.prefix is not None:  # rows admitted later reuse its prompt (a shared tools block) at once
                span = slice(r.first, dec.length)
                self.prefix.keep(r.prompt, dec.k[:, slot, :, span], dec.v[:, slot, :, span], self.generation)
        self.rows.extend(rows)
        self.logits = logits if self.logits is None or not held else torch.cat([self.logits, logits])

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
            stop = r.stop is not None and r.stop(torch.tensor([r.ids]))
            if (params.stop_at_eos and t == self.eos) or stop or len(r.ids) >= r.budget:
                ended.append(b)
            if r.on_token is not None:
                r.on_token(t, lp[b])
        for b in reversed(ended):  # from the last: the row moved in has not ended
            self._retire(b)
        if self.rows:
            dec = self.dec
            ids = torch.tensor([[r.ids[-1]] for r in self.rows], device=dec.k.device)
            pos = torch.tensor([[len(r.prompt) + len(r.ids) - 1] for r in self.rows], device=dec.k.device)
            self.logits = dec.forward(ids, pos)
        else:
            self.logits = None

    def _retire(self, slot: int) -> None:
        row, dec = self.rows[slot], self.dec
        if self.prefix is not None:  # its prompt and the response tokens fed (the last is sampled, never fed)
            ids = row.prompt + row.ids[:-1]
            span = slice(row.first, row.first + len(ids))
            self.prefix.keep(ids, dec.k[:, slot, :, span], dec.v[:, slot, :, span], self.generation)
        last = len(self.rows) - 1
        if slot != last:
            dec.move(last, slot)
            self.rows[slot] = self.rows[last]
        self.rows.pop()
        self.on_end(row)

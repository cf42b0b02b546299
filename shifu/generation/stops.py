"""Where a sampled row ends besides EOS: stop strings, other end-of-turn ids, a per-row token budget, checked
after every step by :class:`RowStops` (the ``stop`` callable of :func:`shifu.generation.rollout.sample`).

Stop strings are looked for in the text of the row's last tokens only (:func:`tail_window`: enough tokens
to hold the longest stop string), so each step costs the same whatever the response's length. A token is at
least one byte of text and a character at most four, so ``4 * longest + 1`` tokens hold the longest stop
string ending at the newest token (special tokens, which decode to no text, can shorten the window's text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def stop_hit(text_tail: str, stops: Sequence[str]) -> str | None:
    """The stop string that occurs earliest in ``text_tail`` (the first of ``stops`` on a tie), or None."""
    found = [(text_tail.find(s), i) for i, s in enumerate(stops) if s and s in text_tail]
    return stops[min(found)[1]] if found else None


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to (not including) its earliest stop string, as an OpenAI-style API returns it."""
    at = [text.find(s) for s in stops if s and s in text]
    return text[: min(at)] if at else text


def tail_window(stops: Sequence[str]) -> int:
    """Tokens whose text holds the longest of ``stops`` when it ends at the newest one (module docstring)."""
    return 4 * max((len(s) for s in stops), default=0) + 1


class RowStops:
    """``stop(tokens (B, t+1), running (B,)) -> (B,) bool`` for :func:`shifu.generation.rollout.sample`: a
    row ends at the token that reaches its ``budgets[b]`` tokens, that is one of ``end_ids`` (end-of-turn
    tokens other than the sampler's EOS), or whose text completes one of its ``stops[b]``.

    After sampling, ``reasons[b]`` says why row b ended here: ``"stop"`` (a stop string, in ``hits[b]``, or
    an end id), ``"length"`` (its budget), or None (it ended at the sampler's EOS, or has not ended)."""

    def __init__(
        self,
        tokenizer,
        budgets: Sequence[int],
        stops: Sequence[Sequence[str]] | None = None,
        end_ids: Sequence[int] = (),
    ):
        self.tok = tokenizer
        self.budgets = torch.tensor(list(budgets), dtype=torch.long)
        self.stops = [list(s) for s in stops] if stops is not None else [[] for _ in budgets]
        self.windows = [tail_window(s) for s in self.stops]
        self.end_ids = torch.tensor(sorted(set(end_ids)), dtype=torch.long)
        self._ends, self._budgets = set(self.end_ids.tolist()), [int(n) for n in budgets]
        self.reasons: list[str | None] = [None] * len(self.budgets)
        self.hits: list[str | None] = [None] * len(self.budgets)

    def __call__(self, tokens: Tensor, running: Tensor) -> Tensor:
        steps = tokens.shape[1]
        newest = tokens[:, -1].tolist()
        ended = torch.zeros(len(newest), dtype=torch.bool)
        for b in running.cpu().nonzero().flatten().tolist():
            ended[b] = self.row_ends(b, newest[b], steps, lambda n, b=b: tokens[b, -n:].tolist())
        return ended

    def row_ends(self, b: int, newest: int, steps: int, tail: Callable[[int], list[int]]) -> bool:
        """Whether row ``b`` ends at ``newest``, its ``steps``-th token (``reasons[b]`` and ``hits[b]`` set);
        ``tail(n)``: the row's last ``n`` ids, read only when it has stop strings."""
        if newest in self._ends:
            self.reasons[b] = "stop"
            return True
        if self.stops[b]:
            hit = stop_hit(self.tok.decode(tail(self.windows[b]), skip_special_tokens=True), self.stops[b])
            if hit is not None:
                self.reasons[b], self.hits[b] = "stop", hit
                return True
        if steps >= self._budgets[b]:
            self.reasons[b] = "length"
            return True
        return False


def one_row(stops: RowStops) -> Callable[[list[int]], bool]:
    """A one-row :class:`RowStops` as a :class:`~shifu.generation.continuous.Row`'s ``stop(ids)``: its
    :meth:`~RowStops.row_ends` read off the row's list of ids (no tensor per step)."""
    return lambda ids: stops.row_ends(0, ids[-1], len(ids), lambda n: ids[-n:])

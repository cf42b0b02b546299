"""Sampled ids as a streaming job is told them (:mod:`shifu.gateway.engine`'s **Streaming**): each one's
:class:`Token` (its log-prob and alternatives, their texts), and the text it adds to its choice
(:class:`IncrementalText`), both made on the sampler thread with the sampler's own tokenizer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Token:
    """One sampled id as a streaming job is told it (module docstring): ``id``; ``log_prob``, the very value
    its :class:`~shifu.gateway.engine.Choice` returns; ``text``, the id decoded alone with special tokens (an OpenAI log-prob entry's
    ``token``); ``top``: with ``top_logprobs``, the step's most likely ``(id, text, log-prob)``, best first, as
    :attr:`~shifu.gateway.engine.Choice.top` has them (None without)."""

    id: int
    log_prob: float
    text: str
    top: list[tuple[int, str, float]] | None = None


class IncrementalText:
    """The text of a growing list of ids a piece at a time: :meth:`add` returns the text the new id adds
    ("" while it ends inside a multi-byte character, or adds none). The piece is the difference between
    decoding the ids from a few before the newest with and without it, not the newest alone: a tokenizer may
    write a token differently at the start of a text (SentencePiece drops a word's leading space), so the
    pieces join into the text of all the ids. Special tokens are left out, as in an answer's content."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.start = self.read = 0  # decode from ``start``; ``read``: the ids whose text is out already

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._text(self.ids[self.start : self.read])
        after = self._text(self.ids[self.start :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return after[len(before) :]

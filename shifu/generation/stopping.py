"""When a sampled turn ends besides EOS: at a stop string, or at the row's own token budget (:class:`StopAt`, the
``stop`` callback of :func:`shifu.generation.rollout.sample`)."""

from __future__ import annotations

import torch
from torch import Tensor


class StopAt:
    """Ends a row at the token that completes one of ``strings`` in its decoded turn (the token is kept), or once
    it has ``limits[i]`` tokens (None: no per-row budget).

    Only a tail of the turn is decoded after each token: a stop string first appears when the token that
    completes it is sampled, so it lies in the turn's last ``len(string)`` characters, which the last
    ``4 * len(string) + 4`` tokens cover even when a character takes several byte-level tokens. The work per
    token is constant, whatever the turn's length."""

    def __init__(self, tok, strings: tuple[str, ...] | list[str], limits: list[int] | None = None):
        self.tok, self.strings = tok, tuple(strings)
        self.limits = torch.tensor(limits) if limits is not None else None
        self.window = 4 * max(map(len, self.strings)) + 4 if self.strings else 0

    def __call__(self, tokens: Tensor, running: Tensor) -> Tensor:
        """(B,) bool on the host: which rows end at the token just sampled (``tokens`` (B, t+1) of this turn)."""
        if self.limits is not None:
            out = tokens.shape[1] >= self.limits
        else:
            out = torch.zeros(tokens.shape[0], dtype=torch.bool)
        if self.strings:
            tail = tokens[:, -self.window :].tolist()
            for j in running.nonzero().flatten().tolist():
                text = self.tok.decode(tail[j], skip_special_tokens=True)
                out[j] |= any(s in text for s in self.strings)
        return out

    def ended(self, text: str) -> bool:
        """Whether a turn's text holds a stop string (a turn that ended at one, not at its budget)."""
        return any(s in text for s in self.strings)

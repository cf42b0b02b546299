"""Token-id rows as padded tensors, and positions read from attention masks.

Rows are right-padded for training and scoring, left-padded for generation; either way the real tokens are
the ones whose mask is 1, so the last token and the position ids come from the mask, never from comparing
ids (the pad token may equal EOS).
"""

from __future__ import annotations

import torch


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last position whose mask is 1 — works for left- and right-padding alike."""
    T = attention_mask.shape[1]
    pos = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), pos, torch.full_like(pos, -1)).max(dim=1).values


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token (left padding gets position 0, unused)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pad_right(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad lists of token ids -> input_ids, attention_mask (B,T)."""
    rows = [r if isinstance(r, list) else [int(t) for t in r] for r in rows]
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask}


def pad_left(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad lists of token ids -> input_ids, attention_mask (B,T) (prompts for generation)."""
    rows = [r if isinstance(r, list) else [int(t) for t in r] for r in rows]
    T = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (T - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask}

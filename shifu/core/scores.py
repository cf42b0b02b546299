"""Score processing between the reward model and the per-token rewards (spec, stage 3 step 2).

Each step is optional and off unless configured; the trainer applies them in this order: the missing-EOS
penalty, running normalisation (its statistics are the caller's :class:`~shifu.core.RunningMoments`,
merged over every process), clipping.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .stats import RunningMoments

MISSING_EOS_MODES = ("subtract", "replace")


def penalize_missing_eos(
    scores: Tensor, eos_found: Tensor, penalty: float | None, mode: str = "subtract"
) -> Tensor:
    """Scores (B,) of responses that did not emit EOS within the token limit, penalised.

    ``mode="subtract"``: ``score - penalty``; ``"replace"``: ``-penalty`` whatever the score (TRL's
    ``missing_eos_penalty`` is the first). ``eos_found`` (B,) bool; rows with EOS are unchanged.
    ``penalty=None`` returns ``scores`` as they are.
    """
    if penalty is None:
        return scores
    if mode not in MISSING_EOS_MODES:
        raise ValueError(f"unknown missing-EOS mode '{mode}'; valid: {', '.join(MISSING_EOS_MODES)}")
    penalised = scores - penalty if mode == "subtract" else torch.full_like(scores, -penalty)
    return torch.where(eos_found, scores, penalised)


def normalize_scores(
    scores: Tensor, moments: RunningMoments | None = None, clip: float | None = None
) -> Tensor:
    """``(scores - mean) / max(std, 1e-8)`` with the running ``moments`` (every score seen so far, this
    batch included; ``None``: no normalisation), then clipped to ``[-clip, clip]`` (``None``: no clip)."""
    if moments is not None:
        scores = (scores - moments.mean) / max(moments.std, 1e-8)
    return scores if clip is None else scores.clamp(-clip, clip)

"""Per-token rewards from a sequence score and a KL penalty, and generalised advantage estimation.

Shapes: ``(B,)`` per sequence, ``(B, R)`` per response token; ``response_mask`` (B, R) bool is True on
real response tokens. Responses are right-padded: the real tokens of a row are a prefix of it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_response(name: str, x: Tensor, response_mask: Tensor) -> None:
    if x.shape != response_mask.shape or x.dim() != 2:
        raise ValueError(
            f"{name} shape {tuple(x.shape)} must equal response_mask shape {tuple(response_mask.shape)} (B, R)"
        )


def shape_rewards(scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float | Tensor) -> Tensor:
    """Per-token rewards ``(B, R)``: ``-kl_coef * kl`` on real tokens, plus the score on the last real token.

    ``scores`` (B,) is one reward-model score per sequence; ``kl`` (B, R) a per-token KL estimate against
    the reference; ``kl_coef`` a float or 0-dim tensor (beta). Conventions: the score lands on the **last
    real token** of each row (its EOS when it has one), padded positions are exactly 0, and the row sum
    is ``score - beta * sum_t kl_t`` (Ziegler et al. 2019; spec step 3). Raises ``ValueError`` when a
    row has no real token (the check reads the mask on the host).
    """
    _check_response("kl", kl, response_mask)
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"scores shape {tuple(scores.shape)} must be (B,) = ({kl.shape[0]},)")
    mask = response_mask.bool()
    has_token = mask.any(dim=1)
    if not bool(has_token.all()):
        empty = torch.nonzero(~has_token).flatten().tolist()
        raise ValueError(
            f"shape_rewards: rows {empty} have no real response token; the score has nowhere to go"
        )
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=1)  # (B,) index of the last real token
    is_last = positions.unsqueeze(0) == last.unsqueeze(1)  # (B, R)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(mask, -kl_coef * kl, zero)
    return rewards + torch.where(is_last, scores.to(kl.dtype).unsqueeze(1), zero)


def gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded responses -> ``(advantages, returns)``, (B, R) each.

    Schulman et al. 2015 ("High-dimensional continuous control using GAE"), eq. 16 as a recursion:
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, with
    ``V`` and ``A`` after the **last real token equal to 0**; ``returns_t = A_t + V_t`` on real tokens.
    Padded positions of both outputs are 0 and padded rewards/values never reach a real position.
    Advantages are not whitened here (see :func:`masked_whiten`). Inputs are normally detached.
    """
    _check_response("rewards", rewards, response_mask)
    _check_response("values", values, response_mask)
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    rewards = torch.where(mask, rewards, zero)
    values = torch.where(mask, values.to(rewards.dtype), zero)
    next_value = torch.zeros_like(rewards[:, 0])  # V_{t+1}; 0 after the last real token
    next_adv = torch.zeros_like(rewards[:, 0])  # A_{t+1}
    advantages = [zero] * rewards.shape[1]
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = torch.where(mask[:, t], delta + gamma * lam * next_adv, zero)
        advantages[t] = adv_t
        # a padded position passes the following state through unchanged (zeros at the right end)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_adv = torch.where(mask[:, t], adv_t, next_adv)
    adv = torch.stack(advantages, dim=1)
    returns = torch.where(mask, adv + values, zero)
    return adv, returns

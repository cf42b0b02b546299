"""Per-token rewards from a sequence score (or per-token / per-step process rewards) and a KL penalty,
generalised advantage estimation, REINFORCE's whole-sequence return and REINFORCE++'s reward-to-go.

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


def sequence_returns(scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float | Tensor) -> Tensor:
    """REINFORCE's whole-sequence return ``R = score - kl_coef * sum_t kl_t`` (B,), the shaped reward of
    :func:`shape_rewards` summed over the real tokens of each row (Williams 1992; Ziegler et al. 2019)."""
    _check_response("kl", kl, response_mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    return scores - kl_coef * torch.where(response_mask.bool(), kl, zero).sum(dim=1)


def sequence_advantages(returns: Tensor, response_mask: Tensor, baseline: float | Tensor = 0.0) -> Tensor:
    """REINFORCE advantages (B, R): ``R - b`` on every real token of its row, 0 on padding.

    ``returns`` (B,) from :func:`sequence_returns`; ``baseline`` b, e.g. the batch mean return (a
    variance-reducing constant: it leaves the expected gradient unchanged)."""
    return (returns - baseline).unsqueeze(1) * response_mask


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go over the real tokens (B, R): ``G_t = r_t + gamma * G_{t+1}``, ``G`` after the last real
    token 0; padded positions are 0 and their rewards never reach a real position.

    ``token_rewards`` (B, R) are per-token rewards, e.g. :func:`shape_rewards` (``-beta * kl_t`` on every
    token, the score on the last) or per-token process rewards. REINFORCE++ (Hu 2025, "REINFORCE++: a
    simple and efficient approach for aligning large language models") takes these returns as
    advantages after whitening them over the global batch (:func:`masked_whiten` with the cross-rank
    ``reduce``); its baseline variant first applies :func:`shifu.core.subtract_group_mean` to the scores.
    With ``gamma = 1`` every token of a row carries the score minus the KL of the tokens from it on.
    """
    _check_response("token_rewards", token_rewards, response_mask)
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    rewards = torch.where(mask, token_rewards, zero)
    running = torch.zeros_like(rewards[:, 0])  # G_{t+1}; 0 after the last real token
    returns = [zero] * rewards.shape[1]
    for t in reversed(range(rewards.shape[1])):
        # a padded position passes the following return through unchanged (zeros at the right end)
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[t] = torch.where(mask[:, t], running, zero)
    return torch.stack(returns, dim=1)


def shape_token_rewards(
    token_rewards: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float | Tensor
) -> Tensor:
    """Per-token rewards (B, R) from process rewards: ``token_rewards_t - kl_coef * kl_t`` on real tokens,
    exactly 0 on padding. The per-token counterpart of :func:`shape_rewards`, for a reward source that
    scores every token (or every step, see :func:`place_step_rewards`) instead of the sequence."""
    _check_response("token_rewards", token_rewards, response_mask)
    _check_response("kl", kl, response_mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    return torch.where(response_mask.bool(), token_rewards.to(kl.dtype) - kl_coef * kl, zero)


def place_step_rewards(step_rewards: Tensor, step_ends: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token rewards (B, R) with each step's reward on the step's last token, 0 elsewhere.

    ``step_rewards`` (B, S) and ``step_ends`` (B, S) long: the response position of each step's last
    token, ``-1`` for the unused step slots of a row (rows have different numbers of steps). Process
    reward models score reasoning steps (Lightman et al. 2023, "Let's verify step by step"; Wang et al.
    2024, "Math-Shepherd"), the step reward lands where the step ends, as the outcome score lands on the
    last token. Raises ``ValueError`` when a step ends on a padded position or past the response, or
    two steps of a row end on the same token (checks read the indices on the host).
    """
    if step_rewards.shape != step_ends.shape or step_rewards.dim() != 2:
        raise ValueError(
            f"step_rewards {tuple(step_rewards.shape)} and step_ends {tuple(step_ends.shape)} must be (B, S)"
        )
    if step_ends.shape[0] != response_mask.shape[0]:
        raise ValueError(f"{step_ends.shape[0]} rows of steps for {response_mask.shape[0]} responses")
    mask = response_mask.bool()
    used = step_ends >= 0
    index = torch.where(used, step_ends, 0)
    if bool((used & (step_ends >= mask.shape[1])).any()):
        raise ValueError(f"a step ends past the response (positions must be < R = {mask.shape[1]})")
    if bool((used & ~mask.gather(1, index)).any()):
        raise ValueError("a step ends on a padded position; step_ends must index real response tokens")
    counts = torch.zeros(mask.shape, dtype=torch.long, device=mask.device).scatter_add(1, index, used.long())
    if bool((counts > 1).any()):
        raise ValueError("two steps of a row end on the same token; give each step its own last token")
    zero = torch.zeros((), dtype=step_rewards.dtype, device=step_rewards.device)
    out = torch.zeros(mask.shape, dtype=step_rewards.dtype, device=step_rewards.device)
    return out.scatter_add(1, index, torch.where(used, step_rewards, zero))

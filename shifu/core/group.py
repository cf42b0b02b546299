"""Critic-free advantages from a group of ``G`` responses per prompt, and DAPO's dynamic sampling.

Layout: rows are **group-contiguous**, row ``i`` of a ``(B,)`` tensor belongs to prompt ``i // G``, so
``B = num_prompts * G`` and ``x.view(-1, G)`` has one prompt per row. A group must live on one process
(the caller splits batches at group boundaries). Every function raises ``ValueError`` when ``B`` is not
a multiple of ``G`` or ``G < 2`` (one response has no group to compare with); the checks read shapes
only, nothing from the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "bon")


def _grouped(x: Tensor, group_size: int, name: str = "rewards") -> Tensor:
    """``x`` (B,) viewed as (B // G, G), one prompt per row, after checking the layout."""
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D (B,), one number per response; got shape {tuple(x.shape)}")
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 responses per prompt for a group baseline, got {group_size}; "
            "sample more responses per prompt"
        )
    if x.shape[0] == 0 or x.shape[0] % group_size:
        raise ValueError(
            f"{name} has {x.shape[0]} rows, not a positive multiple of group_size {group_size}; rows must "
            "be whole groups, laid out group-contiguously (row i belongs to prompt i // group_size)"
        )
    return x.view(-1, group_size)


def subtract_group_mean(scores: Tensor, group_size: int) -> Tensor:
    """``s_i - mean_{j in group(i)} s_j`` (B,): each score minus the mean score of its prompt's group.

    The group-mean baseline of Dr. GRPO's advantage and of REINFORCE++-baseline's scores (Hu 2025,
    "REINFORCE++", the baseline variant subtracts the group mean before the KL shaping and the global
    whitening). Equal scores in a group give 0.
    """
    grouped = _grouped(scores, group_size, "scores")
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def group_advantages(rewards: Tensor, group_size: int, method: str, eps: float = 1e-6) -> Tensor:
    """One advantage per response (B,) from the rewards (B,) of its group of ``G = group_size``.

    With ``mean`` and ``std`` over the group of response ``i`` (``std`` unbiased, ``n - 1``, as
    ``torch.std``):

    - ``"grpo"``: ``A_i = (r_i - mean) / (std + eps)`` (Shao et al. 2024, "DeepSeekMath", GRPO with
      outcome supervision);
    - ``"dr_grpo"``: ``A_i = r_i - mean``, without the std that up-weights easy and hard prompts
      (Liu et al. 2025, "Understanding R1-Zero-like training: a critical perspective");
    - ``"rloo"``: ``A_i = r_i - 1/(G-1) * sum_{j != i} r_j``, the leave-one-out baseline, unbiased
      because it does not depend on ``r_i`` (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline
      for free!"; Ahmadian et al. 2024, "Back to basics: revisiting REINFORCE style optimization").
      Equals ``G/(G-1) * (r_i - mean)``;
    - ``"bon"``: best-of-G distillation, ``w_i = 1/k`` on the ``k`` responses tied for the group's highest
      reward and 0 elsewhere, then ``A_i = (w_i - mean(w)) / (std(w) + eps)`` (one best of G: ``sqrt(G) *
      (1 - 1/G)`` on it, ``-1/sqrt(G)`` on the others). The best of G samples of the current policy is a
      sample of its best-of-G distribution, so the positive part is the gradient of the forward KL to that
      distribution (online RAFT, Dong et al. 2023; BOND's forward term with the anchor at the current
      policy, Sessa et al. 2024); the others carry its zero-mean baseline. Iterated, best-of-G of
      best-of-G is best-of-G^2: the policy climbs the best-of-n curve, KL <= log n - (n-1)/n per step.

    A group of equal rewards gets advantage exactly 0 (never NaN). Spread over a response's tokens with
    :func:`shifu.core.sequence_advantages` (baseline 0).
    """
    grouped = _grouped(rewards, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    if method == "grpo":
        std = grouped.std(dim=1, keepdim=True)  # unbiased; G >= 2 is checked above
        adv = (grouped - mean) / (std + eps)
    elif method == "dr_grpo":
        adv = grouped - mean
    elif method == "rloo":
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        adv = grouped - others
    elif method == "bon":
        best = (grouped == grouped.amax(dim=1, keepdim=True)).to(grouped.dtype)
        w = best / best.sum(dim=1, keepdim=True)
        adv = (w - w.mean(dim=1, keepdim=True)) / (w.std(dim=1, keepdim=True) + eps)
    else:
        raise ValueError(f"unknown group advantage method '{method}'; valid: {', '.join(GROUP_ESTIMATORS)}")
    # a tied group is exactly 0, even where the rounded mean differs from the common value in the last bit
    tied = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(tied, torch.zeros((), dtype=adv.dtype, device=adv.device), adv).reshape(-1)


def dynamic_sampling_mask(rewards: Tensor, group_size: int, atol: float = 0.0) -> tuple[Tensor, Tensor]:
    """DAPO's dynamic sampling filter (Yu et al. 2025, "DAPO", its constraint
    ``0 < |{correct}| < G``): keep the groups whose rewards are not all equal.

    A group with ``max - min <= atol`` (all correct, all wrong, or all tied) has zero group advantage and
    gives no gradient, so it only dilutes the batch. Returns ``(keep, num_dropped)``: ``keep`` (B,) bool,
    True on every row of a kept group (index the rollout with it), and the number of dropped **groups**
    as a 0-dim long tensor. Pass the rewards the advantages will be computed from.
    """
    grouped = _grouped(rewards, group_size)
    spread = grouped.amax(dim=1) - grouped.amin(dim=1)  # (B // G,)
    informative = spread > atol
    keep = informative.repeat_interleave(group_size)
    return keep, (~informative).sum()


def group_step_advantages(
    token_rewards: Tensor,
    step_mask: Tensor,
    response_mask: Tensor,
    group_size: int,
    method: str,
    eps: float = 1e-6,
) -> Tensor:
    """Token advantages (B, R) from per-token rewards with a group baseline over **steps**: GRPO with
    process supervision (Shao et al. 2024, "DeepSeekMath", sec. 4.1.3), and its Dr. GRPO form.

    A step of response ``i`` ends on each real token where ``step_mask`` is True.

    1. Each real token's reward accrues to the step that holds it (the first step end at or after the
       token): step ``k`` earns ``r_{i,k}``, the sum of its tokens' rewards. Rewards on tokens after a row's
       last step end belong to no step and are dropped (end a step on the last token to keep them).
    2. ``mean`` and ``std`` (unbiased, as ``torch.std``) of the rewards of *every* step of the ``G``
       responses to the prompt: ``"grpo"``: ``r~ = (r - mean) / (std + eps)``; ``"dr_grpo"``: ``r~ = r - mean``.
    3. ``A_{i,t} = sum_{k: end_{i,k} >= t} r~_{i,k}``: the normalised rewards of the steps from token t on.
       0 on padding and after a row's last step.

    With one step per response, on its last token, this is :func:`group_advantages` on every token (up to
    rounding). A group whose step rewards are all equal (one step included) gets exactly 0, never NaN.
    ``rloo`` and ``bon`` compare one number per response and have no step form: ``ValueError``.
    """
    if token_rewards.dim() != 2 or not token_rewards.shape == step_mask.shape == response_mask.shape:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, step_mask {tuple(step_mask.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must all be (B, R)"
        )
    if method not in ("grpo", "dr_grpo"):
        raise ValueError(
            f"group step advantages: method '{method}' has no per-step form; valid: grpo, dr_grpo (rloo and "
            "bon compare one number per response)"
        )
    mask = response_mask.bool()
    _grouped(mask[:, 0], group_size, "token_rewards")  # the layout checks, on its (B,) rows
    steps = step_mask.bool() & mask
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    rewards = torch.where(mask, token_rewards, zero)
    # 1. step k of a row holds the tokens after its (k-1)-th end up to its k-th; id = ends strictly before t
    step_id = steps.long().cumsum(1) - steps.long()
    per_step = torch.zeros(mask.shape[0], mask.shape[1] + 1, dtype=rewards.dtype, device=rewards.device)
    per_step = per_step.scatter_add(1, step_id, rewards)
    at_end = torch.where(steps, per_step.gather(1, step_id), zero)  # r_{i,k} on step k's last token
    # 2. the group's statistics over its steps: (B // G, G * R) with the step ends marked
    r, s = at_end.view(-1, group_size * mask.shape[1]), steps.view(-1, group_size * mask.shape[1])
    n = s.sum(1, keepdim=True).to(r.dtype)
    mean = r.sum(1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(s, r - mean, zero)
    if method == "grpo":
        std = ((centred**2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
    tied = torch.where(s, r, -inf).amax(1, keepdim=True) <= torch.where(s, r, inf).amin(1, keepdim=True)
    normalised = torch.where(tied, zero, centred).view(mask.shape)
    # 3. reward-to-go over the steps (gamma = 1); only step ends carry a value, so padding sums nothing
    to_go = normalised.flip(1).cumsum(1).flip(1)
    return torch.where(mask, to_go, zero)

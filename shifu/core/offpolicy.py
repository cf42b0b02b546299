"""The sampler's log-probs versus the trainer's: truncated importance sampling, decoupled PPO's weights under
staleness with SAO's double-sided mask, and their statistics.

A fast inference engine (other kernels, other precision, a stale weight copy) samples from ``pi_rollout``,
a slightly different distribution than the trainer's ``pi_old`` computed from the same weights, so PPO's
"on-policy" batch is off-policy. Yao et al. 2025 ("Your efficient RL framework secretly brings you
off-policy RL training") correct the gradient with a truncated importance weight per token,
``w_t = min(pi_old(y_t) / pi_rollout(y_t), C)``. Inputs (B, R): ``old_log_probs`` from the trainer's
forward at the start of the update, ``rollout_log_probs`` returned by the engine for the same tokens.

An asynchronous run (``max_staleness > 0``) samples with an older policy than the one it trains: the same
correction, with the behaviour policy's recorded log-probs in place of the engine's
(:func:`decoupled_is_weights`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kl import kl_estimate
from .masked import masked_mean


def _check(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs {tuple(rollout_log_probs.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must have one shape (B, R)"
        )
    return response_mask.bool()


def truncated_is_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, cap: float = 2.0
) -> Tensor:
    """Truncated importance weights (B, R): ``min(exp(log pi_old - log pi_rollout), cap)`` on real tokens,
    0 on padding, no gradient (Yao et al. 2025, truncated importance sampling; Ionides 2008 for the
    truncation's bias-variance trade).

    Apply them to the advantages before the update (``advantages * w``): every policy loss here is
    ``w``-homogeneous per token for ``w >= 0`` (``min(r A w, clip(r) A w) = w min(r A, clip(r) A)``), so
    this weighs each token's loss by ``w`` as the paper's corrected gradient does.
    """
    if not cap > 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap}")
    mask = _check(old_log_probs, rollout_log_probs, response_mask)
    zero = torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device)
    log_w = torch.where(mask, old_log_probs - rollout_log_probs, zero).detach()
    return torch.where(mask, torch.exp(log_w).clamp(max=cap), zero)


def rollout_mismatch(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, cap: float | None = None
) -> dict[str, Tensor]:
    """How far the rollout engine's distribution is from the trainer's, over real tokens (0-dim, detached).

    With ``d_t = log pi_old(y_t) - log pi_rollout(y_t)`` at tokens sampled by the engine:
    ``abs_log_ratio`` mean ``|d_t|``, ``max_abs_log_ratio`` max ``|d_t|``, ``k3`` the k3 estimate of
    KL(pi_rollout || pi_old) per token (``e^{d} - 1 - d``, Schulman 2020). With ``cap``, also
    ``is_weight_mean`` (mean of :func:`truncated_is_weights`) and ``is_truncfrac`` (fraction of tokens
    whose weight was capped). An empty mask gives 0 everywhere.
    """
    mask = _check(old_log_probs, rollout_log_probs, response_mask)
    with torch.no_grad():
        zero = torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device)
        old = torch.where(mask, old_log_probs, zero)
        rollout = torch.where(mask, rollout_log_probs, zero)
        diff = (old - rollout).abs()
        stats = {
            "abs_log_ratio": masked_mean(diff, mask),
            "max_abs_log_ratio": diff.amax() if diff.numel() else zero,
            "k3": masked_mean(kl_estimate(rollout, old, "k3"), mask),  # KL(pi_rollout || pi_old)
        }
        if cap is not None:
            weights = truncated_is_weights(old_log_probs, rollout_log_probs, response_mask, cap)
            stats["is_weight_mean"] = masked_mean(weights, mask)
            stats["is_truncfrac"] = masked_mean((torch.exp(old - rollout) > cap).to(old.dtype), mask)
    return stats


def decoupled_is_weights(
    prox_log_probs: Tensor,
    behav_log_probs: Tensor,
    response_mask: Tensor,
    cap: float | None = None,
    band: tuple[float, float] | None = None,
) -> Tensor:
    """Decoupled PPO's importance weights (B, R) for a batch sampled by an older (behaviour) policy, no gradient.

    Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025) splits PPO's ``pi_old`` in two: the behaviour
    policy ``pi_behav`` that sampled the tokens (its log-probs recorded by the sampler) and the proximal policy
    ``pi_prox`` the clip is taken around (the trainer's forward at the start of the update). Per token::

        L_t = -(pi_prox / pi_behav) * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),  r_t = pi / pi_prox

    so the weight returned is ``w_t = exp(log pi_prox - log pi_behav)``, applied through the advantages as
    :func:`truncated_is_weights`' (every policy loss here is homogeneous in ``A`` per token for ``w >= 0``).
    ``cap``: ``min(w_t, cap)`` (truncated; equal to :func:`truncated_is_weights` when ``band`` is None).
    ``band=(low, high)``: the double-sided mask of single-rollout asynchronous optimisation (SAO): a token whose
    ratio ``pi_prox / pi_behav`` (before any cap) falls outside ``[low, high]`` gets weight 0, i.e. it is dropped
    from the policy loss rather than clipped (it still counts in the token-mean divisor, and the critic still
    learns its value). 0 on padding.
    """
    if band is not None and not 0 <= band[0] <= 1 <= band[1]:
        raise ValueError(f"the mask band (low, high) must have 0 <= low <= 1 <= high, got {band}")
    mask = _check(prox_log_probs, behav_log_probs, response_mask)
    zero = torch.zeros((), dtype=prox_log_probs.dtype, device=prox_log_probs.device)
    if cap is not None:
        weights = truncated_is_weights(prox_log_probs, behav_log_probs, response_mask, cap)
    else:
        log_w = torch.where(mask, prox_log_probs - behav_log_probs, zero).detach()
        weights = torch.where(mask, torch.exp(log_w), zero)
    if band is None:
        return weights
    return torch.where(outside_band(prox_log_probs, behav_log_probs, response_mask, band), zero, weights)


def outside_band(
    prox_log_probs: Tensor, behav_log_probs: Tensor, response_mask: Tensor, band: tuple[float, float]
) -> Tensor:
    """(B, R) bool: the real tokens whose ratio ``pi_prox / pi_behav`` lies outside ``[low, high]`` (the tokens
    :func:`decoupled_is_weights` drops); False on padding."""
    mask = _check(prox_log_probs, behav_log_probs, response_mask)
    zero = torch.zeros((), dtype=prox_log_probs.dtype, device=prox_log_probs.device)
    ratio = torch.exp(torch.where(mask, prox_log_probs - behav_log_probs, zero).detach())
    return mask & ((ratio < band[0]) | (ratio > band[1]))

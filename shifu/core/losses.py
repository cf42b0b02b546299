"""PPO policy / value / penalty losses, REINFORCE, GSPO, the KL-to-reference loss term, and the
Bradley-Terry and DPO preference losses.

Every loss returns ``(loss, stats)``: a 0-dim tensor to minimise and a dict of detached 0-dim tensors.
Per-token losses are masked with ``torch.where``, so masked tokens get exactly zero gradient, and are
aggregated in one of three ways:

- ``"token_mean"`` (default): sum over the real tokens of the batch divided by their count, or by
  ``num_tokens`` when given (the token count of the whole optimiser step across micro-batches and
  ranks, so that summing the micro-batch losses gives the token-mean of the whole step);
- ``"seq_mean"``: mean over each row's real tokens, then mean over the rows that have a real token;
- ``"token_sum_norm"``: sum over the real tokens divided by a constant, ``rows * L_max`` (Dr. GRPO,
  Liu et al. 2025: every token weighs the same whatever its response's length, and the
  constant keeps the scale of the gradient independent of the lengths sampled). The divisor is
  ``num_tokens`` when given (pass ``rows of the whole step * max_new_tokens``: the constant is the
  generation limit, not the longest response), else ``B * R``, the padded width of this tensor.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .kl import exact_kl, kl_estimate
from .masked import masked_mean, masked_sum

AGGREGATIONS = ("token_mean", "seq_mean", "token_sum_norm")


def _check_same(mask: Tensor, **tensors: Tensor) -> Tensor:
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} must equal response_mask shape {tuple(mask.shape)}"
            )
    return mask.bool()


def aggregate(
    per_token: Tensor, mask: Tensor, aggregation: str = "token_mean", num_tokens: float | Tensor | None = None
) -> Tensor:
    """Reduce a per-token loss ``(B, R)`` to a scalar by ``aggregation`` (see the module docstring).

    ``num_tokens`` is the divisor of the sum-based aggregations: the real-token count of the whole step
    for ``token_mean``, ``rows * L_max`` for ``token_sum_norm``; ``seq_mean`` takes none.
    """
    if aggregation == "token_mean":
        if num_tokens is None:
            return masked_mean(per_token, mask)
        return masked_sum(per_token, mask) / num_tokens
    if aggregation == "token_sum_norm":
        return masked_sum(per_token, mask) / (mask.numel() if num_tokens is None else num_tokens)
    if aggregation == "seq_mean":
        if num_tokens is not None:
            raise ValueError("num_tokens only applies to aggregation='token_mean' or 'token_sum_norm'")
        per_row = masked_mean(per_token, mask, dim=-1)  # (B,), 0 for a row without tokens
        rows = mask.any(dim=-1)
        return masked_mean(per_row, rows)
    raise ValueError(f"unknown aggregation '{aggregation}'; valid: {', '.join(AGGREGATIONS)}")


def ppo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    aggregation: str = "token_mean",
    num_tokens: float | Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    beta: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), negated to be minimised. All inputs (B, R);
    the :class:`PolicyLoss` signature (``beta`` unused).

    ``ratio = exp(log_probs - old_log_probs)``; per token
    ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``. With ``dual_clip = c > 1``
    (Ye et al. 2020, "Mastering complex control in MOBA games"), tokens with ``A < 0`` are further
    bounded: ``min(that, -c * A)``. Stats: ``clipfrac`` (fraction of real tokens where the clip is
    active), ``approx_kl`` (k3 estimate of KL(pi_old || pi), mean over real tokens), ``ratio_mean``.
    """
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = _check_same(response_mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    log_ratio = torch.where(mask, log_probs - old_log_probs, zero)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages, zero)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {}
    if dual_clip is not None:
        lower = -dual_clip * adv  # the loss of an A<0 token never exceeds -c*A
        dual_active = (adv < 0) & (per_token > lower)
        per_token = torch.where(adv < 0, torch.minimum(per_token, lower), per_token)
        stats["dual_clipfrac"] = masked_mean(dual_active.to(log_probs.dtype), mask).detach()
    loss = aggregate(per_token, mask, aggregation, num_tokens)
    with torch.no_grad():
        stats["clipfrac"] = masked_mean((clipped > unclipped).to(log_probs.dtype), mask)
        stats["approx_kl"] = masked_mean(kl_estimate(old_log_probs, log_probs, "k3"), mask)
        stats["ratio_mean"] = masked_mean(ratio, mask)
    return loss, stats


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
    *,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ``0.5 * max((V - G)^2, (clip(V, V_old - eps, V_old + eps) - G)^2)``, inputs (B, R).

    ``clip=None`` gives the plain ``0.5 * (V - G)^2``. Stats: ``clipfrac`` (fraction of real tokens where
    the clipped term is the larger one).
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip must be > 0 or None, got {clip}")
    mask = _check_same(response_mask, values=values, old_values=old_values, returns=returns)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    error = torch.where(mask, values - returns, zero)
    unclipped = error.pow(2)
    if clip is None:
        per_token = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        step = torch.where(mask, values - old_values, zero).clamp(-clip, clip)
        clipped = (torch.where(mask, old_values - returns, zero) + step).pow(2)
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask).detach()
    loss = aggregate(per_token, mask, aggregation, num_tokens)
    return loss, {"clipfrac": clipfrac}


def ppo_penalty_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    aggregation: str = "token_mean",
    num_tokens: float | Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    beta: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's KL-penalised objective (Schulman et al. 2017, sec. 4, eq. 8), negated: per token
    ``-(ratio * A - beta * KL(pi_old || pi))``, inputs (B, R); the :class:`PolicyLoss` signature
    (``beta`` required; nothing is clipped).

    The KL is estimated per token at tokens sampled from pi_old with k3 (``(ratio - 1) - log ratio``,
    >= 0). Stats: ``kl`` (mean estimate over real tokens), ``ratio_mean``. Adapt ``beta`` with
    :class:`PenaltyKLController`.
    """
    if beta is None:
        raise ValueError("ppo_penalty_loss needs beta, the KL penalty's coefficient")
    mask = _check_same(response_mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    new = torch.where(mask, log_probs, zero)
    old = torch.where(mask, old_log_probs, zero)
    ratio = torch.exp(new - old)
    kl = kl_estimate(old, new, "k3")  # KL(pi_old || pi) from samples of pi_old
    per_token = -(torch.where(mask, advantages, zero) * ratio - beta * kl)
    loss = aggregate(per_token, mask, aggregation, num_tokens)
    with torch.no_grad():
        stats = {"kl": masked_mean(kl, mask), **_unclipped_stats(log_probs, old_log_probs, mask)}
    return loss, stats


def _unclipped_stats(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """PPO's policy statistics for a loss that clips nothing: ``approx_kl`` (k3 of KL(pi_old || pi)),
    ``clipfrac`` (0), ``ratio_mean``; over real tokens, no gradient."""
    with torch.no_grad():
        return {
            "approx_kl": masked_mean(kl_estimate(old_log_probs, log_probs, "k3"), mask),
            "clipfrac": torch.zeros((), dtype=log_probs.dtype, device=log_probs.device),
            "ratio_mean": masked_mean(torch.exp(log_probs - old_log_probs), mask),
        }


def reinforce_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    aggregation: str = "token_mean",
    num_tokens: float | Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    beta: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE (Williams 1992), the score-function gradient: per token ``-A * log pi(a_t | s_t)``,
    inputs (B, R); the :class:`PolicyLoss` signature (clips nothing, no ``beta``). ``A`` is the
    (baselined) whole-sequence return on every token of its row
    (:func:`shifu.core.sequence_advantages`). On-policy: ``old_log_probs`` only feed the statistics,
    which carry PPO's keys (``approx_kl``, ``clipfrac`` = 0, ``ratio_mean``) so every policy loss logs
    the same metrics."""
    mask = _check_same(response_mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    per_token = -torch.where(mask, advantages, zero) * log_probs
    loss = aggregate(per_token, mask, aggregation, num_tokens)
    return loss, _unclipped_stats(log_probs, old_log_probs, mask)


def gspo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    aggregation: str = "token_mean",
    num_tokens: float | Tensor | None = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    beta: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group sequence policy optimization"): PPO's clip on a sequence-level
    importance ratio, negated to be minimised. All inputs (B, R); the :class:`PolicyLoss` signature
    (``dual_clip`` and ``beta`` unused).

    ``s_i = exp(1/|y_i| * sum_t (log pi(y_t) - log pi_old(y_t)))`` over the real tokens of response ``i``
    (the length-normalised sequence likelihood ratio), clipped as a whole:
    ``-min(s_i A, clip(s_i, 1 - clip_low, 1 + clip_high) A)``. Written per token as the paper's GSPO-token:
    ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, equal to ``s_i`` in value, so a per-token advantage
    is allowed; when ``A`` is constant over a row (group advantages) the gradient is GSPO's
    ``s_i A * 1/|y_i| sum_t grad log pi(y_t)`` and ``aggregation="seq_mean"`` gives GSPO's objective
    exactly (other aggregations weigh the rows differently). The defaults are the paper's clip range (3e-4, 4e-4): the
    ratio of a whole sequence moves far less than a token's. Stats: ``clipfrac`` (fraction of real tokens
    whose sequence is clipped), ``approx_kl`` (k3 of KL(pi_old || pi) per token, as PPO's),
    ``ratio_mean`` (mean of ``s_i`` over the rows that have a real token).
    """
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    mask = _check_same(response_mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    new = torch.where(mask, log_probs, zero)
    seq_log_ratio = masked_mean(new - old_log_probs, mask, dim=-1)  # (B,); 0 for a row without tokens
    # GSPO-token: value s_i on every token, gradient s_i * grad log pi(y_t)
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + new - new.detach()
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages, zero)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation, num_tokens)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(log_probs.dtype), mask),
            "approx_kl": masked_mean(kl_estimate(old_log_probs, log_probs, "k3"), mask),
            "ratio_mean": masked_mean(torch.exp(seq_log_ratio), mask.any(dim=-1)),
        }
    return loss, stats


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    aggregation: str = "token_mean",
    *,
    estimator: str = "k3",
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The KL to the reference as a loss term (GRPO, Shao et al. 2024), inputs (B, R): per token
    ``k3 = pi_ref/pi - log(pi_ref/pi) - 1`` at the sampled tokens, aggregated like the policy loss; the
    caller adds ``kl_coef * loss`` to the policy loss (and leaves the KL out of the rewards).

    The gradient flows through ``log_probs`` (``d k3 / d log pi = 1 - pi_ref/pi``); the tokens are the
    rollout's, so it is an estimate of KL(pi || pi_ref) while pi is still near the rollout policy.
    ``estimator`` is any of :func:`shifu.core.kl_estimate`'s (``k1``, ``k2``, ``k3``). Stats: ``kl``
    (mean estimate over real tokens, nats per token).
    """
    mask = _check_same(response_mask, log_probs=log_probs, ref_log_probs=ref_log_probs)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    kl = kl_estimate(torch.where(mask, log_probs, zero), torch.where(mask, ref_log_probs, zero), estimator)
    loss = aggregate(kl, mask, aggregation, num_tokens)
    return loss, {"kl": masked_mean(kl, mask).detach()}


def exact_kl_loss(
    log_softmax: Tensor,
    ref_log_softmax: Tensor,
    response_mask: Tensor,
    aggregation: str = "token_mean",
    *,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The KL to the reference as a loss term, computed exactly at each position instead of estimated at the
    sampled token (``kl.loss_estimator=full``): per token ``KL(pi(.|s_t) || pi_ref(.|s_t))``
    (:func:`shifu.core.exact_kl`) from the two ``(B, R, V)`` log-softmaxes, aggregated like the policy loss.

    Its gradient is that of KL(pi || pi_ref) at each position over the whole vocabulary, where k3's is that of
    KL(pi_ref || pi) through the sampled token only; like the estimators it treats the rollout's prefixes as
    fixed. Stats: ``kl`` (mean over real tokens, nats per token).
    """
    if log_softmax.dim() != 3 or log_softmax.shape[:2] != response_mask.shape:
        raise ValueError(
            f"log_softmax {tuple(log_softmax.shape)} must be (B, R, V) with (B, R) = response_mask's "
            f"{tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    kl = torch.where(mask, exact_kl(log_softmax, ref_log_softmax), 0.0)
    loss = aggregate(kl, mask, aggregation, num_tokens)
    return loss, {"kl": masked_mean(kl, mask).detach()}


class PolicyLoss(Protocol):
    """The one signature of the policy losses: the four ``(B, R)`` tensors, then keywords only, the same
    for every loss (each reads the ones it uses: ``clip_low``/``clip_high`` ppo and gspo, ``dual_clip`` ppo,
    ``beta`` ppo_penalty). Returns ``(loss, stats)`` with at least ``approx_kl``, ``clipfrac`` and
    ``ratio_mean``."""

    def __call__(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        *,
        aggregation: str = "token_mean",
        num_tokens: float | Tensor | None = None,
        clip_low: float = ...,
        clip_high: float = ...,
        dual_clip: float | None = None,
        beta: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


# The policy losses by name (the PPO trainer's ``algo``), each a PolicyLoss.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": ppo_policy_loss,
    "ppo_penalty": ppo_penalty_loss,
    "reinforce": reinforce_loss,
    "gspo": gspo_policy_loss,
}


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coef: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley-Terry preference loss on scores (N,): ``mean(-log sigmoid(r_c - r_r - margin))``
    ``+ center_coef * mean((r_c + r_r)^2)`` (the centring term keeps scores near 0).

    Stats: ``accuracy`` (fraction with r_c > r_r; ties count as wrong) and ``margin`` (mean r_c - r_r).
    """
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} shapes differ")
    diff = chosen - rejected
    target = diff if margin is None else diff - margin
    loss = -F.logsigmoid(target).mean()
    if center_coef:
        loss = loss + center_coef * (chosen + rejected).pow(2).mean()
    with torch.no_grad():
        stats = {"accuracy": (diff > 0).to(chosen.dtype).mean(), "margin": diff.mean()}
    return loss, stats


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (Rafailov et al. 2023, eq. 7) on summed response log-probs (N,):
    ``mean(-log sigmoid(beta * ((pc - rc) - (pr - rr))))``.

    Stats: implicit rewards ``beta * (log pi - log pi_ref)`` averaged as ``chosen_reward`` and
    ``rejected_reward``, ``margin`` (mean chosen minus rejected reward), ``accuracy`` (chosen > rejected).
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    diff = chosen_reward - rejected_reward
    loss = -F.logsigmoid(diff).mean()
    with torch.no_grad():
        stats = {
            "accuracy": (diff > 0).to(diff.dtype).mean(),
            "margin": diff.mean(),
            "chosen_reward": chosen_reward.mean(),
            "rejected_reward": rejected_reward.mean(),
        }
    return loss, stats

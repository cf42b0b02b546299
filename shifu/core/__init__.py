"""Pure PPO-RLHF math on tensors. Imports torch only; no function calls ``.item()`` or logs.

Exceptions, by design: the KL controllers and ``RunningMoments`` hold Python floats between iterations
(and so read tensors to the host), and input checks that raise ``ValueError`` (too few real elements in
``masked_var``/``masked_whiten``, an empty row in ``shape_rewards``, misplaced steps in
``place_step_rewards``) read a count on the host.

Shapes: ``(B, T)`` whole sequences, ``(B, R)`` response tokens, ``(B,)`` one number per sequence;
``response_mask`` is bool, True on real (non-padding) response tokens, responses right-padded. Group
estimators take ``G`` responses per prompt laid out group-contiguously (row ``i`` is prompt ``i // G``).
Losses return ``(loss, stats)`` with 0-dim tensor stats. docs/concepts/algorithms.md explains each formula
once.
"""

from .advantages import (
    discounted_returns,
    gae,
    place_step_rewards,
    sequence_advantages,
    sequence_returns,
    shape_rewards,
    shape_token_rewards,
)
from .controllers import (
    AdaptiveKLController,
    FixedKLController,
    PenaltyKLController,
    StepKLController,
    build_kl_controller,
)
from .group import dynamic_sampling_mask, group_advantages, group_step_advantages, subtract_group_mean
from .kl import exact_kl, kl_estimate
from .logprobs import (
    entropy_from_logits,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    log_probs_from_hidden,
    log_probs_from_logits,
)
from .losses import (
    POLICY_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    exact_kl_loss,
    gspo_policy_loss,
    kl_loss,
    ppo_penalty_loss,
    ppo_policy_loss,
    ppo_value_loss,
    reinforce_loss,
)
from .masked import last_true, masked_mean, masked_sum, masked_var, masked_whiten
from .offpolicy import decoupled_is_weights, outside_band, rollout_mismatch, truncated_is_weights
from .scores import normalize_scores, penalize_missing_eos
from .stats import RunningMoments, explained_variance, mean_se
from .trust_region import conjugate_gradient

__all__ = [
    "mean_se",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "PenaltyKLController",
    "RunningMoments",
    "StepKLController",
    "bradley_terry_loss",
    "build_kl_controller",
    "conjugate_gradient",
    "discounted_returns",
    "dpo_loss",
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "exact_kl",
    "exact_kl_loss",
    "explained_variance",
    "gae",
    "group_advantages",
    "group_step_advantages",
    "gspo_policy_loss",
    "kl_estimate",
    "kl_loss",
    "log_probs_and_entropy",
    "log_probs_and_entropy_from_hidden",
    "log_probs_from_hidden",
    "log_probs_from_logits",
    "last_true",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_scores",
    "penalize_missing_eos",
    "place_step_rewards",
    "ppo_penalty_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "reinforce_loss",
    "rollout_mismatch",
    "sequence_advantages",
    "sequence_returns",
    "shape_rewards",
    "shape_token_rewards",
    "subtract_group_mean",
    "truncated_is_weights",
    "decoupled_is_weights",
    "outside_band",
]

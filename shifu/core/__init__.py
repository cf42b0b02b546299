"""Pure PPO-RLHF math on tensors. Imports torch only; no function calls ``.item()`` or logs.

Exceptions, by design: the KL controllers and ``RunningMoments`` hold Python floats between iterations
(and so read tensors to the host), and input checks that raise ``ValueError`` (too few real elements in
``masked_var``/``masked_whiten``, an empty row in ``shape_rewards``) read a count on the host.

Shapes: ``(B, T)`` whole sequences, ``(B, R)`` response tokens, ``(B,)`` one number per sequence;
``response_mask`` is bool, True on real (non-padding) response tokens, responses right-padded.
Losses return ``(loss, stats)`` with 0-dim tensor stats. docs/core.md explains each formula once.
"""

from .advantages import gae, shape_rewards
from .controllers import (
    AdaptiveKLController,
    FixedKLController,
    PenaltyKLController,
    StepKLController,
    build_kl_controller,
)
from .kl import kl_estimate
from .logprobs import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from .losses import bradley_terry_loss, dpo_loss, ppo_penalty_loss, ppo_policy_loss, ppo_value_loss
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .stats import RunningMoments, explained_variance

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "PenaltyKLController",
    "RunningMoments",
    "StepKLController",
    "bradley_terry_loss",
    "build_kl_controller",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "kl_estimate",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_penalty_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "shape_rewards",
]

"""Phase 4 of a PPO iteration: the advantages, by the estimator's name (``advantage_estimator``).

Each estimator takes the iteration's :class:`Signals` and returns ``(advantages, returns)`` (B, R); every
formula is a named function of ``shifu.core`` (docs/concepts/algorithms.md has the table of how they compose):

- ``gae``: per-token rewards (``-beta * kl_t``, the score on the last token, process rewards on their
  tokens) -> GAE on the critic's values -> whitened over the global batch (``whiten_advantages``);
- ``reinforce`` (algo=reinforce): the whole-sequence return ``score - beta * sum_t kl_t`` on every token,
  minus the batch mean (``reinforce_baseline``); process rewards count in the sequence's score;
- ``grpo``, ``dr_grpo``, ``rloo``, ``bon``: the group's comparison of ``score - beta * sum_t kl_t`` (just the score
  when the KL is a loss term), on every token of the response. With process rewards ``grpo`` and ``dr_grpo``
  compare *steps* instead (DeepSeekMath's process supervision, ``core.group_step_advantages``): each step
  earns its reward, minus ``beta`` times its tokens' KL, the last step the score too; every step of the
  group is normalised by the group's step statistics and a token's advantage is the sum over the steps
  from it on. ``rloo`` and ``bon`` compare one number per response and refuse process rewards;
- ``reinforce_pp``, ``reinforce_pp_baseline``: the discounted reward-to-go of the per-token rewards,
  whitened over the global batch; the baseline variant first subtracts each group's mean score.

:func:`importance_weighted` then weighs them per token by the sampler-vs-trainer importance weight (``tis_cap``,
``decoupled``, ``is_mask``).

The critic-free estimators ignore ``values`` (no critic is built for them) and return the advantages as
the returns (nothing fits them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from shifu import core
from shifu.config.schema import PPOConfig
from shifu.errors import ShifuError
from shifu.parallel.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Signals:
    """What an estimator reads, this rank's rows (group-contiguous: row i answers prompt i // G)."""

    scores: Tensor  # (B,) processed scores (2. score processing)
    token_rewards: Tensor | None  # (B, R) process rewards on the tokens that end a step, or None
    kl: Tensor  # (B, R) per-token KL estimate to the reference, 0 on padding
    beta: float  # its coefficient in the reward (0 when the KL is a loss term: kl.penalty=loss)
    mask: Tensor  # (B, R) bool, the response tokens that train (a dynamic-sampling drop clears a row)
    values: Tensor  # (B, R) the critic's values (zeros without a critic)
    real: Tensor  # (B, R) bool, every real response token (a dropped row's too: its score has a place)
    steps: Tensor | None = None  # (B, R) bool, the tokens that end a step; set whenever token_rewards is


def totals(scores: Tensor, rollout) -> Tensor:
    """(B,) each response's processed score plus its process rewards (what dynamic sampling compares)."""
    if rollout.token_rewards is None:
        return scores
    return scores + core.masked_sum(rollout.token_rewards, rollout.response_mask, dim=1)


def _token_rewards(x: Signals, scores: Tensor) -> Tensor:
    """Per-token rewards on the rows that train (0 on a row dynamic sampling dropped)."""
    rewards = core.shape_rewards(scores, x.kl, x.real, x.beta) * x.mask
    return rewards if x.token_rewards is None else rewards + x.token_rewards * x.mask


def gae(x: Signals, cfg: PPOConfig, strategy: Strategy) -> tuple[Tensor, Tensor]:
    advantages, returns = core.gae(_token_rewards(x, x.scores), x.values, x.mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = core.masked_whiten(advantages, x.mask, reduce=strategy.all_reduce_sum)
    return advantages, returns


def reinforce(x: Signals, cfg: PPOConfig, strategy: Strategy) -> tuple[Tensor, Tensor]:
    scores = (
        x.scores if x.token_rewards is None else x.scores + core.masked_sum(x.token_rewards, x.mask, dim=1)
    )
    returns = core.sequence_returns(scores, x.kl, x.mask, x.beta)
    baseline = strategy.mean(returns) if cfg.reinforce_baseline else 0.0
    if cfg.reinforce_baseline and cfg.dynamic_sampling:  # the mean return of the rows that train
        kept = x.mask.any(1)
        t = strategy.batch_sums({"sum": (returns * kept).sum(), "n": kept.sum()})
        baseline = torch.tensor(t["sum"] / max(t["n"], 1.0), dtype=returns.dtype)
    advantages = core.sequence_advantages(returns, x.mask, baseline)
    return advantages, advantages


def group(method: str) -> Callable[[Signals, PPOConfig, Strategy], tuple[Tensor, Tensor]]:
    def estimator(x: Signals, cfg: PPOConfig, strategy: Strategy) -> tuple[Tensor, Tensor]:
        if x.token_rewards is not None:
            return steps(x, cfg)
        rewards = core.sequence_returns(x.scores, x.kl, x.mask, x.beta)  # (B,) score - beta * KL
        advantages = core.sequence_advantages(core.group_advantages(rewards, cfg.group_size, method), x.mask)
        return advantages, advantages

    def steps(x: Signals, cfg: PPOConfig) -> tuple[Tensor, Tensor]:
        if method not in ("grpo", "dr_grpo"):
            raise ShifuError(
                f"the rewards are per token (process rewards or reward.dense), but advantage_estimator={method} "
                "compares one number per response: use grpo or dr_grpo (normalised per step), gae, "
                "reinforce_pp or reinforce_pp_baseline"
            )
        # a step ends where the reward says so and on each response's last token, which carries the score
        # and the KL of the tokens after its last step
        last = core.last_true(x.real)
        advantages = core.group_step_advantages(
            _token_rewards(x, x.scores), (x.steps | last) & x.mask, x.mask, cfg.group_size, method
        )
        return advantages, advantages

    estimator.__name__ = method
    return estimator


def reinforce_pp(baseline: bool) -> Callable[[Signals, PPOConfig, Strategy], tuple[Tensor, Tensor]]:
    def estimator(x: Signals, cfg: PPOConfig, strategy: Strategy) -> tuple[Tensor, Tensor]:
        scores = core.subtract_group_mean(x.scores, cfg.group_size) if baseline else x.scores
        returns = core.discounted_returns(_token_rewards(x, scores), x.mask, cfg.gamma)
        if cfg.whiten_advantages:
            return core.masked_whiten(returns, x.mask, reduce=strategy.all_reduce_sum), returns
        return returns, returns

    estimator.__name__ = "reinforce_pp_baseline" if baseline else "reinforce_pp"
    return estimator


ESTIMATORS: dict[str, Callable[[Signals, PPOConfig, Strategy], tuple[Tensor, Tensor]]] = {
    "gae": gae,
    "reinforce": reinforce,
    "grpo": group("grpo"),
    "dr_grpo": group("dr_grpo"),
    "rloo": group("rloo"),
    "bon": group("bon"),
    "reinforce_pp": reinforce_pp(baseline=False),
    "reinforce_pp_baseline": reinforce_pp(baseline=True),
}


def importance_weighted(cfg, rollout, advantages: Tensor, train: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The advantages weighed per token by the sampler-vs-trainer importance weight, and its statistics
    (``rollout/mismatch_*``; with is_mask, ``rollout/is_maskfrac``): ``tis_cap`` alone is truncated IS
    (:func:`shifu.core.truncated_is_weights`), ``decoupled`` / ``is_mask`` decoupled PPO's weight with SAO's
    mask (:func:`shifu.core.decoupled_is_weights`)."""
    old, sampled, mask = rollout.old_log_probs, rollout.rollout_log_probs, rollout.response_mask
    if not cfg.decoupled and cfg.is_mask is None:
        weights = core.truncated_is_weights(old, sampled, train, cfg.tis_cap)
        stats = core.rollout_mismatch(old, sampled, mask, cfg.tis_cap)
        return advantages * weights, {f"rollout/mismatch_{k}": v for k, v in stats.items()}
    band = (1 / cfg.is_mask, cfg.is_mask) if cfg.is_mask is not None else None
    weights = core.decoupled_is_weights(old, sampled, train, cfg.tis_cap, band)
    stats = {f"rollout/mismatch_{k}": v for k, v in core.rollout_mismatch(old, sampled, mask).items()}
    stats["rollout/is_weight_mean"] = core.masked_mean(weights, train)
    if band is not None:
        stats["rollout/is_maskfrac"] = core.masked_mean(
            core.outside_band(old, sampled, train, band).float(), train
        )
    return advantages * weights, stats

"""The one table of metric keys: every key a trainer or the evaluation writes, with a one-line meaning.

``docs/reference/metrics.md`` is generated from :data:`METRICS` (``make docs-reference``, or
``python -m shifu.runs.metrics docs/reference/metrics.md``) and a test checks that the two agree, so the docs
cannot drift from the code. Keys are ``<namespace>/<name>`` in lowercase; "kl" always means against the
frozen reference policy, and KL is in **nats per response** unless the key says ``per_token``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# key -> one-line meaning, grouped by stage (the docs table keeps this order). A key ending in "/*" stands
# for a family whose last part varies (e.g. "sizes/*").
METRICS: dict[str, str] = {
    # stage 1: supervised fine-tuning (shifu sft)
    "sft/loss": "SFT training loss: token-mean negative log-likelihood of response tokens (nats/token), mean over the logging window",
    "sft/lr": "learning rate of the SFT optimiser at this step",
    "eval/sft/loss": "the same SFT loss on the held-out split (step 0: before training)",
    # stage 2: Bradley-Terry reward model (shifu rm)
    "rm/loss": "Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), mean over the logging window",
    "rm/accuracy": "fraction of training pairs with r_chosen > r_rejected, over the logging window",
    "rm/margin": "mean r_chosen - r_rejected over training pairs in the logging window",
    "rm/lr": "learning rate of the reward-model optimiser at this step",
    "rm/skipped_steps": "reward-model optimiser steps skipped so far because the loss or gradients were not finite",
    "eval/rm/accuracy": "fraction of held-out pairs with r_chosen > r_rejected (rm/accuracy rising while this falls: overfitting)",
    "eval/rm/margin": "mean r_chosen - r_rejected over held-out pairs",
    "eval/rm/chosen_mean": "mean score of the chosen responses of the held-out pairs (normalised scale)",
    "eval/rm/rejected_mean": "mean score of the rejected responses of the held-out pairs (normalised scale)",
    "eval/rm/len_corr": "length-bias check: correlation of held-out scores with response length",
    "eval/rm/acc_chosen_shorter": "held-out accuracy on pairs whose chosen response is shorter than the rejected one",
    "eval/rm/acc_chosen_longer": "held-out accuracy on pairs whose chosen response is longer than the rejected one",
    # stage 3: PPO (shifu ppo), one row per iteration
    "objective/score": "mean reward-model score of the rollout's responses, before score processing",
    "objective/score_processed": "mean score after normalisation/clipping/missing-EOS penalty: what enters the reward",
    "objective/kl": "mean KL(policy || reference) of the rollout, summed over response tokens (nats per response)",
    "objective/kl_k3": "k3 estimate of the same KL, summed over response tokens (nats per response, never negative; "
    "the progress bar shows it)",
    "objective/process_reward": "mean sum of the process (step) rewards per response, when the reward gives steps or is dense (reward.dense: then objective/score is 0)",
    "objective/kl_per_token": "KL(policy || reference) averaged over real response tokens (nats per token)",
    "objective/kl_coef": "beta, the KL penalty coefficient used for this rollout (set by the KL controller)",
    "objective/rlhf_reward": "mean of score - beta * KL per response: the shaped return PPO maximises",
    "objective/entropy": "mean entropy of the policy over real response tokens (nats per token)",
    "policy/approx_kl": "k3 estimate of KL(old || new) between the rollout policy and the updated one, mean over minibatches",
    "policy/clipfrac": "fraction of real response tokens where the clipped policy objective was active",
    "policy/ratio_mean": "mean probability ratio pi_theta / pi_old over real response tokens and minibatches",
    "policy/early_stop_epoch": "PPO epoch (1-based) after which approx_kl exceeded 1.5 x its target; 0 if none",
    "policy/penalty_coef": "PPO-penalty variant only: the coefficient of its KL(old || new) term",
    "value/explained_var": "1 - Var(returns - values) / Var(returns) over real tokens; 1 perfect, NaN if returns are constant",
    "value/clipfrac": "fraction of real response tokens where the clipped value loss was the larger one",
    "loss/policy": "policy loss (clipped PPO surrogate, or the variant's), token-mean over the minibatch",
    "loss/value": "critic loss 0.5 * (V - returns)^2 (clipped variant if enabled), token-mean",
    "loss/value_last": "critic_updates > 1: the critic loss of the last of its extra passes over the rollout",
    "loss/entropy": "mean response entropy as it enters the loss term -ent_coef * H",
    "loss/ptx": "PPO-ptx: SFT negative log-likelihood on a batch of demonstrations (logged when ptx_coef > 0)",
    "loss/kl": "kl.penalty=loss: the KL to the reference as a loss term (kl.loss_estimator, nats per token), before beta",
    "rollout/response_len": "mean number of sampled tokens per trajectory (a response's first EOS included; an "
    "episode's observations not)",
    "rollout/eos_frac": "fraction of rollout responses that produced EOS within the token limit",
    "rollout/dropped_nonfinite": "rollout responses dropped because their score was NaN or infinite "
    "(with group_size > 1, every response of their group)",
    "rollout/groups_dropped": "dynamic_sampling: groups whose scores were all equal, left out of the update",
    "rollout/staleness": "max_staleness > 0: policy versions between the batch's sampler and the policy it trains (iteration - 1 - version; async_schedule=bounded: the mean over its trajectories)",
    "rollout/requeued": "async_schedule=bounded: trajectories sent back to be sampled again since the last batch, as too stale for theirs",
    "rollout/is_weight_mean": "decoupled or is_mask: mean importance weight pi_old / pi_behav over response tokens (0 where masked)",
    "rollout/is_maskfrac": "is_mask: fraction of response tokens whose ratio pi_old / pi_behav fell outside [1/c, c], dropped from the policy loss",
    "rollout/mismatch_abs_log_ratio": "tis_cap, decoupled, is_mask, max_staleness > 0 or bf16 decode: mean |log pi_old - log pi_rollout| over response tokens "
    "(trainer forward vs the decode's own log-probs)",
    "rollout/mismatch_max_abs_log_ratio": "tis_cap, decoupled, is_mask, max_staleness > 0 or bf16 decode: largest |log pi_old - log pi_rollout| of the rollout",
    "rollout/mismatch_k3": "tis_cap, decoupled, is_mask, max_staleness > 0 or bf16 decode: k3 estimate of KL(pi_rollout || pi_old) per token",
    "rollout/mismatch_is_weight_mean": "tis_cap: mean truncated importance weight min(pi_old / pi_rollout, cap)",
    "rollout/mismatch_is_truncfrac": "tis_cap: fraction of response tokens whose importance weight was capped",
    "precision/bf16_decode": "bf16=true: 1 when generation reads a bf16 copy of the actor (the GEMM probe measured "
    "it faster; shifu.parallel.precision), else 0",
    "precision/bf16_frozen": "bf16=true: 1 when the reference holds bf16 weights, else 0",
    "precision/bf16_reward": "bf16=true: 1 when the reward model holds bf16 weights (probed at its own shapes), else 0",
    "precision/bf16_update": "bf16=true: 1 when the update's forwards (ppo) or the training steps (sft, rm, dpo: "
    "in summary.json) run under bf16 autocast (fp32 master weights and optimiser state), else 0",
    "time/rollout_s": "seconds spent generating and scoring the rollout",
    "time/generation_s": "seconds of the rollout spent in its source: sampling, and the reward or environment it "
    "calls",
    "time/scoring_s": "seconds of the rollout spent on the trainer's log-probs and values (rollout minus generation)",
    "time/update_s": "seconds spent in the PPO update epochs",
    "perf/tokens_per_s": "tokens processed per second (PPO: rollout + update; SFT: training tokens)",
    "optim/lr": "learning rate of the PPO optimiser after this iteration",
    "optim/skipped_steps": "optimiser steps skipped so far because the loss or gradients were not finite",
    "sizes/*": "derived sizes logged once at step 0 (minibatches per epoch, optimiser steps, ...)",
    "data/prompts_dropped": "prompts dropped at load time (e.g. longer than the prompt limit), logged at step 0",
    "rollout/rows": "responses in the rollout after non-finite scores were dropped",
    # multi-turn episodes with an environment (ppo.env.factory), means over the rollout's episodes
    "env/turns": "env.factory: policy turns per episode (each ends at EOS, a stop string or its token budget)",
    "env/tool_calls": "env.factory: tool calls per episode, as the environment counts them (Step.info['tool_calls'])",
    "env/tool_errors": "env.factory: tool errors per episode (Step.info['tool_errors']: a call that could not be parsed, "
    "named an unknown tool, or raised)",
    "env/tool_use": "env.factory: fraction of episodes with at least one tool call (env/tool_*: only when the "
    "environment reports tool calls in Step.info)",
    "env/observation_tokens": "env.factory: observation tokens per episode (attended to, never trained on or counted as "
    "response tokens)",
    "env/terminated": "env.factory: fraction of episodes the environment ended (Step.done), neither truncated nor "
    "failed",
    "env/truncated": "env.factory: fraction of episodes cut by max_turns or a token budget (counted as responses "
    "without EOS: reward.missing_eos_penalty applies)",
    "env/errors": "env.factory: fraction of episodes ended by an environment fault (on_error=end_episode; reward 0; "
    "a fault before the first turn drops the episode as rollout/dropped_nonfinite)",
    "env/return": "env.factory: episode return, the sum of its turns' rewards",
    "eval/env/*": "env.factory or agent.factory: the env/* metrics (an agent's turns, tool calls, observation "
    "tokens, tool_use, truncated, errors, return) of the held-out episodes of an evaluation (eval/env/return is "
    "gold/score)",
    # episodes of an outside agent on the policy gateway (ppo.agent.factory), means over the rollout's episodes
    "agent/calls": "agent.factory: completion calls per episode (every call the gateway answered)",
    "agent/forks": "agent.factory: calls per episode that extended no earlier call (each starts another trajectory)",
    "agent/fork_rows": "agent.factory: fork trajectories per episode trained as rows of their own (one process, "
    "group_size 1; else 0)",
    "agent/turns": "agent.factory: calls joined into an episode's main trajectory (within max_turns, max_total_tokens)",
    "agent/tool_calls": "agent.factory: calls per episode answered with tool_calls (main trajectory)",
    "agent/tool_use": "agent.factory: fraction of episodes whose main trajectory called a tool",
    "agent/observation_tokens": "agent.factory: ids read between calls per episode (tool results, template headers; "
    "attended to, never trained on)",
    "agent/batched_calls": "agent.factory: completion calls per sampler call of the rollout (concurrent calls of "
    "the episodes merged into one call)",
    "agent/prefix_hit_rate": "agent.factory: fraction of the rollout's completions that reused cached keys and "
    "values of an earlier call's prefix (the gateway's prefix cache)",
    "agent/prefill_tokens": "agent.factory: prompt tokens prefilled per episode (those the prefix cache held were "
    "copied instead)",
    "agent/length_calls": "agent.factory: fraction of calls that ended at their token cap (finish_reason length)",
    "agent/no_calls": "agent.factory: fraction of episodes without a call (nothing to train: dropped as "
    "rollout/dropped_nonfinite)",
    "agent/truncated": "agent.factory: fraction of episodes whose main trajectory was cut by max_turns or "
    "max_total_tokens, whose last call ended at its token cap, or that ended at agent.timeout_s or the context limit",
    "agent/errors": "agent.factory: fraction of episodes ended by an agent fault (on_error=end_episode; reward 0)",
    "agent/timeouts": "agent.factory: fraction of episodes that ran past agent.timeout_s (ended truncated)",
    "agent/side_calls": "agent.factory: calls per episode sent with another system prompt than the agent's "
    "(titles, summaries, classifiers; trained or skipped as agent.side_calls says)",
    "agent/context_exceeded": "agent.factory: fraction of episodes whose last request was refused for the model's "
    "context (context_length_exceeded; ended truncated)",
    "agent/return": "agent.factory: return of an episode's main trajectory (its calls' rewards and the episode's)",
    "sft/skipped_steps": "SFT optimiser steps skipped so far because the loss or gradients were not finite",
    # DPO (shifu dpo)
    "dpo/loss": "DPO loss -log sigmoid(beta*((pi_c - ref_c) - (pi_r - ref_r))), mean over the logging window",
    "dpo/accuracy": "fraction of training pairs whose implicit reward prefers the chosen response",
    "dpo/margin": "mean implicit-reward margin beta*(log-ratio chosen - log-ratio rejected) on training pairs",
    "dpo/chosen_reward": "mean implicit reward beta*(log pi - log pi_ref) of the chosen responses",
    "dpo/rejected_reward": "mean implicit reward beta*(log pi - log pi_ref) of the rejected responses",
    "dpo/lr": "learning rate of the DPO optimiser at this step",
    "dpo/skipped_steps": "DPO optimiser steps skipped so far because the loss or gradients were not finite",
    "perf/pairs_per_s": "preference pairs processed per second (DPO)",
    "eval/dpo/loss": "DPO loss on held-out pairs",
    "eval/dpo/accuracy": "fraction of held-out pairs whose implicit reward prefers the chosen response",
    "eval/dpo/margin": "mean implicit-reward margin on held-out pairs",
    "eval/dpo/chosen_reward": "mean implicit reward of the held-out chosen responses",
    "eval/dpo/rejected_reward": "mean implicit reward of the held-out rejected responses",
    # PPO evaluation rows (step 0 and every eval.every iterations, held-out prompts)
    "eval/score": "mean return on the held-out prompts from the run's source: the reward's score (with its process "
    "steps or dense per-token rewards), or the episode return",
    "eval/kl": "mean KL(policy || reference) on the held-out prompts, summed over response tokens (nats per response)",
    "eval/kl_k3": "k3 estimate of eval/kl (nats per response, never negative)",
    "gold/score": "mean gold-judge score on the held-out prompts (VADER compound / exact match), never the RM; "
    "with env.factory or agent.factory, the mean episode return (the environment's or agent's own count)",
}


def is_defined(key: str) -> bool:
    """Whether ``key`` is in :data:`METRICS`, directly or through a ``prefix/*`` family."""
    return key in METRICS or ("/" in key and key.rsplit("/", 1)[0] + "/*" in METRICS)


def undefined_keys(rows: list[dict]) -> list[str]:
    """Keys of metric rows (e.g. ``shifu.runs.tracking.read_metrics(...)``) that the table does not define."""
    return sorted({k for row in rows for k in row if k != "step" and not is_defined(k)})


def markdown_table(metrics: dict[str, str] = METRICS) -> str:
    """``docs/reference/metrics.md``: a heading, one paragraph, and the key -> meaning table."""
    lines = [
        "# Metrics",
        "",
        "Every key shifu writes to `metrics.jsonl` and TensorBoard, with its meaning. Generated from the",
        "table in `shifu/runs/metrics.py` by `make docs-reference`; a test keeps the two equal. KL is always",
        "against the frozen reference policy and in **nats per response** unless the key says `per_token`.",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    for key, meaning in metrics.items():
        escaped = meaning.replace("|", r"\|")  # a bare | would split the Markdown cell
        lines.append(f"| `{key}` | {escaped} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the docs table to the path given (or print it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv:
        Path(argv[0]).write_text(markdown_table(), encoding="utf-8")
    else:
        sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

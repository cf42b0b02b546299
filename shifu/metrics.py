"""The one table of metric keys: every key a trainer or the evaluation writes, with a one-line meaning.

``docs/metrics.md`` is generated from :data:`METRICS` (``python -m shifu.metrics docs/metrics.md``) and a
test checks that the two agree, so the docs cannot drift from the code. Keys are
``<namespace>/<name>`` in lowercase; "kl" always means against the frozen reference policy, and KL is in
**nats per response** unless the key says ``per_token``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# key -> one-line meaning. Grouped by stage; the docs table keeps this order.
METRICS: dict[str, str] = {
    # stage 1: supervised fine-tuning
    "sft/loss": "SFT training loss: token-mean negative log-likelihood of response tokens (nats/token)",
    "eval/sft/loss": "the same SFT loss on the held-out split",
    # stage 2: Bradley-Terry reward model
    "rm/loss": "Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), mean over training pairs",
    "rm/accuracy": "fraction of training pairs with r_chosen > r_rejected",
    "rm/margin": "mean r_chosen - r_rejected over training pairs",
    "eval/rm/loss": "Bradley-Terry loss on the held-out pairs",
    "eval/rm/accuracy": "fraction of held-out pairs with r_chosen > r_rejected (falls while rm/accuracy rises: overfitting)",
    "eval/rm/margin": "mean r_chosen - r_rejected over held-out pairs",
    "eval/rm/length_corr": "length-bias check: correlation of the held-out score with response length (tokens)",
    "eval/rm/accuracy_chosen_shorter": "held-out accuracy on pairs whose chosen response is shorter than the rejected one",
    "eval/rm/accuracy_chosen_longer": "held-out accuracy on pairs whose chosen response is longer than the rejected one",
    # stage 3: PPO, one row per iteration
    "objective/score": "mean reward-model score of the rollout's responses (after any score processing)",
    "objective/kl": "mean KL(policy || reference) of the rollout, summed over response tokens (nats per response)",
    "objective/kl_per_token": "objective/kl divided by the response length (nats per token)",
    "objective/kl_coef": "beta, the KL penalty coefficient used for this rollout (set by the KL controller)",
    "objective/rlhf_reward": "objective/score - beta * objective/kl: the shaped return PPO maximises",
    "objective/entropy": "mean entropy of the policy over response tokens (nats per token)",
    "policy/approx_kl": "approximate KL(old || new) between the rollout policy and the updated policy, mean over minibatches",
    "policy/clipfrac": "fraction of response tokens whose ratio was clipped in the policy loss",
    "policy/ratio_mean": "mean probability ratio pi_theta / pi_old over response tokens and minibatches",
    "value/explained_var": "1 - Var(returns - values) / Var(returns): how much of the return the critic explains",
    "value/clipfrac": "fraction of response tokens where the clipped value loss was the larger one",
    "loss/policy": "clipped PPO surrogate loss, token-mean over response tokens",
    "loss/value": "critic loss 0.5 * (V - returns)^2 (clipped variant if enabled), token-mean",
    "loss/entropy": "entropy bonus as it enters the loss: -c2 * mean response entropy (0 when c2 = 0)",
    "loss/ptx": "PPO-ptx term: SFT negative log-likelihood on pretraining/SFT data (0 when off)",
    "rollout/response_len": "mean number of real response tokens per rollout response (first EOS included)",
    "rollout/eos_frac": "fraction of rollout responses that ended with EOS within the token limit",
    "time/rollout_s": "seconds spent generating and scoring the rollout",
    "time/update_s": "seconds spent in the PPO update epochs",
    "perf/tokens_per_s": "tokens processed per second of the iteration (SFT: training tokens per second)",
    # PPO evaluation rows (every N iterations, held-out prompts, greedy or eval sampling)
    "eval/score": "mean reward-model score on the held-out prompts",
    "eval/kl": "mean KL(policy || reference) on the held-out prompts (nats per response)",
    "gold/score": "mean gold-judge score on the held-out prompts (VADER compound / exact match), never the RM",
}


def markdown_table(metrics: dict[str, str] = METRICS) -> str:
    """``docs/metrics.md``: a heading, one paragraph, and the key -> meaning table."""
    lines = [
        "# Metrics",
        "",
        "Every key shifu writes to `metrics.jsonl` and TensorBoard. Generated from `shifu/metrics.py`",
        "(`python -m shifu.metrics docs/metrics.md`); a test keeps the two equal. KL is always against the",
        "frozen reference policy and in **nats per response** unless the key says `per_token`.",
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

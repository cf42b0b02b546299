"""``shifu demo bandit``: PPO-clip with a KL penalty on a ten-armed bandit, built on ``shifu.core``.

The policy is a softmax over 10 logits (one "token" per episode), the reference is uniform, and the
reward peaks at one arm. Each epoch runs the same steps as the real trainer, on a response of length 1:
sample actions, record old and reference log-probs, shape the reward with ``-beta * kl``, whiten it into
advantages, and take a few Adam steps on the clipped PPO loss (autograd). The KL-regularised objective
``E[r] - beta * KL(pi || pi_ref)`` is maximised by ``pi*(a) ∝ pi_ref(a) exp(mu_a / beta)``; the demo
prints that optimum so the run can be compared with it.
"""

from __future__ import annotations

import argparse
import math

import torch

from shifu.core import (
    kl_estimate,
    log_probs_from_logits,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    shape_rewards,
)

NUM_ARMS = 10
BEST_ARM = 7


def arm_means() -> torch.Tensor:
    """Mean reward of each arm, (10,): 1 at arm 7, falling off as a Gaussian bump of width 2 around it."""
    arms = torch.arange(NUM_ARMS, dtype=torch.float64)
    return torch.exp(-(((arms - BEST_ARM) / 2.0) ** 2))


def kl_to_uniform(probs: torch.Tensor) -> float:
    """Exact KL(pi || uniform) in nats: sum_a pi(a) log(K pi(a))."""
    return float((probs * (probs * NUM_ARMS).clamp_min(1e-30).log()).sum())


def regularised_optimum(kl_coef: float) -> torch.Tensor:
    """pi* ∝ pi_ref exp(mu / beta), the maximiser of E[mu] - beta * KL(pi || pi_ref) (uniform pi_ref)."""
    if kl_coef <= 0:
        return torch.nn.functional.one_hot(torch.tensor(BEST_ARM), NUM_ARMS).double()
    return torch.softmax(arm_means() / kl_coef, dim=0)


def run_bandit(
    epochs: int = 60,
    seed: int = 0,
    kl_coef: float = 0.1,
    batch_size: int = 64,
    ppo_steps: int = 4,
    lr: float = 0.05,
    noise: float = 0.3,
    print_fn=print,
) -> list[dict[str, float]]:
    """Train the bandit policy; returns one dict per epoch (``epoch``, ``kl``, ``p_best``, ``reward``, ...)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    means = arm_means().float()
    logits = torch.zeros(NUM_ARMS, requires_grad=True)  # starts equal to the uniform reference
    optimizer = torch.optim.Adam([logits], lr=lr)
    mask = torch.ones(batch_size, 1, dtype=torch.bool)  # every "response" is one real token
    ref_log_probs = torch.full((batch_size, 1), -math.log(NUM_ARMS))
    optimum = regularised_optimum(kl_coef)
    print_fn(
        f"ten-armed bandit: best arm {BEST_ARM}, beta {kl_coef}, batch {batch_size}; "
        f"KL-regularised optimum: kl {kl_to_uniform(optimum):.3f}  p(best) {optimum[BEST_ARM]:.3f}"
    )
    history = []
    for epoch in range(1, epochs + 1):
        # 1. rollout: sample one action per episode from the current policy
        with torch.no_grad():
            actions = torch.multinomial(torch.softmax(logits, 0), batch_size, replacement=True, generator=gen)
            tokens = actions.unsqueeze(1)  # (B, 1)
            old_log_probs = log_probs_from_logits(logits.expand(batch_size, 1, NUM_ARMS), tokens)
            scores = means[actions] + noise * torch.randn(batch_size, generator=gen)
            # 2. per-token rewards: -beta * kl (k1 against the uniform reference), score on the last token
            kl = kl_estimate(old_log_probs, ref_log_probs, "k1")
            rewards = shape_rewards(scores, kl, mask, kl_coef)
            # 3. advantages: one step and V = 0, so A = reward; whitening subtracts the batch mean (baseline)
            advantages = masked_whiten(rewards, mask)
        # 4. PPO-clip updates on this batch
        for _ in range(ppo_steps):
            log_probs = log_probs_from_logits(logits.expand(batch_size, 1, NUM_ARMS), tokens)
            loss, stats = ppo_policy_loss(log_probs, old_log_probs, advantages, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            probs = torch.softmax(logits, 0).double()
            row = {
                "epoch": epoch,
                "kl": kl_to_uniform(probs),
                "kl_estimate": float(masked_mean(kl, mask)),
                "p_best": float(probs[BEST_ARM]),
                "reward": float(scores.mean()),
                "clipfrac": float(stats["clipfrac"]),
            }
        history.append(row)
        print_fn(
            f"epoch {epoch:3d}  kl {row['kl']:.3f}  p(best) {row['p_best']:.3f}  "
            f"reward {row['reward']:.3f}  clipfrac {row['clipfrac']:.2f}"
        )
    return history


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shifu demo", description="toy demos built on shifu.core")
    sub = parser.add_subparsers(dest="demo", required=True)
    p = sub.add_parser("bandit", help="PPO-clip + KL to a uniform reference on a ten-armed bandit")
    p.add_argument("--epochs", type=int, default=60, help="rollout/update epochs (default 60)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--kl-coef", type=float, default=0.1, help="beta of the KL penalty (default 0.1; 0 disables)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="episodes per epoch (default 64)")
    p.add_argument("--ppo-steps", type=int, default=4, help="PPO updates per epoch (default 4)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate (default 0.05)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "ppo_steps"):
        if getattr(args, name) < 1 + (name == "batch_size"):
            parser.error(f"--{name.replace('_', '-')} is too small")
    if args.kl_coef < 0 or args.lr <= 0:
        parser.error("--kl-coef must be >= 0 and --lr > 0")
    run_bandit(args.epochs, args.seed, args.kl_coef, args.batch_size, args.ppo_steps, args.lr)
    return 0

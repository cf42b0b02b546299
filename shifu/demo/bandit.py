"""``shifu demo bandit``: PPO-clip, PPO-penalty and TRPO on a ten-armed bandit, built on ``shifu.core``.

The policy is a softmax over 10 logits (one "token" per episode), the reference is uniform, and the
reward peaks at one arm. Each epoch runs the same steps as the real trainer, on a response of length 1:
sample actions, record old and reference log-probs, shape the reward with ``-beta * kl``, whiten it into
advantages, then update the policy by one of three methods:

- ``ppo``: a few Adam steps on the clipped loss (Schulman et al. 2017, eq. 7); the clip bounds the ratio
  on the sampled actions, not the KL, so there is no KL budget;
- ``ppo_penalty``: a few Adam steps on ``ratio * A - beta_pen * KL(pi_old || pi)`` with the PPO paper's
  adaptive ``beta_pen`` (sec. 4: halve / double around the target ``d_targ`` = the KL budget);
- ``trpo``: one natural-gradient step (Schulman et al. 2015): ``F x = g`` by conjugate gradient with
  Fisher-vector products by autograd, scaled to the trust region ``KL(pi_old || pi) = delta``, then a
  backtracking line search that accepts a step only if the KL is within ``delta`` and the surrogate
  improved (no step otherwise). ``delta`` = the KL budget.

The KL-regularised objective ``E[r] - beta * KL(pi || pi_ref)`` is maximised by
``pi*(a) ∝ pi_ref(a) exp(mu_a / beta)``; the demo prints that optimum so the runs can be compared with it,
and, per method, the exact ``KL(pi_old || pi_new)`` of each update against the budget.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

from shifu.core import (
    PenaltyKLController,
    conjugate_gradient,
    kl_estimate,
    log_probs_from_logits,
    masked_mean,
    masked_whiten,
    ppo_penalty_loss,
    ppo_policy_loss,
    shape_rewards,
)

NUM_ARMS = 10
BEST_ARM = 7
METHODS = ("ppo", "ppo_penalty", "trpo")


def arm_means() -> torch.Tensor:
    """Mean reward of each arm, (10,): 1 at arm 7, falling off as a Gaussian bump of width 2 around it."""
    arms = torch.arange(NUM_ARMS, dtype=torch.float64)
    return torch.exp(-(((arms - BEST_ARM) / 2.0) ** 2))


def kl_to_uniform(probs: torch.Tensor) -> float:
    """Exact KL(pi || uniform) in nats: sum_a pi(a) log(K pi(a))."""
    return float((probs * (probs * NUM_ARMS).clamp_min(1e-30).log()).sum())


def categorical_kl(old_probs: torch.Tensor, new_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi_old || pi_new) = sum_a p_old(a) (log p_old(a) - log softmax(new_logits)(a)), 0-dim,
    differentiable in ``new_logits`` (TRPO's constraint: one state, so the mean KL over states is this)."""
    return (old_probs * (old_probs.clamp_min(1e-30).log() - torch.log_softmax(new_logits, 0))).sum()


def regularised_optimum(kl_coef: float) -> torch.Tensor:
    """pi* ∝ pi_ref exp(mu / beta), the maximiser of E[mu] - beta * KL(pi || pi_ref) (uniform pi_ref)."""
    if kl_coef <= 0:
        return torch.nn.functional.one_hot(torch.tensor(BEST_ARM), NUM_ARMS).double()
    return torch.softmax(arm_means() / kl_coef, dim=0)


def trpo_step(
    logits: torch.Tensor,
    surrogate: Callable[[torch.Tensor], torch.Tensor],
    delta: float,
    cg_iters: int = 10,
    damping: float = 1e-3,
    backtracks: int = 10,
) -> tuple[torch.Tensor, float]:
    """One TRPO update of ``logits`` (10,) -> ``(new logits, accepted step fraction)`` (0: no step).

    Schulman et al. 2015, sec. 6 and appendix C: ``g = grad L``; ``x = F^-1 g`` by
    :func:`shifu.core.conjugate_gradient`, ``F v`` the Hessian-vector product of ``KL(pi_old || pi)`` at
    ``pi_old`` (double backward, plus ``damping * v``); the full step ``sqrt(2 delta / x^T F x) x`` reaches
    the trust region's border in the quadratic model; halve it until ``KL <= delta`` and ``L`` improved.
    """
    theta = logits.detach().requires_grad_(True)
    old_probs = torch.softmax(theta, 0).detach()
    surr_old = surrogate(theta)
    (g,) = torch.autograd.grad(surr_old, theta)
    (kl_grad,) = torch.autograd.grad(categorical_kl(old_probs, theta), theta, create_graph=True)

    def fisher_vector_product(v: torch.Tensor) -> torch.Tensor:
        (fv,) = torch.autograd.grad(kl_grad @ v, theta, retain_graph=True)
        return fv + damping * v

    x = conjugate_gradient(fisher_vector_product, g, cg_iters)
    full_step = torch.sqrt(2 * delta / (x @ fisher_vector_product(x)).clamp_min(1e-12)) * x
    with torch.no_grad():
        for k in range(backtracks):
            frac = 0.5**k
            candidate = theta + frac * full_step
            if categorical_kl(old_probs, candidate) <= delta and surrogate(candidate) > surr_old:
                return candidate.detach(), frac
    return logits.detach(), 0.0


def update_policy(
    method: str,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    penalty: PenaltyKLController,
    ppo_steps: int,
    kl_budget: float,
) -> dict[str, float]:
    """Update ``logits`` (10,) in place on one batch (``tokens``, ``old_log_probs``, ``advantages``, (B, 1))
    by ``method``; returns what to print: PPO's ``clipfrac``, PPO-penalty's ``beta_pen``, TRPO's ``step``."""
    batch_size = tokens.shape[0]
    mask = torch.ones(batch_size, 1, dtype=torch.bool)

    def log_probs_of(theta: torch.Tensor) -> torch.Tensor:
        return log_probs_from_logits(theta.expand(batch_size, 1, NUM_ARMS), tokens)

    if method == "trpo":
        # TRPO's surrogate mean(ratio * A) is PPO-penalty's objective with beta_pen = 0
        def surrogate(theta: torch.Tensor) -> torch.Tensor:
            return -ppo_penalty_loss(log_probs_of(theta), old_log_probs, advantages, mask, beta=0.0)[0]

        new_logits, step = trpo_step(logits, surrogate, kl_budget)
        with torch.no_grad():
            logits.copy_(new_logits)
        return {"step": step}
    for _ in range(ppo_steps):
        if method == "ppo":
            loss, stats = ppo_policy_loss(log_probs_of(logits), old_log_probs, advantages, mask)
        else:
            loss, stats = ppo_penalty_loss(
                log_probs_of(logits), old_log_probs, advantages, mask, beta=penalty.value
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if method == "ppo":
        return {"clipfrac": float(stats["clipfrac"])}
    beta_pen = penalty.value
    # d = KL(pi_old || pi) measured on the batch (k3), as the paper's controller sees it
    with torch.no_grad():
        measured = masked_mean(kl_estimate(old_log_probs, log_probs_of(logits), "k3"), mask)
    penalty.update(float(measured), 1)
    return {"beta_pen": beta_pen}


def run_bandit(
    epochs: int = 60,
    seed: int = 0,
    kl_coef: float = 0.1,
    batch_size: int = 64,
    ppo_steps: int = 4,
    lr: float = 0.05,
    noise: float = 0.3,
    print_fn=print,
    method: str = "ppo",
    kl_budget: float = 0.01,
) -> list[dict[str, float]]:
    """Train the bandit policy with ``method`` (``ppo``, ``ppo_penalty``, ``trpo``); returns one dict per
    epoch (``epoch``, ``kl`` to the reference, ``p_best``, ``reward``, ``update_kl`` = exact
    KL(pi_old || pi_new) of the epoch's update, ...). ``kl_budget``: TRPO's delta, PPO-penalty's target."""
    if method not in METHODS:
        raise ValueError(f"unknown bandit method '{method}'; valid: {', '.join(METHODS)}")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    means = arm_means().float()
    logits = torch.zeros(NUM_ARMS, requires_grad=True)  # starts equal to the uniform reference
    optimizer = torch.optim.Adam([logits], lr=lr)
    penalty = PenaltyKLController(init=1.0, target=kl_budget)  # PPO paper sec. 4: beta_pen, d_targ
    mask = torch.ones(batch_size, 1, dtype=torch.bool)  # every "response" is one real token
    ref_log_probs = torch.full((batch_size, 1), -math.log(NUM_ARMS))
    history = []
    for epoch in range(1, epochs + 1):
        # 1. rollout: sample one action per episode from the current policy
        with torch.no_grad():
            old_probs = torch.softmax(logits, 0)
            actions = torch.multinomial(old_probs, batch_size, replacement=True, generator=gen)
            tokens = actions.unsqueeze(1)  # (B, 1)
            old_log_probs = log_probs_from_logits(logits.expand(batch_size, 1, NUM_ARMS), tokens)
            scores = means[actions] + noise * torch.randn(batch_size, generator=gen)
            # 2. per-token rewards: -beta * kl (k1 against the uniform reference), score on the last token
            kl = kl_estimate(old_log_probs, ref_log_probs, "k1")
            rewards = shape_rewards(scores, kl, mask, kl_coef)
            # 3. advantages: one step and V = 0, so A = reward; whitening subtracts the batch mean (baseline)
            advantages = masked_whiten(rewards, mask)

        # 4. the update
        extra = update_policy(
            method, logits, tokens, old_log_probs, advantages, optimizer, penalty, ppo_steps, kl_budget
        )
        with torch.no_grad():
            probs = torch.softmax(logits, 0).double()
            row = {
                "epoch": epoch,
                "kl": kl_to_uniform(probs),
                "kl_estimate": float(masked_mean(kl, mask)),
                "p_best": float(probs[BEST_ARM]),
                "reward": float(scores.mean()),
                "update_kl": float(categorical_kl(old_probs.double(), logits.double())),
                **extra,
            }
        history.append(row)
        extras = "  ".join(f"{k} {v:.3g}" for k, v in extra.items())
        print_fn(
            f"{method:<12}epoch {epoch:3d}  kl {row['kl']:.3f}  p(best) {row['p_best']:.3f}  "
            f"reward {row['reward']:.3f}  update_kl {row['update_kl']:.4f}  {extras}"
        )
    return history


BUDGET_ROLE = {
    "ppo": "none: the clip bounds the ratio on the sampled actions",
    "ppo_penalty": "the adaptive penalty's target d_targ",
    "trpo": "a hard limit, delta",
}


def print_budget_summary(runs: dict[str, list[dict[str, float]]], kl_budget: float, print_fn=print) -> None:
    """Per method: mean and max exact KL(pi_old || pi_new) per update, the updates over the budget, and
    the final p(best) and KL to the reference."""
    print_fn(f"\nper-update KL(pi_old || pi_new) in nats, budget {kl_budget:g}:")
    print_fn(f"{'method':<12}{'mean':>8}{'max':>8}{'over':>8}{'p(best)':>9}{'kl':>7}  budget")
    for method, rows in runs.items():
        kls = [r["update_kl"] for r in rows]
        over = sum(k > kl_budget for k in kls)
        print_fn(
            f"{method:<12}{sum(kls) / len(kls):8.4f}{max(kls):8.4f}{f'{over}/{len(kls)}':>8}"
            f"{rows[-1]['p_best']:9.3f}{rows[-1]['kl']:7.3f}  {BUDGET_ROLE[method]}"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shifu demo", description="toy demos built on shifu.core")
    sub = parser.add_subparsers(dest="demo", required=True)
    p = sub.add_parser("bandit", help="PPO-clip, PPO-penalty, TRPO + KL to a uniform reference, ten arms")
    p.add_argument(
        "--method", choices=(*METHODS, "all"), default="all", help="policy update (default all, in turn)"
    )
    p.add_argument("--epochs", type=int, default=60, help="rollout/update epochs (default 60)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--kl-coef", type=float, default=0.1, help="beta of the KL penalty (default 0.1; 0 disables)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="episodes per epoch (default 64)")
    p.add_argument("--ppo-steps", type=int, default=4, help="PPO updates per epoch (default 4)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate of PPO (default 0.05)")
    p.add_argument(
        "--kl-budget",
        type=float,
        default=0.01,
        help="KL(pi_old || pi_new) per update: TRPO's delta, PPO-penalty's target (default 0.01)",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "ppo_steps"):
        if getattr(args, name) < 1 + (name == "batch_size"):
            parser.error(f"--{name.replace('_', '-')} is too small")
    if args.kl_coef < 0 or args.lr <= 0 or args.kl_budget <= 0:
        parser.error("--kl-coef must be >= 0, --lr and --kl-budget > 0")
    optimum = regularised_optimum(args.kl_coef)
    print(
        f"ten-armed bandit: best arm {BEST_ARM}, beta {args.kl_coef}, batch {args.batch_size}; "
        f"KL-regularised optimum: kl {kl_to_uniform(optimum):.3f}  p(best) {optimum[BEST_ARM]:.3f}"
    )
    methods = METHODS if args.method == "all" else (args.method,)
    runs = {
        m: run_bandit(
            args.epochs,
            args.seed,
            args.kl_coef,
            args.batch_size,
            args.ppo_steps,
            args.lr,
            method=m,
            kl_budget=args.kl_budget,
        )
        for m in methods
    }
    print_budget_summary(runs, args.kl_budget)
    return 0

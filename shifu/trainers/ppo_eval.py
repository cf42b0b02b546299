"""``shifu ppo``'s watch-keep-roll back (spec, stage 3 step 7): held-out evaluation (its samples, the best
iteration kept in ``best/``), the reward-hacking guard, and the actor / critic written as plain directories
(``best/``, ``final/``, ``critic/``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from shifu.config.schema import PPOConfig
from shifu.core import kl_estimate, masked_sum
from shifu.envs.base import Environment
from shifu.generation.episodes import run_episodes
from shifu.generation.rollout import SamplingParams, policy_forward, sample
from shifu.models import lora as L
from shifu.models.loading import load_causal_lm
from shifu.models.padding import pad_left
from shifu.models.scalar import ScalarModel
from shifu.runs import files, jsonfile
from shifu.trainers.common import save_policy
from shifu.trainers.ppo_models import PPOModels


@torch.no_grad()
def evaluate(
    models: PPOModels, ids: list[list[int]], rows: list[dict], gold_fn, cfg: PPOConfig
) -> tuple[dict, list]:
    """Held-out prompts, a low-temperature sample each: reward-model score, KL to the reference, gold score.

    ``eval/kl`` is the k1 estimate (nats per response) between the actor and the reference, both with
    logits divided by the evaluation temperature, on the evaluation samples; ``eval/kl_k3`` the k3
    estimate of the same KL (never negative). A private generator makes
    evaluation leave the training RNG untouched. Each rank evaluates the prompts ``rank::W`` (padded with
    repeats to the same count: every rank runs the same forwards); the results are gathered back into the
    prompts' order, so every rank returns the same metrics.
    """
    tok, T, strategy = models.tokenizer, cfg.eval.temperature, models.strategy
    gen = torch.Generator().manual_seed(strategy.rank_seed(cfg.seed + 4242))
    if isinstance(models.reward, Environment):
        return evaluate_episodes(models, rows, cfg, gen)
    params = SamplingParams(cfg.generation.max_new_tokens, T, cfg.generation.top_k, cfg.generation.top_p)
    models.actor.eval()
    n_all, W = len(ids), strategy.world
    mine = list(range(strategy.rank, n_all, W))
    n_mine = len(mine)
    mine += [mine[-1] if mine else 0] * (-(-n_all // W) - n_mine)
    actor = models.actor_module
    reuse = models.reuses_decode_log_probs(cfg, bf16_autocast=False)  # evaluation runs without autocast
    responses, scores, kls, kls3 = [], [], [], []
    for i in range(0, len(mine), cfg.micro_batch_size):
        part = mine[i : i + cfg.micro_batch_size]
        b = pad_left([ids[j] for j in part], tok.pad_token_id)
        pids, pmask = b["input_ids"].to(strategy.device), b["attention_mask"].to(strategy.device)
        out = sample(
            actor,
            pids,
            pmask,
            params,
            tok.eos_token_id,
            tok.pad_token_id,
            generator=gen,
            with_log_probs=reuse,
            **strategy.generation_kwargs(),
        )
        rids, rmask = out.response_ids, out.response_mask
        full, am = torch.cat([pids, rids], 1), torch.cat([pmask, rmask.long()], 1)
        P = pids.shape[1]
        lp = out.log_probs if out.log_probs is not None else policy_forward(actor, full, am, P, T)[0]
        with models.reference() as ref:
            ref_lp = policy_forward(ref, full, am, P, T)[0]
        kls.append(((lp - ref_lp) * rmask).sum(1).float().cpu())
        kls3.append(masked_sum(kl_estimate(lp, ref_lp, "k3"), rmask, dim=1).float().cpu())
        texts = [tok.decode(rids[j][rmask[j]], skip_special_tokens=True) for j in range(len(rids))]
        part_rows = [rows[j] for j in part]
        scores.append(models.reward([r["prompt"] for r in part_rows], texts, part_rows, full, am).float())
        responses += texts
    # back to the prompts' order 0..n-1 on every rank (rank r held r, r+W, ...)
    parts = strategy.gather(
        (
            responses[:n_mine],
            torch.cat(scores)[:n_mine].cpu(),
            torch.cat(kls)[:n_mine],
            mine[:n_mine],
            torch.cat(kls3)[:n_mine],
        )
    )
    order = [i for p in parts for i in p[3]]
    where = sorted(range(n_all), key=lambda j: order[j])
    responses = [r for p in parts for r in p[0]]
    responses = [responses[j] for j in where]
    scores_t = torch.cat([p[1] for p in parts])[where]
    kl_t = torch.cat([p[2] for p in parts])[where]
    kl3_t = torch.cat([p[4] for p in parts])[where]
    metrics = {
        "eval/score": float(scores_t[torch.isfinite(scores_t)].mean()),
        "eval/kl": float(kl_t.mean()),
        "eval/kl_k3": float(kl3_t.mean()),
    }
    golds = [None] * len(rows)
    if gold_fn is not None:
        golds = [float(g) for g in gold_fn([r["prompt"] for r in rows], responses, rows)]
        metrics["gold/score"] = sum(golds) / len(golds)
    samples = [
        {"prompt": r["prompt"], "response": y, "score": float(s), "gold": g}
        for r, y, s, g in zip(rows, responses, scores_t.tolist(), golds)
    ]
    return metrics, samples


@torch.no_grad()
def evaluate_episodes(
    models: PPOModels, rows: list[dict], cfg: PPOConfig, gen: torch.Generator
) -> tuple[dict, list]:
    """:func:`evaluate` with an environment: one episode per held-out row at the evaluation temperature. The
    gold (``gold/score``, also ``eval/score``) is the mean episode return, the environment's own count;
    ``eval/kl`` and ``eval/kl_k3`` sum over the sampled tokens; ``eval/env/*`` as the rollout's ``env/*``.
    Samples hold each transcript after the first input, the policy's turns marked (``episodes.MARKS``)."""
    tok, T, dev, env = models.tokenizer, cfg.eval.temperature, models.strategy.device, models.reward
    params = SamplingParams(cfg.env.max_tokens_per_turn, T, cfg.generation.top_k, cfg.generation.top_p)
    models.actor.eval()
    actor, sums, samples = models.actor_module, {}, []
    for i in range(0, len(rows), cfg.micro_batch_size):
        part = rows[i : i + cfg.micro_batch_size]
        eps = run_episodes(
            actor, tok, env, part, params, gen, cfg.data.chat_template, cfg.data.max_prompt_len
        )
        mask, P = eps.sample.response_mask.to(dev), eps.prompt_ids.shape[1]
        full = torch.cat([eps.prompt_ids, eps.sample.response_ids], 1).to(dev)
        am = torch.cat([eps.prompt_mask, eps.attention.long()], 1).to(dev)
        lp = policy_forward(actor, full, am, P, T)[0]
        with models.reference() as ref:
            ref_lp = policy_forward(ref, full, am, P, T)[0]
        kl = {
            "eval/kl": masked_sum(lp - ref_lp, mask, dim=1).mean(),
            "eval/kl_k3": masked_sum(kl_estimate(lp, ref_lp, "k3"), mask, dim=1).mean(),
        }
        for k, v in (eps.metrics("eval/env/") | {k: float(v) for k, v in kl.items()}).items():
            sums[k] = sums.get(k, 0.0) + v * len(part)
        samples += [
            {"prompt": r["prompt"], "response": t, "score": g, "gold": g, "turns": n, "truncated": c}
            for r, t, g, n, c in zip(
                part, eps.transcripts(), eps.returns.tolist(), eps.counts["turns"], eps.truncated.tolist()
            )
        ]
    metrics = {k: v / len(rows) for k, v in sums.items()}
    gold = metrics["eval/env/return"]
    return metrics | {"eval/score": gold, "gold/score": gold}, samples


def evaluate_and_keep(
    models: PPOModels, cfg: PPOConfig, prompts: tuple, gold_fn, loop: dict[str, Any], out: Path, it: int
) -> dict[str, float]:
    """:func:`evaluate` at iteration ``it`` on the held-out ``prompts`` (``(ids, rows)``): its samples appended
    to ``samples.jsonl`` (rank 0), the actor kept in ``best/`` when ``eval.best_metric`` is the best so far,
    the metrics added to ``loop["evals"]``; returns the metrics."""
    metrics, samples = evaluate(models, *prompts, gold_fn, cfg)
    if models.strategy.is_main:
        with open(out / "samples.jsonl", "a", encoding="utf-8") as f:
            f.writelines(jsonfile.dumps({"iteration": it, **x}) + "\n" for x in samples)
    value = metrics.get(cfg.eval.best_key())  # the same value on every rank (global evaluation)
    if value is not None and (loop["best"] is None or value > loop["best"]):
        loop["best"], loop["best_iteration"] = value, it
        save_actor(models, cfg, out / "best")
    loop["evals"].append({"iteration": it, **metrics})
    return metrics


def guard(cfg: PPOConfig, metrics: dict[str, float], evals: list[dict[str, Any]]) -> str | None:
    """Reward-hacking guard: a KL ceiling, or gold falling while the training score rises N evaluations."""
    g = cfg.guard
    if g.kl_ceiling is not None and metrics["objective/kl"] > g.kl_ceiling:
        return f"objective/kl {metrics['objective/kl']:.2f} nats > guard.kl_ceiling {g.kl_ceiling}"
    evals = [e for e in evals if "gold/score" in e]
    if g.divergence_patience > 0 and "gold/score" in metrics and len(evals) > g.divergence_patience:
        recent = evals[-(g.divergence_patience + 1) :]
        pairs = list(zip(recent, recent[1:]))
        if all(b["gold/score"] < a["gold/score"] and b["eval/score"] > a["eval/score"] for a, b in pairs):
            return (
                f"gold/score fell while eval/score rose for {g.divergence_patience} evaluations "
                f"(gold {recent[0]['gold/score']:.3f} -> {recent[-1]['gold/score']:.3f})"
            )
    return None


def restore_best(models: PPOModels, cfg: PPOConfig, best_dir: Path, reason: str, best_iteration) -> None:
    """The guard stopped the run: the actor goes back to ``best/`` (kept at the best evaluation)."""
    main = models.strategy.is_main
    if not best_dir.exists():
        if main:
            print(f"shifu ppo: guard stopped the run: {reason} (no best/ to restore)", file=sys.stderr)
        return
    if main:
        print(
            f"shifu ppo: guard stopped the run: {reason}; restoring best/ (iteration {best_iteration}) as "
            "final/",
            file=sys.stderr,
        )
    best = load_causal_lm(best_dir, dropout=False)
    if cfg.lora.enabled:
        if main:
            print(
                "warning: shifu ppo: a LoRA actor cannot be restored from the merged best/; final/ is the "
                "last actor",
                file=sys.stderr,
            )
        return
    models.strategy.load_full_state_dict(models.actor, best.state_dict())


def save_actor(models: PPOModels, cfg: PPOConfig, path: Path) -> None:
    """The actor as an HF directory (call on every rank; rank 0 writes). LoRA: the adapters merged into a
    plain copy; sharded weights: gathered into a CPU copy built from ``model.path``."""

    def fresh():
        return load_causal_lm(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code, dropout=False)

    save_policy(models.strategy, models.actor, fresh, models.tokenizer, path)


def save_critic(models: PPOModels, cfg: PPOConfig, path: Path) -> None:
    """The critic as a ScalarModel directory (call on every rank; see :func:`save_actor`)."""
    strategy = models.strategy
    trust = cfg.model.trust_remote_code

    def fresh():
        return ScalarModel.from_backbone(
            cfg.critic.path or cfg.model.path, seed=cfg.seed, trust_remote_code=trust
        )

    plain = strategy.full_model(models.critic, fresh)
    if strategy.is_main:  # a LoRA critic: its adapters merged into a plain copy (a ScalarModel directory)
        files.save_scalar_dir(L.merged_copy(plain) if L.is_lora_critic(plain) else plain, path)
    strategy.barrier()

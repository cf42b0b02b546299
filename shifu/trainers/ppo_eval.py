"""``shifu ppo``'s watch-keep-roll back (spec, stage 3 step 7): held-out evaluation (its samples, the best
iteration kept in ``best/``), the reward-hacking guard, the actor / critic written as plain directories
(``best/``, ``final/``, ``critic/``), and the final paired evaluation of the run's start and its final policy."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from shifu.config.schema import PPOConfig
from shifu.evaluation.compare import judge_scores, paired_summary, sample_records
from shifu.evaluation.evaluate import Evaluated, prompt_batches
from shifu.evaluation.evaluate import evaluate as rollout_evaluate
from shifu.generation.rollout import SamplingParams
from shifu.models import lora as L
from shifu.models.loading import load_causal_lm
from shifu.models.scalar import ScalarModel
from shifu.rollout.batch import PromptBatch
from shifu.runs import files, jsonfile
from shifu.runs.tracking import progress
from shifu.trainers.common import save_policy
from shifu.trainers.ppo_models import PPOModels


@torch.no_grad()
def evaluate(
    models: PPOModels, ids: list[list[int]], rows: list[dict], gold_fn, cfg: PPOConfig, it: int = 0
) -> tuple[dict, list]:
    """Held-out prompts through the run's rollout source (:func:`evaluated`), sampled from the actor at the
    evaluation temperature: ``eval/score`` (the mean return: the reward's score, or an episode's return),
    the KL to the reference, the gold score; an environment's counts as ``eval/env/*``. A progress bar over
    the prompts of iteration ``it`` (rank 0, ``progress=true``), cleared when done.

    ``eval/kl`` is the k1 estimate (nats per trajectory, over its sampled tokens) between the actor and the
    reference, both with logits divided by the evaluation temperature; ``eval/kl_k3`` the k3 estimate of the
    same KL (never negative). The gold is ``gold_fn`` on the responses, or without one (an environment) the
    return. A private generator makes evaluation leave the training RNG untouched.
    """
    models.actor.eval()
    reuse = models.reuses_decode_log_probs(cfg, bf16_autocast=False)  # evaluation runs without autocast
    bar = eval_bar(models, cfg, len(rows), f"evaluation (iteration {it})", leave=False)
    done = evaluated(
        models, ids, rows, cfg, models.actor_module, cfg.seed + 4242, models.reference, reuse, bar
    )
    bar.close()
    metrics = {
        "eval/score": done.mean_return(),
        "eval/kl": float(torch.tensor(done.kl).mean()),
        "eval/kl_k3": float(torch.tensor(done.kl_k3).mean()),
    } | done.metrics("eval/")  # what the source counts (an environment's turns, tool calls, ...)
    golds = judged(models, done, gold_fn)
    if golds is not None:
        metrics["gold/score"] = sum(golds) / len(golds) if gold_fn is not None else metrics["eval/score"]
    return metrics, done.records(golds)


def judged(models: PPOModels, done: Evaluated, gold_fn) -> list[float] | None:
    """Each trajectory's gold: ``gold_fn`` on the responses, or the return where it is the task's own
    measure (an environment's count); None without either."""
    if gold_fn is not None:
        return judge_scores(gold_fn, done)
    return done.returns if models.source.gold else None


def eval_bar(models: PPOModels, cfg: PPOConfig, n: int, desc: str, leave: bool = True):
    """A progress bar over ``n`` held-out prompts of every rank (shown by rank 0 with ``progress=true``)."""
    return progress(n, desc, enabled=models.strategy.is_main and cfg.progress, leave=leave)


def evaluated(
    models: PPOModels,
    ids: list[list[int]],
    rows: list[dict],
    cfg: PPOConfig,
    model: torch.nn.Module,
    seed: int,
    reference=None,
    with_log_probs: bool = False,
    bar=None,
) -> Evaluated:
    """The held-out prompts ``(ids, rows)`` through the run's rollout source
    (:func:`shifu.evaluation.evaluate.evaluate`), sampled from ``model`` at ``eval.temperature`` with a private
    generator seeded from ``seed`` (each rank its own), with the KL to ``reference`` when given. Each rank
    samples the prompts ``rank::W`` (padded with repeats to the same count: every rank runs the same
    forwards); the results are gathered back into the prompts' order, so every rank returns the same.
    ``bar`` (a progress bar over every rank's prompts) advances by each batch of this rank's, times W."""
    tok, g, strategy = models.tokenizer, cfg.generation, models.strategy
    gen = torch.Generator().manual_seed(strategy.rank_seed(seed))
    params = SamplingParams(g.max_new_tokens, cfg.eval.temperature, g.top_k, g.top_p)
    n_all, W = len(rows), strategy.world
    mine = list(range(strategy.rank, n_all, W))
    n_mine = len(mine)
    mine += [mine[-1] if mine else 0] * (-(-n_all // W) - n_mine)
    policy = models.policy(model, with_log_probs=with_log_probs)
    dev = strategy.device
    batches = (
        PromptBatch(b.prompt_ids.to(dev), b.prompt_mask.to(dev), b.rows)
        for b in prompt_batches(tok, [rows[j] for j in mine], [ids[j] for j in mine], cfg.micro_batch_size)
    )
    step = None if bar is None else lambda k: bar.update(min(k * W, bar.total - bar.n))
    done = rollout_evaluate(policy, models.source, batches, params, gen, reference, step)
    # back to the prompts' order 0..n-1 on every rank (rank r held r, r+W, ...)
    parts = strategy.gather((done.select(list(range(n_mine))), mine[:n_mine]))
    order = [i for p in parts for i in p[1]]
    done = Evaluated()
    for p in parts:
        done.extend(p[0])
    return done.select(sorted(range(n_all), key=lambda j: order[j]))


def evaluate_and_keep(
    models: PPOModels, cfg: PPOConfig, prompts: tuple, gold_fn, loop: dict[str, Any], out: Path, it: int
) -> dict[str, float]:
    """:func:`evaluate` at iteration ``it`` on the held-out ``prompts`` (``(ids, rows)``): its samples appended
    to ``samples.jsonl`` (rank 0), the actor kept in ``best/`` when ``eval.best_metric`` is the best so far,
    the metrics added to ``loop["evals"]``; returns the metrics."""
    metrics, samples = evaluate(models, *prompts, gold_fn, cfg, it)
    if models.strategy.is_main:
        with open(out / "samples.jsonl", "a", encoding="utf-8") as f:
            f.writelines(jsonfile.dumps({"iteration": it, **x}) + "\n" for x in samples)
    value = metrics.get(cfg.eval.best_key())  # the same value on every rank (global evaluation)
    if value is not None and (loop["best"] is None or value > loop["best"]):
        loop["best"], loop["best_iteration"] = value, it
        save_actor(models, cfg, out / "best")
    loop["evals"].append({"iteration": it, **metrics})
    return metrics


@torch.no_grad()
def final_evaluation(models: PPOModels, cfg: PPOConfig, prompts: tuple, gold_fn, out: Path) -> dict[str, Any]:
    """The paired held-out evaluation at the end of a run with a gold judge (``eval.gold_function``, or the
    source's own: an environment's or an agent's episode return): the run's start
    (:func:`run_start`) and the actor sampled on the held-out ``prompts`` (``(ids, rows)``, the first
    ``eval.final_prompts``) with one seed at ``eval.temperature``, the actor with its KL to the reference;
    gold before/after and the paired gain with standard errors, as the quickstart reports them
    (:func:`shifu.evaluation.compare.paired_summary`), ``samples_before/after.jsonl`` in ``out`` (rank 0). One
    progress bar over both passes. Empty without prompts (``eval.final_prompts=0``, or no judge)."""
    ids, rows = prompts
    if not rows:
        return {}
    models.actor.eval()
    seed, T = cfg.seed + 777, cfg.eval.temperature  # one sampling seed for both policies: a paired gain
    bar = eval_bar(models, cfg, 2 * len(rows), "final evaluation")
    bar.set_postfix_str(f"start (model.path), T={T:g}", refresh=True)
    with run_start(models, cfg) as start:
        before = evaluated(models, ids, rows, cfg, start, seed, bar=bar)
    bar.set_postfix_str(f"final policy, T={T:g}", refresh=True)
    reuse = models.reuses_decode_log_probs(cfg, bf16_autocast=False)
    after = evaluated(models, ids, rows, cfg, models.actor_module, seed, models.reference, reuse, bar)
    bar.close()
    gold_before, gold_after = judged(models, before, gold_fn), judged(models, after, gold_fn)
    if models.strategy.is_main:
        jsonfile.write_jsonl(out / "samples_before.jsonl", sample_records(before, gold_before))
        jsonfile.write_jsonl(out / "samples_after.jsonl", sample_records(after, gold_after))
    judge = cfg.eval.gold_function or models.source.description.judge
    return paired_summary(before, after, gold_before, gold_after, T) | {"gold_judge": judge}


@contextlib.contextmanager
def run_start(models: PPOModels, cfg: PPOConfig):
    """The policy the run started from (``model.path``), for sampling: the reference as the run holds it (the
    LoRA actor with its adapters disabled; a bf16 copy where ``bf16=true`` chose one), or with another
    reference (``model.ref_path``) ``model.path`` loaded on this device."""
    if not cfg.model.ref_path:
        with models.reference() as ref:
            yield ref
        return
    trust = cfg.model.trust_remote_code
    yield load_causal_lm(cfg.model.path, trust_remote_code=trust, dropout=False).to(models.strategy.device)


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

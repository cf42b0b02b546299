"""Stage 3, ``shifu ppo``: PPO with four models — actor, critic, frozen reference, frozen reward model.

One iteration in :func:`iteration`: 1. rollout -> 2. score processing -> 3. reward shaping -> 4. advantages ->
5. ``ppo_epochs`` x minibatches of :func:`minibatch_loss` -> 6. KL controller; :func:`train` loads and
:func:`iterate` loops, and after each iteration 7. (:func:`after_iteration`) evaluates, logs, guards, saves.
Formulas are in ``shifu.core``, parallel steps in ``shifu.parallel.strategy``.

Run directory: ``metrics.jsonl``, ``trained.jsonl`` (what each iteration trained), ``tb/``, ``samples.jsonl``
(evaluation samples), ``checkpoints/`` (resume), ``best/`` (best ``eval.best_metric``), ``final/`` (HF dir),
``critic/``, ``config.yaml``, ``summary.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any

import torch

from shifu import core
from shifu.config.imports import load_callable, typed_key
from shifu.config.loader import with_values
from shifu.config.schema import PPOConfig, check_world_size
from shifu.data.batches import PromptStream
from shifu.generation.rollout import check_positions
from shifu.parallel import build_strategy
from shifu.rewards.remote import RewardServiceUnavailable
from shifu.rollout.batch import PromptBatch
from shifu.runs import checkpoint as ckpt
from shifu.runs.tracking import progress
from shifu.trainers import common, ppo_eval, ppo_run
from shifu.trainers.common import (
    GracefulStop,
    announce_stop,
    check_resume_config,
    prepare_run,
    seed_everything,
)
from shifu.trainers.ppo_advantages import ESTIMATORS, Signals, importance_weighted, totals
from shifu.trainers.ppo_async import Sampled, record_trained
from shifu.trainers.ppo_bounded_producer import producer_for
from shifu.trainers.ppo_load import load_prompts, ptx_stream
from shifu.trainers.ppo_models import PPOModels, PPOState, build
from shifu.trainers.ppo_rollout import Rollout, sample_batch, sampling_params, score_rollout
from shifu.trainers.ppo_update import update

Config = PPOConfig
# keys a resumed run may change: they do not alter what the finished iterations computed
SAFE_RESUME_KEYS = {
    "iterations",
    "save_every",
    "keep_last",
    "eval.every",
    "eval.num_prompts",
    "eval.final_prompts",
    "guard.kl_ceiling",
    "guard.divergence_patience",
    "max_nonfinite_steps",
    "progress",
    "tensorboard",
    "distributed.timeout_s",
    "trackers",
    "reward.url",
    "reward.timeout_s",
    "reward.retries",
    "traces.episodes",
    "traces.atif",
}


def iteration(
    m: PPOModels, s: PPOState, cfg: PPOConfig, batch: PromptBatch, params, ptx=None, warmup=False, it=None
) -> dict[str, float]:
    """One PPO iteration (number ``it``) on a batch of prompts (this rank's share), sampled by the actor's
    current weights, then :func:`train_batch`. Returns the iteration's metrics."""
    made, t_gen = sample_batch(m, cfg, batch, params, s.sample_gen)
    return train_batch(m, s, cfg, Sampled(it or 1, (it or 1) - 1, None, made, t_gen), ptx, warmup, it)[0]


def train_batch(m: PPOModels, s: PPOState, cfg: PPOConfig, sampled: Sampled, ptx=None, warmup=False, it=None):
    """Iteration ``it`` on a sampled batch (:mod:`shifu.trainers.ppo_async`): the rest of 1., then 2-6 in
    :func:`learn`. Returns the iteration's metrics and the rows it trained (positions in ``sampled.made``)."""
    # 1. rollout: the sampled trajectories' old / reference log-probs, values and scores without gradients
    rollout, info = score_rollout(m, cfg, sampled.made, sampled.t_gen, it, list(range(len(sampled.made))))
    metrics = info | learn(m, s, cfg, rollout, ptx, warmup)
    seconds = info["time/rollout_s"] + metrics.get("time/update_s", 0.0)
    return metrics | {
        "time/scoring_s": info["time/rollout_s"] - info["time/generation_s"],
        "perf/tokens_per_s": int(rollout.response_mask.sum()) / max(1e-9, seconds),
        "rollout/dropped_nonfinite": m.strategy.batch_sums({"n": info["rollout/dropped_nonfinite"]})["n"],
    }, rollout.prompt_ids


def learn(
    m: PPOModels, s: PPOState, cfg: PPOConfig, rollout: Rollout, ptx=None, warmup=False
) -> dict[str, float]:
    """Phases 2-6 of an iteration on a rollout (this rank's rows); returns their metrics. ``warmup``: a
    critic warm-up iteration (only the critic trains)."""
    strategy, t0, extra = m.strategy, time.perf_counter(), {}
    n_rows = strategy.batch_sums({"rows": len(rollout)})["rows"]  # over every rank
    if n_rows == 0:  # every score was NaN/Inf: no update, controllers untouched
        nan = float("nan")
        return {
            "objective/score": nan,
            "objective/kl": nan,
            "objective/kl_k3": nan,
            "objective/kl_coef": s.kl_ctl.value,
            "optim/skipped_steps": s.skipped.total,
        }
    r, mask = cfg.reward, rollout.response_mask
    # 2. score processing (each optional): missing-EOS penalty, running normalisation, clipping
    raw = core.penalize_missing_eos(
        rollout.scores, rollout.eos_found, r.missing_eos_penalty, r.missing_eos_mode
    )
    if r.normalize:  # running statistics over the scores of every rank
        s.score_moments.update(torch.cat(strategy.gather(raw.cpu())))
    scores = core.normalize_scores(raw, s.score_moments if r.normalize else None, r.clip)
    # 3. the KL to the reference (nats per token): -beta * kl_t in the per-token reward, or (kl.penalty=loss)
    # a k3 loss term in 5.; the k1 and k3 sums per response are logged either way
    beta = s.kl_ctl.value
    kl = core.kl_estimate(rollout.old_log_probs, rollout.ref_log_probs, cfg.kl.estimator) * mask
    kl1 = core.kl_estimate(rollout.old_log_probs, rollout.ref_log_probs, "k1") * mask
    kl_seq = core.masked_sum(kl1, mask, dim=1)  # (B,) nats per response
    kl3_seq = core.masked_sum(
        core.kl_estimate(rollout.old_log_probs, rollout.ref_log_probs, "k3"), mask, dim=1
    )
    # 4. advantages by name (ppo_advantages.ESTIMATORS): GAE on the critic's values, or critic-free. DAPO's
    # dynamic sampling first takes the groups whose scores are all equal out of the update
    train = mask
    if cfg.dynamic_sampling:
        keep, n_dropped = core.dynamic_sampling_mask(totals(scores, rollout), cfg.group_size)
        train = mask & keep.unsqueeze(1)
        extra["rollout/groups_dropped"] = strategy.batch_sums({"n": n_dropped})["n"]
    signals = Signals(
        scores,
        rollout.token_rewards,
        kl,
        beta if cfg.kl.penalty == "reward" else 0.0,
        train,
        rollout.values,
        mask,
        rollout.step_mask,
    )
    learns = extra.get("rollout/groups_dropped", 0) < n_rows / cfg.group_size  # some group kept (every rank)
    nothing = (torch.zeros_like(kl), torch.zeros_like(kl))  # every group dropped: no advantage to estimate
    advantages, returns = ESTIMATORS[cfg.estimator](signals, cfg, strategy) if learns else nothing
    if cfg.tis_cap is not None or cfg.decoupled or cfg.is_mask is not None:  # the sampler's log-probs vs old
        advantages, stats = importance_weighted(cfg, rollout, advantages, train)
        extra |= strategy.mean_over_ranks(stats)
    rollout = dataclasses.replace(rollout, advantages=advantages, returns=returns, response_mask=train)
    metrics = strategy.batch_means(
        {
            "objective/score": (raw, None),
            "objective/score_processed": (scores, None),
            "objective/kl": (kl_seq, None),
            "objective/kl_k3": (kl3_seq, None),
            "objective/kl_per_token": (kl1, mask),
            "objective/rlhf_reward": (scores - beta * kl_seq, None),
            "objective/entropy": (rollout.entropy, mask),
            "rollout/response_len": (mask.sum(1).float(), None),
            "rollout/eos_frac": (rollout.eos_found.float(), None),
        }
    )
    metrics |= extra | {"objective/kl_coef": beta, "rollout/rows": n_rows}
    if rollout.token_rewards is not None:
        metrics |= strategy.batch_means({"objective/process_reward": (rollout.token_rewards.sum(1), None)})
    # 5. epochs x minibatches of the clipped policy loss (or the variant's), value loss, entropy, ptx; in the
    # critic warm-up only the value loss. Nothing when dynamic sampling dropped every group.
    if learns:
        metrics |= update(m, s, cfg, rollout, ptx, actor=not warmup)
        for _ in range(cfg.critic_updates - 1 if not warmup else 0):  # SAO: K critic passes per actor update
            metrics["loss/value_last"] = update(m, s, cfg, rollout, ptx, actor=False)["loss/value"]
    if warmup:  # the actor has not moved: the controllers wait for it
        return metrics | {"time/update_s": time.perf_counter() - t0}
    if s.penalty_ctl is not None:  # PPO paper sec. 4: beta of KL(pi_old || pi) from the measured approx_kl
        s.penalty_ctl.update(metrics["policy/approx_kl"], n_rows)
        metrics["policy/penalty_coef"] = s.penalty_ctl.value
    # 6. KL controller: beta from the measured KL to the reference (nats per response, every rank's mean)
    s.kl_ctl.update(metrics["objective/kl"], n_rows)
    return metrics | {"time/update_s": time.perf_counter() - t0}


def train(cfg: PPOConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run PPO as ``cfg`` says; returns the summary (also written to ``summary.json``)."""
    cfg = common.policy_config(cfg)  # a run directory: its final/; a reward model: refused
    strategy = build_strategy(cfg.distributed)
    seed_everything(cfg.seed)  # the shared seed on every rank (init, data order); sampling uses rank_seed
    strategy.launch(cfg.device)
    check_world_size(cfg, strategy.world)
    # 0. load and validate every input before the output directory is touched
    tok, ids, rows, dropped, held_out, final_prompts = load_prompts(cfg)
    gold_fn = (
        load_callable(cfg.eval.gold_function, typed_key("eval.gold_function"))
        if cfg.eval.gold_function
        else None
    )
    m = build(cfg, tok, strategy)
    cfg = with_values(cfg, m.used)  # what ran (a critic.init fallback): config.yaml and checkpoints say so
    longest = max(map(len, ids + held_out[0] + final_prompts[0]))
    check_positions(m.actor_module, longest, cfg.max_response_tokens)
    ptx = ptx_stream(cfg, tok)
    G = cfg.group_size  # each prompt's G responses are sampled, scored and kept together on one rank
    s, stream = PPOState.new(cfg, strategy), PromptStream(len(ids), cfg.batch_size // G, cfg.seed)
    loop: dict[str, Any] = {"iteration": 0, "best": None, "best_iteration": None, "evals": []}
    # the output directory, once every input is loaded (a failed start leaves nothing behind)
    out = prepare_run(cfg, strategy, resume, overwrite, ("iterations", cfg.iterations))
    if G > 1 and strategy.is_main:  # batch_size counts responses: a group method sees G times fewer prompts
        print(
            f"shifu ppo: {cfg.batch_size // G} prompts x {G} responses per iteration "
            f"(batch_size {cfg.batch_size} counts responses)",
            file=sys.stderr,
        )
    latest = ckpt.latest_checkpoint(out) if resume else None
    if latest is not None:
        check_resume_config(ckpt.read_state(latest)["config"], cfg, SAFE_RESUME_KEYS, out)
        data, loop = ppo_run.restore(latest, m, s, ptx)
        stream = PromptStream(len(ids), cfg.batch_size // G, cfg.seed, **data["prompts"])
    tracker = ppo_run.open_tracker(cfg, out, strategy, resume, latest, loop["iteration"], dropped)
    run = ppo_run.Run(m, s, cfg, out, stream, ptx, loop, tracker, held_out, gold_fn, final_prompts)
    run.producer = producer_for(run, ids, rows, sampling_params(cfg), data if latest else {})  # the batches
    with contextlib.closing(run.producer):  # an asynchronous run's sampler thread stopped, on any error too
        return iterate(run)


def iterate(run: ppo_run.Run) -> dict[str, Any]:
    """``run``'s iterations from ``run.loop["iteration"]`` on, each on the batch its producer gives it
    (:mod:`shifu.trainers.ppo_async`: sampled now, or up to ``max_staleness`` versions back):
    :func:`train_batch` (phases 1-6), then :func:`after_iteration` (7.); then the end of the run
    (``best/`` back as the actor if the guard stopped it, ``final/``, ``summary.json``). A SIGINT/SIGTERM
    stops the run after an iteration, with a checkpoint: returns ``{"stopped": True, "iteration"}``."""
    m, s, cfg, loop = run.models, run.state, run.cfg, run.loop
    if loop["iteration"] == 0 and cfg.eval.every > 0:
        run.tracker.log(0, run.evaluate(0))
    enabled = m.strategy.is_main and cfg.progress
    run.bar = progress(cfg.iterations, "ppo", initial=loop["iteration"], enabled=enabled)
    stop_reason = None
    with GracefulStop() as stop:
        while loop["iteration"] < cfg.iterations or loop.get("pending") is not None:
            # a run stopped by its reward service in an evaluation resumes with that iteration's metrics
            metrics = loop.pop("pending", None)
            if metrics is None:
                it = loop["iteration"] + 1
                try:  # the reward service went away mid-rollout: nothing trained yet, so checkpoint the state
                    sampled = run.producer.batch_for(it)  # before this iteration; --resume redoes it
                except RewardServiceUnavailable as e:
                    raise run.service_stopped(e, it - 1) from None
                warmup = it <= cfg.critic_warmup  # the first critic_warmup iterations: the critic only
                metrics, trained = train_batch(m, s, cfg, sampled, run.ptx, warmup, it)
                loop["iteration"] = it
                record_trained(run.out, it - 1, *sampled.rows_trained(trained), m.strategy)  # batch it - 1
                try:
                    run.producer.join()  # the batch sampled meanwhile, or the update published (S > 0)
                except RewardServiceUnavailable as e:  # iteration it trained: logged when resumed
                    loop["pending"] = metrics
                    raise run.service_stopped(e, it) from None
            stop_reason, stopping = after_iteration(run, loop["iteration"], metrics, stop)
            if stop_reason:
                break
            if stopping:
                run.close()
                if m.strategy.is_main:
                    best = (loop["best_iteration"], cfg.eval.best_key(), loop["best"])
                    announce_stop("ppo", f"iteration {loop['iteration']}", run.out, best)
                return {"stopped": True, "iteration": loop["iteration"]}
    run.end_iterations()  # (the sampler thread stopped before the best weights or the final evaluation)
    if stop_reason is not None:
        ppo_eval.restore_best(m, cfg, run.out / "best", stop_reason, loop["best_iteration"])
    run.save(loop["iteration"])
    return ppo_run.finish(run, stop_reason)


def after_iteration(run: ppo_run.Run, it: int, metrics: dict[str, float], stop: GracefulStop):
    """7. after iteration ``it``: evaluate (every ``eval.every`` iterations, and the last), log, warn once of
    empty responses, end the run after too many skipped steps, the guard, a checkpoint (every
    ``save_every`` iterations, and before any stop). Returns ``(the guard's reason to stop or None, whether
    a signal stops the run)``."""
    cfg, strategy, loop = run.cfg, run.models.strategy, run.loop
    if (cfg.eval.every > 0 and it % cfg.eval.every == 0) or it == cfg.iterations:
        try:
            metrics |= run.evaluate(it)
        except RewardServiceUnavailable as e:  # trained but not logged: --resume evaluates it again
            loop["pending"] = metrics
            raise run.service_stopped(e, it) from None
    run.tracker.log(it, metrics)
    if strategy.is_main and not run.warned_empty and metrics.get("rollout/response_len", 2.0) < 1.5:
        run.warned_empty = ppo_run.warn_empty_responses(it, metrics, run.models.tokenizer, cfg)
    ppo_run.show_progress(run.bar, metrics)
    try:
        run.state.skipped.check(f"iteration {it}", run.out, "check the reward")
    except Exception:
        run.close()
        raise
    stop_reason = ppo_eval.guard(cfg, metrics, loop["evals"])
    stopping = strategy.any_true(stop.requested)  # a signal seen by any rank stops every rank here
    if stop_reason or stopping or (cfg.save_every and it % cfg.save_every == 0):
        run.save(it)
    return stop_reason, stopping

"""Stage 3, ``shifu ppo``: PPO with four models — actor, critic, frozen reference, frozen reward model.

One iteration in :func:`iteration`: 1. rollout -> 2. score processing -> 3. reward shaping -> 4. advantages ->
5. ``ppo_epochs`` x minibatches of :func:`minibatch_loss` -> 6. KL controller; :func:`train` loops and 7.
logs, evaluates, guards, saves. Formulas are in ``shifu.core``, parallel steps in ``shifu.parallel.strategy``.

Run directory: ``metrics.jsonl``, ``tb/``, ``samples.jsonl`` (evaluation samples), ``checkpoints/`` (resume),
``best/`` (best ``eval.best_metric``), ``final/`` (HF dir), ``critic/``, ``config.yaml``, ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

from shifu import core
from shifu.config.loader import to_dict, with_values
from shifu.config.schema import PPOConfig, check_world_size, derived_sizes
from shifu.data.batches import PromptStream, encode_prompts, ptx_batches
from shifu.data.rows import load_rows, split_prompts
from shifu.generation.rollout import Rollout, check_positions
from shifu.models.loading import load_tokenizer
from shifu.models.padding import pad_left
from shifu.parallel import build_strategy
from shifu.rewards.remote import RewardServiceUnavailable
from shifu.rewards.sources import load_function
from shifu.runs import checkpoint as ckpt
from shifu.runs import jsonfile, rng
from shifu.runs.tracking import progress
from shifu.trainers import common, ppo_eval
from shifu.trainers.common import (
    GracefulStop,
    announce_stop,
    check_resume_config,
    finish_run,
    prepare_run,
    seed_everything,
)
from shifu.trainers.ppo_advantages import ESTIMATORS, Signals, totals
from shifu.trainers.ppo_models import PPOModels, PPOState, build
from shifu.trainers.ppo_rollout import collect_rollout, sampling_params
from shifu.trainers.ppo_update import update

Config = PPOConfig
# keys a resumed run may change: they do not alter what the finished iterations computed
SAFE_RESUME_KEYS = {"iterations", "save_every", "keep_last", "eval.every", "eval.num_prompts", "guard.kl_ceiling",
                    "guard.divergence_patience", "max_nonfinite_steps", "progress", "tensorboard",
                    "distributed.timeout_s", "trackers", "reward.url", "reward.timeout_s", "reward.retries"}  # fmt: skip


def iteration(m: PPOModels, s: PPOState, cfg: PPOConfig, prompt_ids, prompt_mask, rows, params, ptx=None,
              warmup=False):  # fmt: skip
    """One PPO iteration on a batch of left-padded prompts (this rank's share): 1. the rollout, then phases
    2-6 in :func:`learn`. Returns the iteration's metrics."""
    device, failed = m.strategy.device, None
    # 1. rollout: sample responses; old / reference log-probs, values and scores without gradients
    try:
        rollout, info = collect_rollout(m, cfg, prompt_ids.to(device), prompt_mask.to(device), rows, params,
                                        s.sample_gen)  # fmt: skip
    except RewardServiceUnavailable as e:  # (every rank stops alike, before anything trained)
        failed = e
    if m.strategy.any_true(failed is not None):
        raise failed or RewardServiceUnavailable(
            f"the reward service {cfg.reward.url} failed on another rank"
        )
    metrics = info | learn(m, s, cfg, rollout, ptx, warmup)
    seconds = info["time/rollout_s"] + metrics.get("time/update_s", 0.0)
    return metrics | {
        "time/scoring_s": info["time/rollout_s"] - info["time/generation_s"],
        "perf/tokens_per_s": int(rollout.response_mask.sum()) / max(1e-9, seconds),
        "rollout/dropped_nonfinite": m.strategy.batch_sums({"n": info["rollout/dropped_nonfinite"]})["n"],
    }


def learn(
    m: PPOModels, s: PPOState, cfg: PPOConfig, rollout: Rollout, ptx=None, warmup=False
) -> dict[str, float]:
    """Phases 2-6 of an iteration on a rollout (this rank's rows); returns their metrics. ``warmup``: a
    critic warm-up iteration (only the critic trains)."""
    strategy, t0, extra = m.strategy, time.perf_counter(), {}
    n_rows = strategy.batch_sums({"rows": len(rollout)})["rows"]  # over every rank
    if n_rows == 0:  # every score was NaN/Inf: no update, controllers untouched
        nan = float("nan")
        return {"objective/score": nan, "objective/kl": nan, "objective/kl_k3": nan, "objective/kl_coef": s.kl_ctl.value,
                "optim/skipped_steps": s.skipped.total}  # fmt: skip
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
    signals = Signals(scores, rollout.token_rewards, kl, beta if cfg.kl.penalty == "reward" else 0.0, train,
                      rollout.values, mask, rollout.step_mask)  # fmt: skip
    learns = extra.get("rollout/groups_dropped", 0) < n_rows / cfg.group_size  # some group kept (every rank)
    nothing = (torch.zeros_like(kl), torch.zeros_like(kl))  # every group dropped: no advantage to estimate
    advantages, returns = ESTIMATORS[cfg.estimator](signals, cfg, strategy) if learns else nothing
    if cfg.tis_cap is not None:  # truncated IS: the decode's log-probs against the trainer's old ones
        advantages = advantages * core.truncated_is_weights(
            rollout.old_log_probs, rollout.rollout_log_probs, train, cfg.tis_cap
        )
        stats = core.rollout_mismatch(rollout.old_log_probs, rollout.rollout_log_probs, mask, cfg.tis_cap)
        extra |= strategy.mean_over_ranks({f"rollout/mismatch_{k}": v for k, v in stats.items()})
    rollout = dataclasses.replace(rollout, advantages=advantages, returns=returns, response_mask=train)
    metrics = strategy.batch_means({
        "objective/score": (raw, None),
        "objective/score_processed": (scores, None),
        "objective/kl": (kl_seq, None),
        "objective/kl_k3": (kl3_seq, None),
        "objective/kl_per_token": (kl1, mask),
        "objective/rlhf_reward": (scores - beta * kl_seq, None),
        "objective/entropy": (rollout.entropy, mask),
        "rollout/response_len": (mask.sum(1).float(), None),
        "rollout/eos_frac": (rollout.eos_found.float(), None),
    })  # fmt: skip
    metrics |= extra | {"objective/kl_coef": beta, "rollout/rows": n_rows}
    if rollout.token_rewards is not None:
        metrics |= strategy.batch_means({"objective/process_reward": (rollout.token_rewards.sum(1), None)})
    # 5. epochs x minibatches of the clipped policy loss (or the variant's), value loss, entropy, ptx; in the
    # critic warm-up only the value loss. Nothing when dynamic sampling dropped every group.
    if learns:
        metrics |= update(m, s, cfg, rollout, ptx, actor=not warmup)
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
    main = strategy.is_main
    # 0. load and validate every input before the output directory is touched
    rows = load_rows(cfg.data.train, "prompt", skip_bad=cfg.data.skip_bad)
    if cfg.data.eval:
        eval_rows = load_rows(cfg.data.eval, "prompt", skip_bad=cfg.data.skip_bad)
    else:
        rows, eval_rows = split_prompts(rows, cfg.data.eval_fraction, cfg.seed)
    tok = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    tok.padding_side = "left"
    d = cfg.data
    ids, rows, dropped = encode_prompts(
        tok, rows, d.max_prompt_len, d.prompt_policy, d.train, d.chat_template
    )
    eval_ids, eval_rows, _ = encode_prompts(tok, eval_rows[: cfg.eval.num_prompts], d.max_prompt_len,
                                            d.prompt_policy, d.eval or d.train, d.chat_template)  # fmt: skip
    gold_fn = load_function(cfg.eval.gold_function, "eval.gold_function") if cfg.eval.gold_function else None
    m = build(cfg, tok, strategy)
    cfg = with_values(cfg, m.used)  # what ran (a critic.init fallback): config.yaml and checkpoints say so
    check_positions(m.actor_module, max(map(len, ids + eval_ids)), cfg.max_response_tokens)
    ptx = None
    if cfg.ptx_coef > 0:
        ptx = ptx_batches(tok, d.ptx, cfg.minibatch_size // cfg.grad_accum, d.max_prompt_len,
                          cfg.generation.max_new_tokens, cfg.seed + 7, d.skip_bad, d.chat_template)  # fmt: skip
    G = cfg.group_size  # each prompt's G responses are sampled, scored and kept together on one rank
    s, stream = PPOState.new(cfg, strategy), PromptStream(len(ids), cfg.batch_size // G, cfg.seed)
    loop: dict[str, Any] = {"iteration": 0, "best": None, "best_iteration": None, "evals": []}
    # the output directory, once every input is loaded (a failed start leaves nothing behind)
    out = prepare_run(cfg, strategy, resume, overwrite, ("iterations", cfg.iterations))
    if G > 1 and main:  # batch_size counts responses: a group method sees G times fewer prompts
        print(f"shifu ppo: {cfg.batch_size // G} prompts x {G} responses per iteration (batch_size {cfg.batch_size} counts responses)", file=sys.stderr)  # fmt: skip
    latest = ckpt.latest_checkpoint(out) if resume else None
    if resume and latest is None and main:
        print(f"shifu ppo: --resume: no checkpoint in '{out}' yet; starting from the beginning", file=sys.stderr)  # fmt: skip
    if latest is not None:
        check_resume_config(ckpt.read_state(latest)["config"], cfg, SAFE_RESUME_KEYS, out)
        js = strategy.load_checkpoint(latest, m.optimizers, m.plain)
        s.load_state_dict(js["ppo"], strategy)
        stream = PromptStream(len(ids), cfg.batch_size // G, cfg.seed, **js["data"]["prompts"])
        for _ in range(js["data"]["ptx_served"]):  # the ptx stream continues where it was
            next(ptx)
        loop = js["loop"]
        if main:
            print(f"shifu ppo: resumed from {latest} at iteration {loop['iteration']}", file=sys.stderr)
    # resuming: drop what the interrupted run logged after its checkpoint (-1: no checkpoint, start over)
    resume_step = loop["iteration"] if latest is not None else (-1 if resume else None)
    tracker = common.tracker(cfg, out, strategy, resume_step)
    if main and resume_step is not None:
        ppo_eval.trim_samples(out / "samples.jsonl", resume_step)
    if latest is None:
        sizes = {f"sizes/{k}": v for k, v in derived_sizes(cfg, strategy.world).items()}
        tracker.log(0, sizes | {"data/prompts_dropped": dropped})
    params = sampling_params(cfg)

    def save(it: int) -> None:
        data = {"prompts": stream.state(), "ptx_served": ptx.served if ptx is not None else 0}
        js = {"ppo": s.state_dict(strategy), "data": data, "loop": loop, "config": to_dict(cfg)}
        strategy.save_checkpoint(out, it, m.optimizers, m.plain, js, cfg.keep_last)

    def evaluate(it: int) -> dict[str, float]:
        metrics, samples = ppo_eval.evaluate(m, eval_ids, eval_rows, gold_fn, cfg)
        if main:
            with open(out / "samples.jsonl", "a", encoding="utf-8") as f:
                f.writelines(jsonfile.dumps({"iteration": it, **x}) + "\n" for x in samples)
        value = metrics.get(cfg.eval.best_key())  # the same value on every rank (global evaluation)
        if value is not None and (loop["best"] is None or value > loop["best"]):
            loop["best"], loop["best_iteration"] = value, it
            ppo_eval.save_actor(m, cfg, out / "best")
        loop["evals"].append({"iteration": it, **metrics})
        return metrics

    stop_reason, warned_empty = None, False
    if loop["iteration"] == 0 and cfg.eval.every > 0:
        tracker.log(0, evaluate(0))
    bar = progress(cfg.iterations, "ppo", initial=loop["iteration"], enabled=main and cfg.progress)
    with GracefulStop() as stop:
        while loop["iteration"] < cfg.iterations or loop.get("pending") is not None:
            # a run stopped by its reward service in an evaluation resumes with that iteration's metrics
            metrics = loop.pop("pending", None)
            if metrics is None:
                before = stream.state(), s.sample_gen.get_state(), rng.rng_state()
                mine, _ = strategy.share(stream.next())  # this rank's batch_size / G / W prompts, G rows each
                mine = [i for i in mine for _ in range(G)]
                b = pad_left([ids[i] for i in mine], tok.pad_token_id)
                warmup = loop["iteration"] < cfg.critic_warmup  # the first critic_warmup: critic only
                try:
                    metrics = iteration(m, s, cfg, b["input_ids"], b["attention_mask"], [rows[i] for i in mine],
                                        params, ptx, warmup)  # fmt: skip
                except RewardServiceUnavailable as e:  # the service went away mid-rollout: nothing trained
                    # yet, so checkpoint the state before this iteration; --resume redoes it
                    stream = PromptStream(len(ids), cfg.batch_size // G, cfg.seed, **before[0])
                    s.sample_gen.set_state(before[1])
                    rng.set_rng_state(before[2])
                    save(loop["iteration"]), bar.close(), tracker.close()
                    raise ppo_eval.service_stopped(e, loop["iteration"], out) from None
                loop["iteration"] += 1
            # 7. log, evaluate, guard, save
            it = loop["iteration"]
            if (cfg.eval.every > 0 and it % cfg.eval.every == 0) or it == cfg.iterations:
                try:
                    metrics |= evaluate(it)
                except RewardServiceUnavailable as e:  # trained but not logged: --resume evaluates it again
                    loop["pending"] = metrics
                    save(it), bar.close(), tracker.close()
                    raise ppo_eval.service_stopped(e, it, out) from None
            tracker.log(it, metrics)
            if main and not warned_empty and metrics.get("rollout/response_len", 2.0) < 1.5:
                warned_empty = ppo_eval.warn_empty_responses(it, metrics, tok, cfg)
            bar.update(1)
            bar.set_postfix(score=f"{metrics['objective/score'] + metrics.get('objective/process_reward', 0):.3f}",
                            kl=f"{metrics['objective/kl_k3']:.2f}", beta=f"{metrics['objective/kl_coef']:.3g}")  # fmt: skip
            try:
                s.skipped.check(f"iteration {it}", out, "check the reward")
            except Exception:
                bar.close(), tracker.close()
                raise
            stop_reason = ppo_eval.guard(cfg, metrics, loop["evals"])
            stopping = strategy.any_true(stop.requested)  # a signal seen by any rank stops every rank here
            if stop_reason or stopping or (cfg.save_every and it % cfg.save_every == 0):
                save(it)
            if stop_reason:
                break
            if stopping:
                bar.close(), tracker.close()
                if main:
                    announce_stop("ppo", f"iteration {it}", out)
                return {"stopped": True, "iteration": it}
    bar.close()
    if stop_reason is not None:
        ppo_eval.restore_best(m, cfg, out / "best", stop_reason, loop["best_iteration"])
    save(loop["iteration"])
    ppo_eval.save_actor(m, cfg, out / "final")
    if m.critic is not None:
        ppo_eval.save_critic(m, cfg, out / "critic")
    summary = {"iterations": loop["iteration"], "best": loop["best"], "best_iteration": loop["best_iteration"],
               "guard": stop_reason, "evals": loop["evals"], "skipped_steps": s.skipped.total,
               "kl_coef": s.kl_ctl.value}  # fmt: skip
    tracker.close()
    line = ppo_eval.closing_line(loop, s.kl_ctl.value, out, main, cfg, len(eval_ids))
    return finish_run(out, summary, strategy, "ppo", line)

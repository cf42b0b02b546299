"""Phase 1 of a PPO iteration, the rollout: sample responses from the actor, then the old and reference
log-probs, the entropy, the values and the scores, all without gradients, as a :class:`shifu.generation.rollout.Rollout`."""

from __future__ import annotations

import time

import torch
from torch import nn

from shifu import core
from shifu.config.schema import PPOConfig
from shifu.envs.base import Environment
from shifu.generation.episodes import run_episodes
from shifu.generation.rollout import Rollout, Sample, SamplingParams, critic_forward, policy_forward, sample
from shifu.models.padding import pad_left
from shifu.trainers.common import autocast
from shifu.trainers.ppo_models import PPOModels

# estimators that see each turn's reward on its own last token; the others compare one number per episode
PER_TURN = ("gae", "reinforce_pp")


@torch.no_grad()
def collect_rollout(
    models: PPOModels,
    cfg: PPOConfig,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: list[dict],
    params: SamplingParams,
    generator: torch.Generator,
) -> tuple[Rollout, dict[str, float]]:
    """Phase 1: sample a response to each left-padded prompt (B, P), then the rollout's old and reference
    log-probs (logits / T), entropy, values and scores. A response whose score is NaN/Inf is dropped
    (counted). Returns the rollout and ``{"time/generation_s", "time/rollout_s",
    "rollout/dropped_nonfinite"}``."""
    tok, strategy = models.tokenizer, models.strategy
    t0 = time.perf_counter()
    models.actor.eval()
    # sample responses (B, R), right-padded; everything after the first EOS is pad (mask False). In fp32 the
    # decode steps' own log-probs / entropies (and shared-trunk values) are the rollout's old_log_probs: the
    # same logits as a second forward up to float rounding, one forward pass fewer.
    # With truncated importance sampling (tis_cap) the decode's log-probs are kept apart as the rollout
    # engine's (rollout_log_probs) and the trainer's forward computes old_log_probs.
    # With bf16 decode (shifu.parallel.precision) generation reads the actor's bf16 copy; the trainer's forward then
    # computes old_log_probs and the decode's log-probs measure the mismatch (rollout/mismatch_*).
    tis, prec, dev = cfg.tis_cap is not None, models.precision, strategy.device
    reuse = models.reuses_decode_log_probs(cfg, prec.update or prec.decode) and not tis
    keep_decode = tis or prec.decode  # the decode's own log-probs, kept apart as rollout_log_probs
    kw = {"with_log_probs": reuse or keep_decode, "value_head": models.value_head if reuse else None}
    env = models.reward if isinstance(models.reward, Environment) else None
    if env is not None:  # multi-turn episodes: first inputs from env.reset, observations between the turns
        eps = run_episodes(
            models.decoder(),
            tok,
            env,
            rows,
            params,
            generator,
            cfg.data.chat_template,
            cfg.data.max_prompt_len,
            **kw,
            **strategy.generation_kwargs(),
        )
        prompt_ids, prompt_mask = eps.prompt_ids.to(dev), eps.prompt_mask.to(dev)
        sampled = Sample(*(x if x is None else x.to(dev) for x in eps.sample))
    else:
        sampled = sample(
            models.decoder(),
            prompt_ids,
            prompt_mask,
            params,
            tok.eos_token_id,
            tok.pad_token_id,
            generator=generator,
            **kw,
            **strategy.generation_kwargs(),
        )
    response_ids, response_mask = sampled.response_ids, sampled.response_mask
    t_gen = time.perf_counter() - t0
    P = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    # (B, R) what the model reads: the response, and an episode's observations
    read = response_mask if env is None else eps.attention.to(dev)
    attention_mask = torch.cat([prompt_mask.long(), read.long()], dim=1)
    decoded = sampled if reuse else None
    old_log_probs, ref_log_probs, entropy, values, ref_log_softmax = scoring_forwards(
        models, cfg, input_ids, attention_mask, P, decoded
    )
    # scores of prompt + response from the reward model(s) or function, or the episodes' rewards
    prompts = [r["prompt"] for r in rows]
    responses = [
        tok.decode(response_ids[i][response_mask[i]], skip_special_tokens=True) for i in range(len(rows))
    ]
    last = (response_mask.long().cumsum(1) == response_mask.sum(1, keepdim=True)) & response_mask
    eos_found = (response_ids == tok.eos_token_id).logical_and(last).any(1)
    if env is not None:  # an episode cut by a budget or max_turns counts as a response without EOS
        scores, token_rewards, step_mask = eps.scores(cfg.estimator in PER_TURN)
        responses, eos_found = eps.transcripts(), ~eps.truncated.to(dev)
    else:
        scores, token_rewards, step_mask = reward_scores(
            models, tok, prompts, responses, rows, input_ids, attention_mask, P, response_ids, response_mask
        )
    scores = scores.to(old_log_probs.device)
    token_rewards = token_rewards.to(dev) if token_rewards is not None else None
    step_mask = step_mask.to(dev) if step_mask is not None else None
    rollout = Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        prompt_len=P,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        values=values,
        entropy=entropy,
        scores=scores,
        eos_found=eos_found,
        prompts=prompts,
        responses=responses,
        rows=rows,
        rollout_log_probs=sampled.log_probs.float() if keep_decode else None,
        token_rewards=token_rewards,
        step_mask=step_mask,
        ref_log_softmax=ref_log_softmax,
    )
    rollout, dropped = drop_nonfinite(rollout, cfg.group_size)
    info = {
        "time/generation_s": t_gen,
        "time/rollout_s": time.perf_counter() - t0,
        "rollout/dropped_nonfinite": dropped,
    }
    if env is not None:
        info |= eps.metrics()
    if cfg.bf16:  # what the probe chose; the bf16 decode's mismatch (with tis_cap, learn() logs it)
        info |= prec.metrics()
        if prec.decode and not tis:
            r = rollout
            stats = core.rollout_mismatch(r.old_log_probs, r.rollout_log_probs, r.response_mask)
            info |= strategy.mean_over_ranks({f"rollout/mismatch_{k}": v for k, v in stats.items()})
    return rollout, info


@torch.no_grad()
def scoring_forwards(
    models: PPOModels, cfg: PPOConfig, input_ids, attention_mask, P: int, decoded: Sample | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rollout's no-grad forwards over ``cfg.micro_batch_size`` rows at a time: ``(old_log_probs,
    ref_log_probs, entropy, values, ref_log_softmax)``. The actor's log-probs and entropy (and the shared
    trunk's values) come from ``decoded``, the decode steps' own, when given; the critic's values, or zeros
    without a critic; the reference's whole log-softmax only for ``kl.loss_estimator=full`` (else None)."""
    T, prec, strategy = cfg.generation.temperature, models.precision, models.strategy
    actor, dev = models.actor_module, strategy.device
    # the trained models in the update's precision, the frozen reference as it is held (a bf16 copy or fp32)
    old_lp, entropy, old_values, ref_lp, ref_full = [], [], [], [], []
    # with kl.loss_estimator=full, the reference's whole distributions too
    exact = cfg.kl.penalty == "loss" and cfg.kl.loss_estimator == "full"
    reuse = decoded is not None
    if reuse:
        old_lp, entropy = [decoded.log_probs], [decoded.entropy]
        if decoded.values is not None:
            old_values.append(decoded.values)
    mb = cfg.micro_batch_size
    critic = strategy.unwrap(models.critic) if models.critic is not None else None
    for i in range(0, input_ids.shape[0], mb):
        ids, am = input_ids[i : i + mb], attention_mask[i : i + mb]
        if not reuse:
            with autocast(prec.update, dev):
                lp, ent, v = policy_forward(
                    actor, ids, am, P, T, with_entropy=True, value_head=models.value_head
                )
            old_lp.append(lp.float()), entropy.append(ent.float())
            if v is not None:
                old_values.append(v.float())
        with models.reference() as ref:
            out = policy_forward(ref, ids, am, P, T, log_softmax=exact)
        ref_lp.append(out[0].float())
        if exact:
            ref_full.append(out[3])
        if critic is not None:
            with autocast(prec.update, dev):
                old_values.append(critic_forward(critic, ids, am, P).float())
    old_log_probs, ref_log_probs, entropy = torch.cat(old_lp), torch.cat(ref_lp), torch.cat(entropy)
    values = torch.cat(old_values) if old_values else torch.zeros_like(old_log_probs)
    return old_log_probs, ref_log_probs, entropy, values, torch.cat(ref_full) if exact else None


def drop_nonfinite(rollout: Rollout, G: int) -> tuple[Rollout, int]:
    """The rollout without the responses whose score (or a process reward) is NaN/Inf, each with its whole
    group when ``G > 1``, instead of poisoning the batch; and how many were dropped."""
    finite = torch.isfinite(rollout.scores)
    if rollout.token_rewards is not None:
        finite &= torch.isfinite(rollout.token_rewards).all(1)
    finite = finite.view(-1, G).all(1).repeat_interleave(G)
    if not finite.all():
        rollout = rollout.select(finite.nonzero().squeeze(1))
    return rollout, int((~finite).sum())


def reward_scores(
    models, tok, prompts, responses, rows, input_ids, attention_mask, P, response_ids, response_mask
):
    """``(scores (B,), token_rewards (B, R) or None, step ends (B, R) or None)`` of the reward model(s) or
    function: process rewards from steps a function returns, dense rewards (reward.dense) per token."""
    reward_model = models.reward.model if isinstance(models.reward.model, nn.Module) else None
    dense = getattr(models.reward, "dense", False)  # reward.dense: each token's change of the prefix score
    with models.strategy.offloaded(reward_model):
        scores, steps = models.reward.score_with_steps(prompts, responses, rows, input_ids, attention_mask)
        token_rewards = models.reward.dense_rewards(input_ids, attention_mask, P) if dense else None
    step_mask = response_mask if dense else None  # dense: every token is a step of its own
    if steps is not None:
        token_rewards, step_mask = step_rewards(tok, response_ids, response_mask, steps)
    return scores, token_rewards, step_mask


def step_rewards(
    tok, response_ids: torch.Tensor, response_mask: torch.Tensor, steps: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """Process rewards (B, R) and the step ends (B, R) bool: response i's step ``(end, reward)`` (``end`` a
    character offset into its decoded text, :mod:`shifu.rewards.sources`) lands on the first token whose decoded
    prefix reaches ``end`` characters, the token that completes the step (:func:`shifu.core.place_step_rewards`);
    a step of reward 0 still ends there (the group estimators count it)."""
    S = max(1, max(len(x) for x in steps))
    ends = torch.full((len(steps), S), -1, dtype=torch.long)
    values = torch.zeros(len(steps), S)
    for i, row in enumerate(steps):
        ids, j = response_ids[i][response_mask[i]].tolist(), -1
        for end, reward in row:
            lo, hi = 0, len(ids) - 1  # binary search on the prefix length (decoding is monotone in tokens)
            while lo < hi:
                mid = (lo + hi) // 2
                if len(tok.decode(ids[: mid + 1], skip_special_tokens=True)) >= end:
                    hi = mid
                else:
                    lo = mid + 1
            if j < 0 or ends[i, j] != lo:  # two steps completed by one token share it: their rewards add
                j += 1
            ends[i, j], values[i, j] = lo, values[i, j] + reward
    dev = response_mask.device
    ends = ends.to(dev)
    used = ends >= 0
    hits = torch.zeros(response_mask.shape, dtype=torch.long, device=dev)
    step_mask = hits.scatter_add(1, torch.where(used, ends, 0), used.long()) > 0
    return core.place_step_rewards(values.to(dev), ends, response_mask), step_mask


def sampling_params(cfg: PPOConfig) -> SamplingParams:
    """How rollouts are sampled (``generation.*``)."""
    g = cfg.generation
    return SamplingParams(g.max_new_tokens, g.temperature, g.top_k, g.top_p)


def prompt_batch(indices: list[int], strategy, G: int, ids: list, rows: list[dict], pad_id: int) -> tuple:
    """A rollout's prompts on this rank: its share of the prompt ``indices`` (batch_size / G / W prompts),
    each repeated ``G`` times (a group stays on one rank), as ``(prompt_ids, prompt_mask, rows)``,
    left-padded."""
    mine, _ = strategy.share(indices)
    mine = [i for i in mine for _ in range(G)]
    b = pad_left([ids[i] for i in mine], pad_id)
    return b["input_ids"], b["attention_mask"], [rows[i] for i in mine]

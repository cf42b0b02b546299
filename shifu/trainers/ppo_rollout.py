"""Phase 1 of a PPO iteration, the rollout: trajectories from the run's rollout source (:mod:`shifu.rollout`),
then the old and reference log-probs, the entropy, the values and what the rewards mean to the estimator, all
without gradients, as a :class:`Rollout`."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from torch import Tensor

from shifu import core
from shifu.config.schema import PPOConfig
from shifu.generation.rollout import Sample, SamplingParams, critic_forward, policy_forward
from shifu.models.padding import pad_left
from shifu.rewards.remote import RewardServiceUnavailable
from shifu.rollout.batch import PromptBatch, Trajectories
from shifu.rollout.sources import Policy
from shifu.rollout.traces import TraceWriter
from shifu.trainers.common import autocast
from shifu.trainers.ppo_models import PPOModels

# estimators that see each turn's reward on its own last token; the others compare one number per episode
PER_TURN = ("gae", "reinforce_pp")


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One PPO rollout as the update reads it: ``B`` trajectories (this process's share of the batch) with the
    old and reference log-probs, values and scores of phase 1.

    Sequences are ``cat(left-padded first input (B, P), right-padded rest (B, R))`` (:mod:`shifu.rollout.batch`);
    per-token tensors (B, R) are over the rest, token t read at sequence position ``P - 1 + t``. ``advantages``
    and ``returns`` are filled in after the rollout (``dataclasses.replace``).
    """

    input_ids: Tensor  # (B, P+R) first input + sampled and read ids
    attention_mask: Tensor  # (B, P+R) 1 on real tokens
    response_mask: Tensor  # (B, R) bool, True on the tokens the policy sampled (the ones that train)
    prompt_len: int  # P
    old_log_probs: Tensor  # (B, R) log pi_old(a_t | s_t), logits / T
    ref_log_probs: Tensor  # (B, R) log pi_ref(a_t | s_t), logits / T
    values: Tensor  # (B, R) critic values V(s_t) (zeros without a critic)
    entropy: Tensor  # (B, R) entropy of pi_old at each position
    scores: Tensor  # (B,) the reward on each trajectory's last sampled token (or its return), finite
    eos_found: Tensor  # (B,) bool: the trajectory ended as it should (EOS, stop string, done), not by budget
    rows: list[dict]  # B prompt rows of the data file
    advantages: Tensor | None = None  # (B, R)
    returns: Tensor | None = None  # (B, R) value targets
    rollout_log_probs: Tensor | None = None  # (B, R) the decode's own log-probs (with tis_cap)
    token_rewards: Tensor | None = None  # (B, R) rewards on tokens that end a step or an earlier turn, else 0
    step_mask: Tensor | None = None  # (B, R) bool, the tokens that end a step (with token_rewards)
    ref_log_softmax: Tensor | None = None  # (B, R, V) log pi_ref(. | s_t) (kl.loss_estimator=full)
    prompt_ids: list[int] | None = None  # B tags kept with the rows (the trainer's: positions in its batch)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: Tensor) -> Rollout:
        """The rows ``idx`` (a 1-D index tensor) of every per-row field."""
        rows = idx.tolist()

        def pick(v):
            if isinstance(v, Tensor):
                return v[idx]
            if isinstance(v, list):
                return [v[i] for i in rows]
            return v  # prompt_len, unset optional fields

        return Rollout(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})


@torch.no_grad()
def collect_rollout(
    models: PPOModels,
    cfg: PPOConfig,
    batch: PromptBatch,
    params: SamplingParams,
    generator: torch.Generator,
    iteration: int | None = None,
) -> tuple[Rollout, dict[str, float]]:
    """Phase 1: trajectories from the run's rollout source (``models.source``: responses scored by a reward,
    episodes with an environment, ...) for this rank's prompts (:func:`sample_batch`, from the actor's current
    weights), then :func:`score_rollout`. Returns the rollout and its metrics."""
    made, t_gen = sample_batch(models, cfg, batch, params, generator)
    return score_rollout(models, cfg, made, t_gen, iteration)


def decode_roles(models: PPOModels, cfg: PPOConfig) -> tuple[bool, bool]:
    """``(reuse, keep)``: whether the decode steps' own log-probs stand in for the trainer's old ones, and
    whether they are kept apart as the sampler's (``rollout_log_probs``). In fp32 the decode steps' own log-probs
    / entropies (and shared-trunk values) are the rollout's old_log_probs: the same logits as a second forward up
    to float rounding, one forward pass fewer. With tis_cap, decoupled, is_mask or max_staleness > 0 they are the
    sampler's (behaviour policy's), kept apart, and the trainer's forward computes old_log_probs (the proximal
    policy's); so it does with bf16 decode (the actor's bf16 copy), where the decode's log-probs measure the
    mismatch (rollout/mismatch_*)."""
    prec = models.precision
    behaviour = cfg.tis_cap is not None or cfg.decoupled or cfg.is_mask is not None or cfg.max_staleness > 0
    reuse = models.reuses_decode_log_probs(cfg, prec.update or prec.decode) and not behaviour
    return reuse, behaviour or prec.decode


def sampler_policy(models: PPOModels, cfg: PPOConfig, sampler: torch.nn.Module | None = None) -> Policy:
    """What the source samples from: ``sampler`` (older weights, no value head) or the actor's decoder."""
    reuse, keep = decode_roles(models, cfg)
    model, value_head = (sampler, None) if sampler is not None else (models.decoder(), models.value_head)
    return models.policy(model, reuse or keep, value_head if reuse else None)


@torch.no_grad()
def sample_batch(
    models: PPOModels,
    cfg: PPOConfig,
    batch: PromptBatch,
    params: SamplingParams,
    generator: torch.Generator,
    sampler: torch.nn.Module | None = None,
) -> tuple[Trajectories, float]:
    """The trajectories of ``batch`` from the rollout source, sampled by ``sampler`` (an asynchronous run's copy
    of older weights, in eval mode; it touches nothing the trainer holds) or the actor's current weights;
    returns them with the seconds it took. From the actor (every rank at once), a reward service gone on any rank
    raises :class:`RewardServiceUnavailable` on every rank, before anything trained."""
    t0 = time.perf_counter()
    if sampler is None:
        models.actor.eval()
    policy = sampler_policy(models, cfg, sampler)
    made, failed = None, None
    try:
        made = models.source.collect(policy, batch, params, generator).to(models.strategy.device)
    except RewardServiceUnavailable as e:
        failed = e
    if sampler is None and models.strategy.any_true(failed is not None):  # every rank stops alike
        failed = failed or RewardServiceUnavailable(f"the {models.source.name} failed on another rank")
    if failed is not None:
        raise failed
    return made, time.perf_counter() - t0


@torch.no_grad()
def score_rollout(
    models: PPOModels,
    cfg: PPOConfig,
    made: Trajectories,
    t_gen: float,
    iteration: int | None = None,
    prompt_ids: list[int] | None = None,
) -> tuple[Rollout, dict[str, float]]:
    """The rest of phase 1 on sampled trajectories: their old and reference log-probs (logits / T), entropy,
    values and what their rewards mean to the estimator (:func:`reward_signals`). A trajectory whose score is
    NaN/Inf is dropped (counted). Returns the rollout and ``{"time/generation_s", "time/rollout_s",
    "rollout/dropped_nonfinite"}`` and the source's own metrics (e.g. ``env/*``). With ``traces.*`` the
    trajectories of ``iteration`` are recorded first (:mod:`shifu.rollout.traces`). ``prompt_ids``: a tag per
    trajectory, kept on the rollout's rows (what is left after the drop)."""
    strategy, t0 = models.strategy, time.perf_counter()
    models.actor.eval()
    prec = models.precision
    reuse, keep_decode = decode_roles(models, cfg)
    input_ids, attention_mask, P = made.input_ids, made.attention_mask, made.prompt_ids.shape[1]
    decoded = Sample(made.ids, made.trainable, made.log_probs, made.entropy, made.values) if reuse else None
    old_log_probs, ref_log_probs, entropy, values, ref_log_softmax = scoring_forwards(
        models, cfg, input_ids, attention_mask, P, decoded
    )
    if cfg.traces.recording:
        model = Path(cfg.model.path).name
        writer = TraceWriter(cfg.out_dir, strategy.rank, models.tokenizer, model, cfg.traces.atif)
        writer.write(made, old_log_probs, iteration, models.source.name)
    scores, token_rewards, step_mask = reward_signals(made, cfg.estimator in PER_TURN)
    rollout = Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=made.trainable,
        prompt_len=P,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        values=values,
        entropy=entropy,
        scores=scores.to(old_log_probs.device),
        eos_found=~made.truncated,
        rows=made.rows,
        rollout_log_probs=made.log_probs.float() if keep_decode else None,
        token_rewards=token_rewards,
        step_mask=step_mask,
        ref_log_softmax=ref_log_softmax,
        prompt_ids=prompt_ids,
    )
    rollout, dropped = drop_nonfinite(rollout, cfg.group_size)
    info = {
        "time/generation_s": t_gen,
        "time/rollout_s": t_gen + time.perf_counter() - t0,
        "rollout/dropped_nonfinite": dropped,
    } | made.metrics
    if cfg.bf16:  # what the probe chose
        info |= prec.metrics()
    # the bf16 decode's or the older sampler's mismatch (with importance weights, learn() logs it)
    weighted = cfg.tis_cap is not None or cfg.decoupled or cfg.is_mask is not None
    if (prec.decode or cfg.max_staleness > 0) and not weighted:
        r = rollout
        stats = core.rollout_mismatch(r.old_log_probs, r.rollout_log_probs, r.response_mask)
        info |= strategy.mean_over_ranks({f"rollout/mismatch_{k}": v for k, v in stats.items()})
    return rollout, info


def reward_signals(t: Trajectories, per_turn: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(scores (B,), token_rewards (B, R) or None, step ends (B, R) or None)``: what the trajectories' rewards
    mean to the estimator. One turn each: its reward is the score (on the last sampled token, where a response's
    score goes) and the steps inside it (process or dense rewards) are token rewards. Several turns, ``per_turn``
    (GAE, REINFORCE++): the last turn's reward is the score and the earlier turns' rewards are token rewards on
    their own last tokens; otherwise the return is the one score (the group estimators compare episodes). A
    trajectory with no sampled token (a fault before its first turn) scores NaN: it is dropped as a non-finite
    score is."""
    mask = t.trainable
    last = core.last_true(mask)
    final = t.rewards.gather(1, (mask.shape[1] - 1 - mask.flip(1).long().argmax(1)).unsqueeze(1)).squeeze(1)
    if t.turn_ends is None:
        score, token_rewards, steps = final, t.step_rewards, t.step_ends
    elif per_turn:
        score, token_rewards, steps = final, t.rewards * ~last, t.turn_ends
    else:
        score, token_rewards, steps = t.rewards.sum(1), t.step_rewards, t.step_ends  # (steps: token rewards)
    nan = torch.full_like(score, float("nan"))
    return torch.where(mask.any(1), score, nan), token_rewards, steps


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


def sampling_params(cfg: PPOConfig) -> SamplingParams:
    """How rollouts are sampled (``generation.*``)."""
    g = cfg.generation
    return SamplingParams(g.max_new_tokens, g.temperature, g.top_k, g.top_p)


def prompt_batch(
    indices: list[int], strategy, G: int, ids: list, rows: list[dict], pad_id: int
) -> PromptBatch:
    """A rollout's prompts on this rank: its share of the prompt ``indices`` (batch_size / G / W prompts),
    each repeated ``G`` times (a group stays on one rank), left-padded."""
    mine, _ = strategy.share(indices)
    mine = [i for i in mine for _ in range(G)]
    b = pad_left([ids[i] for i in mine], pad_id)
    return PromptBatch(
        b["input_ids"].to(strategy.device), b["attention_mask"].to(strategy.device), [rows[i] for i in mine]
    )

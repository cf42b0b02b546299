"""What ``shifu ppo`` loads before its run directory is touched: the prompts (rollout and held-out), PPO-ptx's
demonstrations, and the four models (:func:`load`: actor, frozen reference, the rollout source with its reward
model, critic),
on this device, not yet placed by the strategy (:func:`shifu.trainers.ppo_models.build` places them)."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from shifu.config.schema import PPOConfig
from shifu.data.batches import encode_prompts, ptx_batches
from shifu.errors import ShifuError
from shifu.models import lora as L
from shifu.models.loading import (
    check_own_tokenizer,
    check_vocab,
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
)
from shifu.models.scalar import ScalarModel, new_value_head
from shifu.parallel.strategy import Strategy
from shifu.rewards.sources import same_tokenizer
from shifu.rollout.build import build_source, describe, run_prompts
from shifu.rollout.sources import SourceDescription


def load_prompts(cfg: PPOConfig) -> tuple:
    """The policy's tokenizer (left padding) and the encoded prompts, ``(tok, ids, rows, dropped, held_out,
    final)``: rollout prompts, and as ``(ids, rows)`` at most ``eval.num_prompts`` held-out ones (``data.eval``,
    or a ``data.eval_fraction`` split of ``data.train``) and the first ``eval.final_prompts`` of them for the
    final evaluation (none without a gold judge: ``eval.gold_function``, or a source whose return is the task's
    own, an environment's or an agent's); ``dropped`` counts the rollout prompts left out."""
    rows, eval_rows, origin, source, _ = run_prompts(cfg, cfg.seed)
    tok = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    tok.padding_side = "left"
    d = cfg.data
    ids, rows, dropped = encode_prompts(tok, rows, d.max_prompt_len, d.prompt_policy, origin, d.chat_template)
    judged = cfg.eval.gold_function is not None or describe(cfg).gold
    n_final = cfg.eval.final_prompts if judged else 0

    def encoded(n: int) -> tuple[list[list[int]], list[dict]]:
        x = encode_prompts(tok, eval_rows[:n], d.max_prompt_len, d.prompt_policy, source, d.chat_template)
        return x[0], x[1]

    return tok, ids, rows, dropped, encoded(cfg.eval.num_prompts), encoded(n_final) if n_final else ([], [])


def ptx_stream(cfg: PPOConfig, tok):
    """PPO-ptx's endless batches of ``data.ptx`` demonstrations (``ptx_coef > 0``), else None."""
    if cfg.ptx_coef > 0:
        d, rows_per_batch = cfg.data, cfg.minibatch_size // cfg.grad_accum
        limits = (d.max_prompt_len, cfg.generation.max_new_tokens)
        return ptx_batches(tok, d.ptx, rows_per_batch, *limits, cfg.seed + 7, d.skip_bad, d.chat_template)
    return None


def load(cfg: PPOConfig, tok, strategy: Strategy):
    """``(actor, critic, value_head, ref, source, reward_model, used)`` as loaded from ``cfg``, on this device,
    not yet placed by the strategy (the rollout source and the frozen reward model it reads:
    :func:`shifu.rollout.build.build_source`). The critic starts from the reward model (``critic.init=reward``; when it cannot
    value tokens, from the SFT model), the SFT model's trunk with a new head (``sft``), or is a value head on
    the actor's trunk (``shared``); the critic-free estimators (and REINFORCE) have none. Also returns
    ``used``: each config key that could not run as written, with the value that ran (critic.init=reward
    falls back to sft, said on stderr; critic.init=shared always trains in one optimiser,
    joint_optimizer=true)."""
    zero3 = getattr(strategy, "zero3_init", None)  # ZeRO-3 builds trained HF models straight into shards
    actor = load_actor(cfg, tok, strategy) if zero3 is None else None
    ref = None
    if not cfg.lora.enabled:
        ref = load_causal_lm(
            cfg.model.ref_path or cfg.model.path, trust_remote_code=cfg.model.trust_remote_code, dropout=False
        ).to(strategy.device)
        if cfg.model.ref_path:  # another model family would crash mid-run or give a meaningless KL
            check_vocab(tok, ref, cfg.model.ref_path, "model.ref_path")
    source, reward_model = build_source(cfg, tok, strategy)
    sharded_init = zero3() if zero3 is not None else None  # (frozen models load before and after it)
    if zero3 is not None:
        actor = load_actor(cfg, tok, strategy)
    critic, value_head, used = None, None, {}
    if cfg.uses_critic:  # GAE; every other estimator (and algo=reinforce) runs without a critic
        critic, value_head, used = load_critic(cfg, tok, actor, strategy, source.description)
    del sharded_init
    return actor, critic, value_head, ref, source, reward_model, used


def load_actor(cfg: PPOConfig, tok, strategy: Strategy) -> nn.Module:
    """The actor from ``model.path`` (LoRA adapters added with ``lora.enabled``), on this device."""
    actor = load_causal_lm(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code, dropout=False)
    check_own_tokenizer(tok, actor, cfg.model.path, "model.path")
    if cfg.lora.enabled:
        actor = L.wrap_lora(actor, cfg.lora)
        if strategy.is_main:
            print(
                f"shifu ppo: LoRA actor, {L.trainable_summary(actor)}; reference = adapters disabled",
                file=sys.stderr,
                flush=True,
            )
    return actor.to(strategy.device)


def load_critic(
    cfg: PPOConfig, tok, actor, strategy: Strategy, source: SourceDescription
) -> tuple[Any, Any, dict[str, Any]]:
    """``(critic, value_head, used)`` of GAE's critic as ``critic.init`` says (see :func:`load`): a
    ScalarModel (LoRA adapters on its trunk with ``lora.critic``) on this device, or a value head on the
    actor's trunk; ``source``: what makes the rollouts (``critic.init=reward`` starts from its reward
    model)."""
    critic, value_head, init, used = None, None, cfg.critic.init, {}
    # a new head's weights at 0 (the config refuses head_init=zero with init=reward)
    zero = cfg.critic.head_init == "zero"
    if init == "reward":
        critic = critic_from_reward_model(cfg, tok, source.reward_model)
        if critic is None:
            init, used["critic.init"] = "sft", "sft"
    if init == "sft":
        critic = ScalarModel.from_backbone(
            cfg.critic.path or cfg.model.path,
            seed=cfg.seed,
            trust_remote_code=cfg.model.trust_remote_code,
            zero_head=zero,
        )
    if critic is not None and cfg.critic.path:
        check_vocab(tok, critic, cfg.critic.path, "critic.path")
    if init == "shared":
        width = actor.config.get_text_config().hidden_size
        value_head = new_value_head(width, cfg.seed, zero=zero).to(strategy.device)
        if not cfg.joint_optimizer:  # the value head trains in the actor's optimiser (see `place`)
            used["joint_optimizer"] = True
    if critic is not None:
        critic = disable_dropout(critic)
        if cfg.lora.critic:  # adapters on the frozen trunk; the value head trains fully
            critic = L.wrap_lora_critic(critic, cfg.lora)
            shared = L.share_frozen_trunk(actor, critic) if actor is not None else 0  # one copy of the base
            if strategy.is_main:
                print(
                    f"shifu ppo: LoRA critic, {L.trainable_summary(critic)}"
                    + (f"; {shared:,} frozen trunk weights shared with the actor" if shared else ""),
                    file=sys.stderr,
                    flush=True,
                )
        critic = critic.to(strategy.device)
    return critic, value_head, used


def critic_from_reward_model(cfg: PPOConfig, tok, reward_model: str | None) -> ScalarModel | None:
    """``critic.init=reward``: the reward model (its path ``reward_model``, None when the source has none; or
    ``critic.path``) with its gain 1 and bias 0; None, said on
    stderr, when it cannot be a critic (no reward model, not causal, another tokenizer): the run falls back to
    ``critic.init=sft``."""
    why = "it needs a causal trunk with the policy's tokenizer to value each token"
    try:
        if not (start := cfg.critic.path or reward_model):
            raise ShifuError("the reward is a function or a service: there is no reward model")
        critic = ScalarModel.from_pretrained(start, trust_remote_code=cfg.model.trust_remote_code)
    except ShifuError as e:
        critic, why = None, str(e)
    if critic is None or not critic.is_causal or not same_tokenizer(critic.tokenizer, tok):
        print(
            f"shifu ppo: critic.init=reward fell back to critic.init=sft: the reward model cannot be a "
            f"critic ({why}); config.yaml records critic.init: sft",
            file=sys.stderr,
        )
        return None
    critic.gain.fill_(1.0), critic.bias.fill_(0.0)
    return critic

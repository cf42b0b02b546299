"""The rollout source a PPO config names (:func:`build_source`): an environment (``env.factory``) makes episodes;
otherwise single-turn responses are scored by the reward service (``reward.url``), a function
(``reward.function``) or a reward model or ensemble (``reward.model_path``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from shifu.config.imports import load_callable, typed_key
from shifu.config.schema import PPOConfig
from shifu.envs.base import Environment
from shifu.rewards.sources import RewardSource, load_reward_model
from shifu.rollout.episodes import EpisodeLimits, Episodes
from shifu.rollout.sources import RolloutSource, SingleTurn


def episode_limits(generation: Any) -> EpisodeLimits:
    """An episode's budgets from a ``generation`` config section."""
    g = generation
    return EpisodeLimits(g.max_turns, g.max_new_tokens, g.max_total_tokens, tuple(g.stop))


def build_source(cfg: PPOConfig, tok, strategy) -> tuple[RolloutSource, nn.Module | None]:
    """``(source, reward model)``: the source of ``cfg``'s rollouts, and the frozen reward model it reads (None
    for an environment, a function or the service), on ``strategy.device``; the strategy places it
    (``strategy.frozen``) and the source reads it inside ``strategy.offloaded``."""
    if cfg.env.factory:  # an environment rewards its episodes (shifu.envs)
        env = Environment(cfg.env)
        return Episodes(
            env, episode_limits(cfg.generation), cfg.data.chat_template, cfg.data.max_prompt_len
        ), None
    reward, name = load_reward(cfg, tok, strategy.device)
    model = reward.model if isinstance(reward.model, nn.Module) else None
    offload = lambda: strategy.offloaded(model)  # noqa: E731
    return SingleTurn(reward, tuple(cfg.generation.stop), offload, name), model


def load_reward(cfg: PPOConfig, tok, device) -> tuple[Any, str]:
    """What scores single-turn responses, and its name as the user gave it: the reward service
    (``reward.url``), a function (``reward.function``), or a reward model or ensemble (``reward.model_path``)."""
    r = cfg.reward
    if r.url:  # a reward service: the same call as RewardSource, over HTTP (shifu.rewards.remote)
        from shifu.rewards.remote import RemoteReward

        service = RemoteReward(
            r.url, tok, batch_size=cfg.micro_batch_size, timeout_s=r.timeout_s, retries=r.retries
        )
        return service, f"reward service {r.url}"
    if r.function:
        fn = load_callable(r.function, typed_key("reward.function"))
        return RewardSource(function=fn, micro_batch=cfg.micro_batch_size), f"reward function {r.function}"
    rm = load_reward_model(r.model_path)
    if isinstance(rm, nn.Module):
        rm = rm.to(device)
    source = RewardSource(
        model=rm,
        policy_tokenizer=tok,
        micro_batch=cfg.micro_batch_size,
        chat_template=cfg.data.chat_template,
        dense=r.dense,
    )
    return source, f"reward model {r.model_path}"

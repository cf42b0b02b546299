"""The rollout source a PPO config names (:func:`build_source`): an environment (``env.factory``) makes episodes,
an outside agent (``agent.factory``) makes them over the policy gateway; otherwise single-turn responses are scored by the reward service (``reward.url``), a function
(``reward.function``) or a reward model or ensemble (``reward.model_path``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from shifu.config.imports import load_callable, typed_key
from shifu.config.schema import PPOConfig
from shifu.envs.base import Environment
from shifu.rewards.sources import RewardSource, load_reward_model
from shifu.rollout.agent import AgentEpisodes, check_tokenizer, load_agent
from shifu.rollout.episodes import EpisodeLimits, Episodes
from shifu.rollout.sources import RolloutSource, SingleTurn


def episode_limits(generation: Any) -> EpisodeLimits:
    """An episode's budgets from a ``generation`` config section."""
    g = generation
    return EpisodeLimits(g.max_turns, g.max_new_tokens, g.max_total_tokens, tuple(g.stop))


def build_source(cfg: PPOConfig, tok, strategy) -> tuple[RolloutSource, nn.Module | None]:
    """``(source, reward model)``: the source of ``cfg``'s rollouts, and the frozen reward model it reads (None
    for an environment, an agent, a function or the service), on ``strategy.device``; the strategy places it
    (``strategy.frozen``) and the source reads it inside ``strategy.offloaded``."""
    if cfg.agent.factory:  # an outside agent's episodes (shifu.rollout.agent)
        check_tokenizer(tok)
        forks = cfg.group_size == 1 and strategy.world == 1
        return agent_source(cfg.agent, cfg.generation, forks, cfg.data.max_prompt_len), None
    if cfg.env.factory:  # an environment rewards its episodes (shifu.envs)
        env = Environment(cfg.env)
        return Episodes(
            env, episode_limits(cfg.generation), cfg.data.chat_template, cfg.data.max_prompt_len
        ), None
    reward, name = load_reward(cfg, tok, strategy.device)
    model = reward.model if isinstance(reward.model, nn.Module) else None
    offload = lambda: strategy.offloaded(model)  # noqa: E731
    return SingleTurn(reward, tuple(cfg.generation.stop), offload, name), model


def agent_source(
    agent: Any, generation: Any, train_forks: bool = False, max_prompt_len: int | None = None
) -> AgentEpisodes:
    """The agent source of an ``agent`` config section with a ``generation`` section's budgets; ``train_forks``:
    fork trajectories train as rows of their own (one process, ``group_size`` 1); ``max_prompt_len``: the
    most ids of a trajectory's first input (``data.max_prompt_len``)."""
    a, limits = agent, episode_limits(generation)
    fn = load_agent(a.factory)
    return AgentEpisodes(
        fn, a.factory, limits, a.concurrency, a.timeout_s, a.on_error, a.kwargs, train_forks, max_prompt_len
    )


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

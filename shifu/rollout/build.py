"""The rollout source a PPO config names (:func:`build_source`): an environment (``env.factory``) makes episodes,
an outside agent (``agent.factory``) or a verifiers taskset (``verifiers.taskset``, whose tasks are also the
prompts: :func:`source_prompts`) makes them over the policy gateway; otherwise single-turn responses are
scored by the reward service (``reward.url``), a function (``reward.function``) or a reward model or ensemble
(``reward.model_path``).

This is the one place outside the sources themselves that reads which source the settings name. Everyone else
asks the source (its :class:`~shifu.rollout.sources.SourceDescription`), or before the source is built
:func:`describe` (what :func:`build_source` would build, described without building it; also what a run recorded
before sources described themselves ran, read from its ``config.yaml``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from shifu.config.imports import load_callable, typed_key
from shifu.config.loader import from_dict, lookup, to_dict
from shifu.config.schema import PPOConfig
from shifu.config.sections import PromptDataConfig
from shifu.config.sources import AgentConfig, EnvConfig, VerifiersConfig
from shifu.data.rows import load_rows, split_prompts
from shifu.envs import verifiers as V
from shifu.envs.base import Environment
from shifu.errors import ConfigError
from shifu.rewards.ensemble import ENSEMBLE_FILE
from shifu.rewards.sources import RewardSource, load_reward_model
from shifu.rollout.agent import AGENTS_EXTRA, AgentEpisodes, check_tokenizer, load_agent
from shifu.rollout.episodes import EpisodeLimits, Episodes
from shifu.rollout.sources import SINGLE_TURN, RolloutSource, SingleTurn, SourceDescription
from shifu.rollout.verifiers import VerifiersEpisodes


def episode_limits(generation: Any) -> EpisodeLimits:
    """An episode's budgets from a ``generation`` config section."""
    g = generation
    return EpisodeLimits(
        g.max_turns, g.max_new_tokens, g.max_total_tokens, tuple(g.stop), g.prefix_cache_mb, g.kv_budget_mb
    )


def build_source(cfg: PPOConfig, tok, strategy) -> tuple[RolloutSource, nn.Module | None]:
    """``(source, reward model)``: the source of ``cfg``'s rollouts, and the frozen reward model it reads (None
    for an environment, an agent, a function or the service), on ``strategy.device``; the strategy places it
    (``strategy.frozen``) and the source reads it inside ``strategy.offloaded``."""
    section = episode_section(cfg)
    if section is not None:  # an environment (shifu.envs), an outside agent (shifu.rollout.agent), a taskset
        if isinstance(section, (AgentConfig, VerifiersConfig)):
            check_tokenizer(tok)
        forks = cfg.group_size == 1 and strategy.world == 1  # (an agent's fork trajectories as rows)
        d = cfg.data
        return episodes_source(section, cfg.generation, d.chat_template, d.max_prompt_len, forks), None
    reward, scored_by, spec = load_reward(cfg, tok, strategy.device)
    model = reward.model if isinstance(reward.model, nn.Module) else None
    offload = lambda: strategy.offloaded(model)  # noqa: E731
    return SingleTurn(reward, tuple(cfg.generation.stop), offload, scored_by, spec), model


Section = AgentConfig | EnvConfig | VerifiersConfig


def episode_section(cfg: PPOConfig) -> Section | None:
    """The section of ``cfg`` that makes episodes (``agent``, ``env``, ``verifiers``); None: single responses."""
    if cfg.verifiers.taskset:
        return cfg.verifiers
    return cfg.agent if cfg.agent.factory else cfg.env if cfg.env.factory else None


def plan_section(ppo_plan: dict | None) -> Section | None:
    """:func:`episode_section` of a quickstart plan's ``ppo`` stage (a dict, as the plan's YAML writes it),
    read by the schema (call it inside ``key_prefix("ppo.")``: a bad key is named as the plan names it)."""
    for key, cls, names in (("verifiers", VerifiersConfig, "taskset"), ("agent", AgentConfig, "factory")):
        section = (ppo_plan or {}).get(key)
        if isinstance(section, dict) and section.get(names):
            return from_dict(cls, section)
    section = (ppo_plan or {}).get("env")
    if isinstance(section, dict) and section.get("factory"):
        return from_dict(EnvConfig, section)
    return None


def episodes_source(
    section: Section,
    generation: Any,
    chat: bool = True,
    max_prompt_len: int | None = None,
    train_forks: bool = False,
) -> RolloutSource:
    """The episodes of an ``agent`` section's agent (over the policy gateway; ``train_forks``:
    :func:`agent_source`) or of an ``env`` section's environment (first inputs and observations through the
    chat template with ``chat``), within a ``generation`` section's budgets; a first input longer than
    ``max_prompt_len`` ids is an error naming the row. An agent whose extras are not installed is refused here,
    before a run writes anything."""
    if isinstance(section, VerifiersConfig):
        return verifiers_source(section, generation, train_forks, max_prompt_len)
    if isinstance(section, AgentConfig):
        source = agent_source(section, generation, train_forks, max_prompt_len)
        if not source.description.available:
            raise ConfigError(
                f"{typed_key('agent.factory')} {section.factory} needs its extras: {AGENTS_EXTRA}"
            )
        return source
    return Episodes(Environment(section), episode_limits(generation), chat, max_prompt_len)


def describe(cfg: PPOConfig | dict) -> SourceDescription:
    """What :func:`build_source` builds for ``cfg`` (a config, or a quickstart plan's ``ppo`` stage as a
    dict), described without building it (the prompts are read before the models: whether the run has a gold
    judge of its own decides its final evaluation)."""
    config = cfg if isinstance(cfg, dict) else to_dict(cfg)
    return describe_settings(lambda key: lookup(config, key))


def describe_settings(setting: Callable[[str], Any]) -> SourceDescription:
    """The source a PPO config's settings name, ``setting(key)`` reading one (``"env.factory"``): the
    description a run records, for a config as recorded (a run from before runs recorded their source)."""
    if taskset := setting("verifiers.taskset"):
        return VerifiersEpisodes.describe(
            str(taskset), V.installed_here(str(setting("verifiers.python") or ""))
        )
    if agent := setting("agent.factory"):
        return AgentEpisodes.describe(str(agent))
    if env := setting("env.factory"):
        return Episodes.describe(str(env))
    if url := setting("reward.url"):
        return SourceDescription(SINGLE_TURN, "reward service", str(url))
    if fn := setting("reward.function"):
        return SourceDescription(SINGLE_TURN, "reward function", str(fn))
    if path := setting("reward.model_path"):
        return SourceDescription(SINGLE_TURN, reward_model_kind(str(path)), str(path))
    return SourceDescription(SINGLE_TURN)


def reward_model_kind(path: str) -> str:
    """``reward-model ensemble`` where ``path`` (or its run's ``final/``) holds an ensemble, else ``reward
    model``."""
    p = Path(path).expanduser()
    ensemble = (p / ENSEMBLE_FILE).is_file() or (p / "final" / ENSEMBLE_FILE).is_file()
    return "reward-model ensemble" if ensemble else "reward model"


def agent_source(
    agent: Any, generation: Any, train_forks: bool = False, max_prompt_len: int | None = None
) -> AgentEpisodes:
    """The agent source of an ``agent`` config section with a ``generation`` section's budgets; ``train_forks``:
    fork trajectories train as rows of their own (one process, ``group_size`` 1); ``max_prompt_len``: the
    most ids of a trajectory's first input (``data.max_prompt_len``)."""
    a, limits = agent, episode_limits(generation)
    fn = load_agent(a.factory)
    return AgentEpisodes(
        fn,
        a.factory,
        limits,
        a.concurrency,
        a.timeout_s,
        a.on_error,
        a.kwargs,
        train_forks,
        max_prompt_len,
        a.side_calls,
    )


def verifiers_worker(section: VerifiersConfig) -> V.Worker:
    """The verifiers worker of a ``verifiers`` section (started once per process); a ConfigError when verifiers
    is not installed where ``verifiers.python`` says, or the taskset does not load."""
    python = V.python_of(section.python)
    try:
        return V.worker(python, section.taskset, section.harness, section.kwargs, section.eval_kwargs)
    except V.NotInstalled:
        raise ConfigError(
            f"{typed_key('verifiers.taskset')} {section.taskset} needs verifiers 0.4 in {python} ({V.EXTRA}, or "
            f"{typed_key('verifiers.python')}=PATH a Python that has it, e.g. a virtual environment with "
            "verifiers==0.4.*)"
        ) from None
    except V.VerifiersError as e:
        raise ConfigError(f"{typed_key('verifiers.taskset')}: {e}") from None


def verifiers_source(
    section: VerifiersConfig, generation: Any, train_forks: bool = False, max_prompt_len: int | None = None
) -> VerifiersEpisodes:
    """The episodes of a ``verifiers`` section's taskset with a ``generation`` section's budgets (the rest as
    :func:`agent_source`)."""
    s = section
    return VerifiersEpisodes(
        verifiers_worker(s),
        s.taskset,
        episode_limits(generation),
        concurrency=s.concurrency,
        timeout_s=s.timeout_s,
        on_error=s.on_error,
        train_forks=train_forks,
        max_prompt_len=max_prompt_len,
    )


def own_prompts(cfg: PPOConfig | dict) -> bool:
    """Whether the source ``cfg`` names (a config, or a quickstart plan's ``ppo`` stage) has prompts of its own,
    a verifiers taskset's tasks, so that ``data.train`` stays empty."""
    config = cfg if isinstance(cfg, dict) else to_dict(cfg)
    return bool(lookup(config, "verifiers.taskset"))


def source_prompts(cfg: PPOConfig | Any, seed: int) -> tuple[list[dict], list[dict], str] | None:
    """``(training rows, held-out rows, where they come from)`` when the source of ``cfg`` (a PPO config, or
    a config read by the same schema) has prompts of its own, a verifiers taskset's tasks: its held-out split
    (``verifiers.eval_kwargs``) or a ``data.eval_fraction`` split of its tasks (seeded by ``seed``); None: the
    prompts are ``data.train`` / ``data.eval``."""
    s = getattr(cfg, "verifiers", None)
    if s is None or not s.taskset:
        return None
    return taskset_prompts(s, cfg.data.eval_fraction, seed)


class RunPrompts(NamedTuple):
    """A run's prompt rows (:func:`run_prompts`)."""

    train: list[dict] | None  # None: not read (``train=False``)
    held_out: list[dict]
    train_from: str  # where the rows are read (a file, or the source's own tasks)
    held_out_from: str
    split: bool  # the held-out rows are a ``data.eval_fraction`` split of ``data.train``


def run_prompts(cfg: PPOConfig | Any, seed: int, train: bool = True) -> RunPrompts:
    """A run's prompts: a source's own tasks (:func:`source_prompts`), else ``data.train`` with ``data.eval``,
    else a ``data.eval_fraction`` split of ``data.train`` (seeded by ``seed``). ``train=False``: only the
    held-out rows are wanted, so the training rows are not read unless the split needs them."""
    own = source_prompts(cfg, seed)  # a verifiers taskset's tasks
    if own is not None:
        return RunPrompts(own[0], own[1], own[2], own[2], split=False)
    d = cfg.data
    rows = load_rows(d.train, "prompt", skip_bad=d.skip_bad) if train or not d.eval else None
    if d.eval:
        return RunPrompts(
            rows, load_rows(d.eval, "prompt", skip_bad=d.skip_bad), d.train, d.eval, split=False
        )
    rows, held_out = split_prompts(rows, d.eval_fraction, seed)
    return RunPrompts(rows, held_out, d.train, d.train, split=True)


def plan_prompts(ppo_plan: dict, seed: int) -> tuple[list[dict], list[dict], str] | None:
    """:func:`source_prompts` of a quickstart plan's ``ppo`` stage (a dict; call it inside
    ``key_prefix("ppo.")``)."""
    section = plan_section(ppo_plan)
    if not isinstance(section, VerifiersConfig):
        return None
    fraction = lookup(ppo_plan, "data.eval_fraction", PromptDataConfig().eval_fraction)
    return taskset_prompts(section, fraction, seed)


def taskset_prompts(section: VerifiersConfig, eval_fraction: float, seed: int) -> tuple[list, list, str]:
    w = verifiers_worker(section)
    rows = V.task_rows(w, "train")
    if not rows:
        raise ConfigError(
            f"{typed_key('verifiers.taskset')} {section.taskset} has no tasks with {section.kwargs}"
        )
    if "eval" in w.tasks:
        return rows, V.task_rows(w, "eval"), f"verifiers:{section.taskset} (held-out split)"
    train, held_out = split_prompts(rows, eval_fraction, seed)
    return train, held_out, f"verifiers:{section.taskset} (held-out split, data.eval_fraction)"


def load_reward(cfg: PPOConfig, tok, device) -> tuple[Any, str, str]:
    """``(reward, its kind, its name as the user gave it)``: what scores single-turn responses, the reward
    service (``reward.url``), a function (``reward.function``), or a reward model or ensemble
    (``reward.model_path``)."""
    r = cfg.reward
    if r.url:  # a reward service: the same call as RewardSource, over HTTP (shifu.rewards.remote)
        from shifu.rewards.remote import RemoteReward

        service = RemoteReward(
            r.url, tok, batch_size=cfg.micro_batch_size, timeout_s=r.timeout_s, retries=r.retries
        )
        return service, "reward service", r.url
    if r.function:
        fn = load_callable(r.function, typed_key("reward.function"))
        return RewardSource(function=fn, micro_batch=cfg.micro_batch_size), "reward function", r.function
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
    return source, reward_model_kind(r.model_path), r.model_path

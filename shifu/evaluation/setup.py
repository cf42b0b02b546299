"""What one ``shifu eval`` uses (:class:`Setup`), read and checked before any policy samples: the policies, the
prompt rows, the sampling and the judge (:class:`Judge`: a reward function, a reward model, an environment or an
agent), from the flags, or from a ``shifu ppo`` run's ``config.yaml`` (``--run``) with the flags over it
(:mod:`shifu.evaluation.measure`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shifu.errors import ShifuError
from shifu.evaluation.evaluate import Evaluated


@dataclasses.dataclass
class Judge:
    """What scores a trajectory: ``name`` as the user named it; ``source(tok)`` the rollout source for a
    policy with tokenizer ``tok``; ``score(res)`` each trajectory's score from what was sampled (None: the
    source's return)."""

    name: str
    source: Callable[[Any], Any]
    score: Callable[[Evaluated], list[float]] | None = None


@dataclasses.dataclass
class Setup:
    """One ``shifu eval``: the policies ``(as given, directory)``, the prompt rows and where they came from,
    the judge, the sampling and how prompts are cut and rendered (:func:`shifu.evaluation.compare.judge_loaded`'s
    ``ev``), the seed, the device."""

    policies: list[tuple[str, Path]]
    rows: list[dict]
    prompts: str
    judge: Judge
    params: Any
    ev: dict[str, Any]
    seed: int
    device: torch.device
    settings: dict[str, Any]


# ----------------------------------------------------------------------------------------- the settings


def run_config(run_dir: str):
    """The ``PPOConfig`` a run recorded (``RUN/config.yaml``, or a quickstart run's ``RUN/ppo/config.yaml``)."""
    from shifu.config.loader import load_config
    from shifu.config.schema import PPOConfig

    run = Path(run_dir)
    for path in (run / "config.yaml", run / "ppo" / "config.yaml"):
        if path.is_file():
            return load_config(PPOConfig, path)
    raise ShifuError(
        f"--run {run_dir}: no config.yaml in it (nor in {run / 'ppo'}): pass the --out directory of a "
        "`shifu ppo` or `shifu quickstart` run"
    )


def held_out_rows(cfg) -> tuple[list[dict], str]:
    """A run's held-out prompt rows as its evaluations read them, and where they came from."""
    from shifu.rollout.build import run_prompts

    p = run_prompts(cfg, cfg.seed, train=False)
    return (
        p.held_out,
        f"{p.held_out_from} (held-out split, data.eval_fraction)" if p.split else p.held_out_from,
    )


def policies(args: argparse.Namespace, cfg) -> list[tuple[str, Path]]:
    """``(as given, policy directory)`` of A (and B); with ``--run`` and none given, the run's start
    (``model.path``) and its final policy."""
    from shifu.runs.files import resolve_policy

    given = list(args.policies)
    if not given and cfg is not None:
        given = [cfg.model.path, args.run]
    if not 1 <= len(given) <= 2:
        raise ShifuError(
            "shifu eval takes one policy (A) or two (A B: B compared to A, paired), or --run RUN_DIR alone "
            f"(the run's start against its final policy); got {len(given)}"
        )
    return [(p, resolve_policy(p, policy_as="A or B")) for p in given]


def sampling(args: argparse.Namespace, cfg) -> tuple[Any, dict[str, Any]]:
    """``(SamplingParams, the generation settings)``: the run's (``eval.temperature``, ``generation.*``) or
    the defaults, each flag given instead."""
    from shifu.config.sections import PolicyEvalConfig
    from shifu.config.sources import GenerationConfig
    from shifu.generation.rollout import SamplingParams

    g = cfg.generation if cfg is not None else GenerationConfig()
    T = cfg.eval.temperature if cfg is not None else PolicyEvalConfig().temperature
    s = {
        "temperature": T if args.temperature is None else args.temperature,
        "top_k": g.top_k if args.top_k is None else args.top_k,
        "top_p": g.top_p if args.top_p is None else args.top_p,
        "max_new_tokens": g.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        "stop": list(g.stop) if args.stop is None else args.stop,
        "max_turns": g.max_turns if args.max_turns is None else args.max_turns,
        "max_total_tokens": g.max_total_tokens if args.max_total_tokens is None else args.max_total_tokens,
    }
    if s["temperature"] < 0 or not 0 < s["top_p"] <= 1 or s["max_new_tokens"] < 1:
        raise ShifuError(
            "--temperature must be >= 0 (0: greedy), --top-p in (0, 1] and --max-new-tokens >= 1 (got "
            f"{s['temperature']}, {s['top_p']}, {s['max_new_tokens']})"
        )
    greedy = s["temperature"] == 0
    params = SamplingParams(
        s["max_new_tokens"], s["temperature"] if not greedy else 1.0, s["top_k"], s["top_p"], greedy=greedy
    )
    return params, s


def prompt_rows(args: argparse.Namespace, cfg) -> tuple[list[dict], str]:
    """The prompt rows (``--prompts``, else the run's held-out rows), the first ``--num-prompts`` (with
    ``--run``: its ``eval.final_prompts`` by default), and where they came from."""
    from shifu.data.rows import load_rows

    if args.prompts:
        rows, where = load_rows(args.prompts, "prompt"), args.prompts
    elif cfg is not None:
        rows, where = held_out_rows(cfg)
    else:
        raise ShifuError(
            "shifu eval needs prompts: --prompts FILE (JSONL rows with 'prompt'), or --run RUN_DIR"
        )
    n = args.num_prompts
    if n is None and cfg is not None and cfg.eval.final_prompts > 0:
        n = cfg.eval.final_prompts
    if n is not None and n < 1:
        raise ShifuError(f"--num-prompts must be >= 1 (got {n})")
    return list(rows)[:n], where


def setup(args: argparse.Namespace) -> Setup:
    """Everything one ``shifu eval`` uses, read and checked before any policy samples."""
    cfg = run_config(args.run) if args.run else None
    params, gen = sampling(args, cfg)
    rows, where = prompt_rows(args, cfg)
    data = cfg.data if cfg is not None else None
    ev = {
        "max_prompt_len": args.max_prompt_len or (data.max_prompt_len if data else None),
        "chat_template": not args.no_chat_template and (data.chat_template if data else True),
        "batch_size": args.batch_size or (cfg.micro_batch_size if cfg is not None else 16),
    }
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    judge = judge_of(args, cfg, gen, ev | {"device": device})
    settings = gen | ev | {"seed": args.seed, "device": str(device)}
    return Setup(policies(args, cfg), rows, where, judge, params, ev, args.seed, device, settings)


# ------------------------------------------------------------------------------------------- the judge


def judge_of(args: argparse.Namespace, cfg, gen: dict[str, Any], ev: dict[str, Any]) -> Judge:
    """The judge a flag names, else the run's: what its source is (an environment's or an agent's episodes, the
    return being the score), its gold judge, or its reward."""
    if args.env:
        return episodes_judge(_section(cfg, "env", args.env, args.env_kwargs), "--env", gen, ev)
    if args.agent:
        return episodes_judge(_section(cfg, "agent", args.agent, args.agent_kwargs), "--agent", gen, ev)
    if args.reward_function:
        return function_judge(args.reward_function, "--reward-function", gen)
    if args.reward_model:
        return model_judge(args.reward_model, gen, ev, args.batch_size or 16)
    if cfg is None:
        raise ShifuError(
            "shifu eval needs a judge: --reward-function PKG.MOD:FN, --reward-model DIR, --env PKG.MOD:NAME, "
            "--agent PKG.MOD:FN, or --run RUN_DIR (the run's own)"
        )
    from shifu.rollout.build import describe, episode_section

    ran = describe(cfg)
    if ran.episodes:
        return episodes_judge(episode_section(cfg), None, gen, ev)
    if cfg.eval.gold_function:
        return function_judge(cfg.eval.gold_function, "eval.gold_function", gen)
    if ran.scored_by == "reward function":
        return function_judge(ran.spec, "reward.function", gen)
    if ran.reward_model:
        return model_judge(ran.reward_model, gen, ev, cfg.micro_batch_size)
    raise ShifuError(
        f"--run {args.run}: the run was scored by a {ran.name}; give a judge: "
        "--reward-function, --reward-model, --env or --agent"
    )


def _section(cfg, kind: str, factory: str, kwargs_text: str | None):
    """The ``env`` or ``agent`` section of a flag's factory with ``--env-kwargs`` / ``--agent-kwargs``, the
    run's other settings of that section (``env.step_timeout_s``, ``agent.concurrency``, ...) or the
    defaults."""
    from shifu.config.sources import AgentConfig, EnvConfig

    base = getattr(cfg, kind) if cfg is not None else (AgentConfig() if kind == "agent" else EnvConfig())
    return dataclasses.replace(base, factory=factory, kwargs=_kwargs(f"--{kind}-kwargs", kwargs_text))


def _kwargs(flag: str, text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ShifuError(
            f"{flag} is not valid JSON ({e.msg}): give an object, e.g. '{{\"turns\": 2}}'"
        ) from None
    if not isinstance(value, dict):
        raise ShifuError(f"{flag} must be a JSON object of keyword arguments (got {text})")
    return value


def episodes_judge(section, flag: str | None, gen: dict[str, Any], ev: dict[str, Any]) -> Judge:
    """Episodes through an ``env`` section's environment or an ``agent`` section's agent (over the policy
    gateway), the return being the score, within the episode budgets of ``gen`` (an agent sends its own stop
    strings). ``flag``: the flag that named the factory (None: the run's config)."""
    from shifu.config.imports import load_callable
    from shifu.config.sources import AgentConfig, GenerationConfig
    from shifu.rollout.build import episodes_source

    agent = isinstance(section, AgentConfig)
    if agent and gen["stop"]:
        raise ShifuError(
            f"--stop does not apply to an agent's episodes ({section.factory}): its calls send their own"
        )
    budgets = ("max_turns", "max_new_tokens", "max_total_tokens")
    generation = GenerationConfig(**{k: gen[k] for k in budgets}, stop=list(gen["stop"]))
    if generation.max_total_tokens < generation.max_new_tokens:
        raise ShifuError(
            f"--max-total-tokens ({generation.max_total_tokens}) must be >= --max-new-tokens "
            f"({generation.max_new_tokens}), the tokens of one turn"
        )
    if flag is not None:  # a factory that does not import is named by its flag
        load_callable(section.factory, flag, "async function" if agent else "class or factory")
    source = episodes_source(section, generation, ev["chat_template"], ev["max_prompt_len"])
    return Judge(source.description.judge, lambda tok: source)


def function_judge(spec: str, key: str, gen: dict[str, Any]) -> Judge:
    """Single responses scored by the function ``spec`` (``fn(prompts, responses, rows)``; a process
    reward's steps summed), as the gold judge of ``shifu ppo`` scores them."""
    from shifu.config.imports import load_callable
    from shifu.evaluation.compare import judge_scores
    from shifu.rollout.sources import SingleTurn

    fn = load_callable(spec, key)
    unscored = SingleTurn(None, tuple(gen["stop"]))  # the function reads the responses afterwards
    what = "gold judge" if key == "eval.gold_function" else "reward function"
    return Judge(f"{what} {spec}", lambda tok: unscored, lambda res: judge_scores(fn, res))


def model_judge(path: str, gen: dict[str, Any], ev: dict[str, Any], micro_batch: int) -> Judge:
    """Single responses scored by the reward model (or ensemble) in ``path``, as PPO scores them (the token
    ids when the model shares the policy's tokenizer)."""
    from shifu.rewards.sources import RewardSource, load_reward_model
    from shifu.rollout.build import reward_model_kind
    from shifu.rollout.sources import SingleTurn

    model = load_reward_model(path)
    if isinstance(model, torch.nn.Module):
        model.to(ev["device"])

    def source(tok):
        reward = RewardSource(
            model=model, policy_tokenizer=tok, micro_batch=micro_batch, chat_template=ev["chat_template"]
        )
        return SingleTurn(reward, tuple(gen["stop"]), scored_by=reward_model_kind(path), spec=path)

    return Judge(f"reward model {path}", source)

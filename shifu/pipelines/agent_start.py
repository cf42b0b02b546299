"""The SFT start of a quickstart plan whose PPO stage trains an agent (``ppo.agent``): the agent's own episodes
answered by a teacher (:mod:`shifu.rollout.teacher`), in ``RUN/teacher/``, instead of the task's demonstrations
(written in the task's format, not in what the agent sends). The plan's ``teacher`` section says which teacher
and how many episodes (:class:`TeacherPlan`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shifu.config.loader import opt
from shifu.config.schema import PPOConfig
from shifu.errors import ConfigError
from shifu.pipelines.stages import Stages, merge, read_jsonl
from shifu.rollout.build import describe
from shifu.runs import jsonfile


@dataclasses.dataclass(frozen=True)
class TeacherPlan:
    """A plan's ``teacher`` section, read when the PPO stage trains an agent (``ppo.agent``): SFT's demonstrations
    are the agent's own episodes, its calls answered by a teacher through the gateway (:func:`agent_start`)."""

    enabled: bool = opt(
        True, "with ppo.agent: SFT on the agent's calls answered by the teacher; false: on the task's"
    )
    function: str | None = opt(
        None, "the teacher, package.module:function (messages, tools) -> assistant message"
    )
    base_url: str | None = opt(
        None, "instead of function: an OpenAI-compatible endpoint that answers (with model)"
    )
    model: str | None = opt(None, "the model base_url serves")
    api_key_env: str | None = opt(
        None, "the environment variable that holds base_url's API key (none: no key)"
    )
    num_rows: int = opt(512, "episodes for SFT's demonstrations: the first N of data/prompts_train.jsonl")
    eval_rows: int = opt(64, "episodes for SFT's held-out loss: the first N of data/prompts_val.jsonl")
    concurrency: int = opt(8, "episodes at once")

    def validate(self) -> None:
        if self.num_rows < 1 or self.eval_rows < 1 or self.concurrency < 1:
            raise ConfigError(
                f"teacher.num_rows, teacher.eval_rows and teacher.concurrency must be >= 1, got {self.num_rows}, "
                f"{self.eval_rows} and {self.concurrency}"
            )


def agent_start(stages: Stages, plan: dict, files: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """The SFT stage's plan and files: the task's demonstrations; or where the PPO stage trains an agent and the
    plan's ``teacher`` is enabled, the agent's own episodes against the teacher (:mod:`shifu.rollout.teacher`),
    written in ``RUN/teacher/`` (``sft_train.jsonl`` from the first ``teacher.num_rows`` training prompts,
    ``sft_eval.jsonl`` from the first ``teacher.eval_rows`` validation prompts) and read as they were rendered
    (``data.chat_template: false``, lengths that cut none of them)."""
    from shifu.config.imports import key_prefix
    from shifu.config.loader import from_dict
    from shifu.rollout.build import plan_section
    from shifu.rollout.sources import AGENT

    cfg = from_dict(TeacherPlan, plan.get("teacher") or {})
    if not cfg.enabled or describe(plan["ppo"]).kind != AGENT:
        return plan["sft"], files
    with key_prefix("ppo."):
        agent = plan_section(plan["ppo"])
    root, base = stages.root / "teacher", stages.root / "data" / "base"
    inputs = {"prompts_train": files["prompts_train"], "prompts_val": files["prompts_val"], "base": str(base)}
    recorded = {"teacher": dataclasses.asdict(cfg), "agent": dataclasses.asdict(agent), "inputs": inputs}
    note = f"stage teacher: SFT demonstrations from {describe(plan['ppo']).name} answered by the teacher"
    work = lambda d: teacher_demonstrations(d, cfg, agent, plan["ppo"], files, base)  # noqa: E731
    marker = stages.run("teacher", root, note, work, recorded)
    data = plan["sft"].get("data") or {}
    lengths = {
        "chat_template": False,
        "max_prompt_len": max(data.get("max_prompt_len", 0), marker["longest_prompt"]),
        "max_len": max(data.get("max_len", 0), marker["longest"] + 1),
    }
    demos = {"sft_train": str(root / "sft_train.jsonl"), "sft_eval": str(root / "sft_eval.jsonl")}
    return merge(plan["sft"], {"data": lengths}), files | demos


def teacher_demonstrations(
    root: Path, cfg: TeacherPlan, agent: Any, ppo: dict, files: dict[str, str], base: Path
) -> dict:
    """The teacher stage's work (:func:`agent_start`): the ``agent`` section's episodes on the base model's
    tokenizer, each call within the PPO stage's ``generation.max_new_tokens``; returns what its marker records
    (the counts of each file, the longest ids)."""
    import os

    from shifu.gateway.teacher import ModelShape
    from shifu.models.loading import load_tokenizer
    from shifu.rollout.agent import check_tokenizer, load_agent
    from shifu.rollout.teacher import check_demonstrations, demonstrations, load_teacher

    solve = load_agent(agent.factory)
    api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    teacher, who = load_teacher(cfg.function, cfg.base_url, cfg.model, api_key)
    tok = load_tokenizer(base)
    check_tokenizer(tok)
    shape = ModelShape(str(base))
    max_tokens = (ppo.get("generation") or {}).get("max_new_tokens") or PPOConfig().generation.max_new_tokens
    stats: dict[str, Any] = {"longest_prompt": 0, "longest": 0}
    for name, prompts, n in (
        ("sft_train", "prompts_train", cfg.num_rows),
        ("sft_eval", "prompts_val", cfg.eval_rows),
    ):
        rows = read_jsonl(files[prompts])[:n]
        made = demonstrations(
            solve, rows, shape, tok, teacher, who, agent.kwargs, max_tokens, cfg.concurrency, agent.timeout_s
        )
        check_demonstrations(made, agent.factory, who)
        jsonfile.write_jsonl(root / f"{name}.jsonl", made.rows)
        stats[name] = made.summary()
        stats["longest_prompt"] = max(stats["longest_prompt"], made.longest_prompt)
        stats["longest"] = max(stats["longest"], made.longest)
    return stats

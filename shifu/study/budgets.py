"""The study budgets of ``shifu study frontier``: the methods compared, their KL knobs per point (read from
``shifu/presets/study/TASK-BUDGET.yaml`` and checked like a user's config), and the critic-free methods built from
the PPO and REINFORCE sections."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shifu.config.loader import check_section, opt, read_shipped, shipped, unknown_key
from shifu.config.schema import DPOConfig, PPOConfig, RMConfig, SFTConfig
from shifu.errors import ConfigError, ShifuError
from shifu.pipelines.quickstart import PLANS, PairsPlan, check_stage
from shifu.pipelines.stages import (
    merge as _merge,  # a budget's keys on top of quickstart's plan (private here)
)

METHODS = (
    "ppo",
    "dpo",
    "reinforce",
    "grpo",
    "rloo",
    "reinforce_pp",
    "dr_grpo",
    "reinforce_pp_baseline",
    "gspo",
)
COLOURS = dict(
    zip(
        METHODS,
        (
            "tab:blue",
            "tab:orange",
            "tab:green",
            "tab:red",
            "tab:purple",
            "tab:brown",
            "tab:pink",
            "tab:olive",
            "tab:cyan",
        ),
    )
)


def critic_free(ppo: dict, reinforce: dict, betas: tuple[float, ...]) -> dict[str, Any]:
    """The critic-free methods of a budget, on its PPO and REINFORCE settings and the same
    responses per iteration (``batch_size`` counts responses: G = 4 per prompt for the group methods):

    - ``grpo``: PPO's clipped loss and epochs, group-normalised advantages, the KL as a k3 loss term;
    - ``rloo``: REINFORCE's one on-policy pass and lr, leave-one-out baseline, the KL in the reward;
    - ``reinforce_pp``: PPO's clipped loss and epochs, REINFORCE++ (whitened reward-to-go, no critic);
    - ``dr_grpo``: as ``grpo`` with Dr. GRPO's advantages (no std division) and constant loss normaliser;
    - ``reinforce_pp_baseline``: as ``reinforce_pp`` with the group mean subtracted first (G = 4);
    - ``gspo``: as ``grpo`` with GSPO's sequence-level ratio and clip (the paper's 3e-4 / 4e-4).

    Each method's points are fixed betas, like PPO's (the KL each reaches is measured, not assumed)."""
    fixed = {f"beta={b}": {"kl": {"controller": "fixed", "init_coef": b}} for b in betas}
    return {
        "grpo": _merge(ppo, {"advantage_estimator": "grpo", "group_size": 4, "kl": {"penalty": "loss"}}),
        "rloo": _merge(
            {k: v for k, v in reinforce.items() if k != "reinforce_baseline"},
            {"advantage_estimator": "rloo", "group_size": 4},
        ),
        "reinforce_pp": _merge(ppo, {"advantage_estimator": "reinforce_pp"}),
        "dr_grpo": _merge(
            ppo,
            {
                "advantage_estimator": "dr_grpo",
                "group_size": 4,
                "kl": {"penalty": "loss"},
                "loss_aggregation": "token_sum_norm",
            },
        ),
        "reinforce_pp_baseline": _merge(
            ppo, {"advantage_estimator": "reinforce_pp_baseline", "group_size": 4}
        ),
        "gspo": _merge(
            ppo,
            {
                "algo": "gspo",
                "advantage_estimator": "grpo",
                "group_size": 4,
                "kl": {"penalty": "loss"},
                "clip_low": 3e-4,
                "clip_high": 4e-4,
            },
        ),
        "points": {
            m: fixed for m in ("grpo", "rloo", "reinforce_pp", "dr_grpo", "reinforce_pp_baseline", "gspo")
        },
    }


def with_critic_free(budget: dict[str, Any], betas: tuple[float, ...]) -> dict[str, Any]:
    """``budget`` with the critic-free methods added (their points next to the others)."""
    extra = critic_free(budget["ppo"], budget["reinforce"], betas)
    points = {**budget["points"], **extra.pop("points")}
    return {**budget, **extra, "points": points}


# Per (task, budget), in shifu/presets/study/<task>-<budget>.yaml: the shared stages, each method's training
# overrides, and the points of each method (a label -> the overrides that set its KL budget). ``points`` are
# ordered strong -> weak KL control; ``--points N`` keeps N of them spread over the list. The critic-free
# methods are added to each budget (:func:`with_critic_free`) at its ``critic_free_betas``.


@dataclasses.dataclass(frozen=True)
class FrontierEval:
    """A budget's ``eval`` section: the held-out measurement every method gets (:func:`measure`)."""

    max_new_tokens: int | None = opt(None, "tokens per sampled response (required)")
    temperature: float | None = opt(None, "sampling temperature (required)")
    num_prompts: int | None = opt(None, "held-out prompts, the first of prompts_eval.jsonl (required)")
    max_prompt_len: int | None = opt(None, "prompts cut to their last tokens, as the RL trainers cut them")

    def validate(self) -> None:
        if None in (self.max_new_tokens, self.temperature, self.num_prompts):
            raise ConfigError("eval needs max_new_tokens, temperature and num_prompts")


BUDGET_KEYS = (
    "preset",
    "sft",
    "pairs",
    "rm",
    "ppo",
    "reinforce",
    "dpo",
    "points",
    "eval",
    "critic_free_betas",
)


def resolved_budget(task: str, plan: dict[str, Any]) -> dict[str, Any]:
    """A budget as the study runs it: its ``sft``, ``pairs`` and ``rm`` laid over the quickstart plan of its
    preset (:func:`shared_stages`)."""
    qs = PLANS[(task, plan["preset"])]
    out = {**plan, "sft": _merge(qs["sft"] or {}, plan["sft"])}
    out["pairs"] = _merge(qs.get("pairs", {}), plan["pairs"])
    if "rm" in plan or "rm" in qs:
        out["rm"] = _merge(qs.get("rm") or {}, plan.get("rm", {}))
    return out


def check_budget_file(task: str, plan: dict[str, Any], where: str) -> None:
    """ConfigError naming ``where`` for a budget file without the sections a budget needs, or with others."""
    if unknown := sorted(set(plan) - set(BUDGET_KEYS)):
        raise ConfigError(f"{where}: {unknown_key(unknown[0], BUDGET_KEYS)}")
    if missing := [k for k in BUDGET_KEYS if k not in plan and k not in ("rm", "critic_free_betas")]:
        raise ConfigError(f"{where}: no '{missing[0]}' section")
    preset, points, betas = plan["preset"], plan["points"], plan.get("critic_free_betas", [])
    if not isinstance(preset, str) or PLANS.get((task, preset), {}).get("sft") is None:
        raise ConfigError(
            f"{where}: preset '{preset}' is no quickstart plan of task {task} with an SFT stage"
        )
    if not isinstance(points, dict) or (bad := sorted(set(points) - set(METHODS))):
        raise ConfigError(f"{where}, section 'points': methods are {', '.join(METHODS)}, not {bad or points}")
    for method, labels in points.items():
        if not isinstance(labels, dict) or not all(isinstance(keys, dict) for keys in labels.values()):
            raise ConfigError(
                f"{where}, points.{method}: a mapping of labels, each to the keys its point sets"
            )
    if not isinstance(betas, list) or not all(isinstance(b, (int, float)) for b in betas):
        raise ConfigError(f"{where}: critic_free_betas must be a list of numbers")


def check_budget(task: str, plan: dict[str, Any], where: str) -> None:
    """ConfigError naming ``where`` and the section for a budget its stages and methods cannot run: every
    trainer section is checked as a user's config of that trainer, each method with each of its points."""
    full = resolved_budget(task, plan)
    check_stage(SFTConfig, full["sft"], f"{where}, section 'sft' (over the quickstart plan's)")
    check_section(PairsPlan, full["pairs"], f"{where}, section 'pairs' (over the quickstart plan's)")
    if "rm" in full:
        check_stage(RMConfig, full["rm"], f"{where}, section 'rm' (over the quickstart plan's)")
    check_section(FrontierEval, plan["eval"], f"{where}, section 'eval'")
    for method in (m for m in METHODS if m in plan):
        cls = DPOConfig if method == "dpo" else PPOConfig
        check_stage(cls, plan[method], f"{where}, section '{method}'")
        for label, point in plan["points"].get(method, {}).items():
            where_point = f"{where}, point '{label}' of {method} (over its section)"
            check_stage(cls, _merge(plan[method], point), where_point)


def read_budgets(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every ``<task>-<budget>.yaml`` budget in ``folder``, checked, with its critic-free methods added at its
    ``critic_free_betas`` (:func:`with_critic_free`)."""
    budgets = {}
    for path in sorted(folder.glob("*.yaml")):
        task, _, name = path.stem.partition("-")
        plan, where = read_shipped(path), f"config file '{path}'"
        check_budget_file(task, plan, where)
        plan = with_critic_free(plan, tuple(plan.pop("critic_free_betas", [])))
        check_budget(task, plan, where)
        budgets[(task, name)] = plan
    return budgets


BUDGETS: dict[tuple[str, str], dict[str, Any]] = read_budgets(shipped("study"))


def budget_of(task: str, budget: str) -> dict[str, Any]:
    """The (task, budget) plan; ShifuError naming the budgets there are."""
    if (task, budget) not in BUDGETS:
        choices = ", ".join(f"--task {t} --budget {b}" for t, b in BUDGETS)
        raise ShifuError(f"no frontier budget '{budget}' for task '{task}'. Choose: {choices}")
    return BUDGETS[(task, budget)]


DEFAULT_BUDGET = {"arith": "full", "imdb": "reduced"}


def select_points(plan: dict, only: list[str]) -> dict[str, list[str]]:
    """``method:label`` items -> {method: labels}, in the budget's order; unknown items are an error."""
    chosen: dict[str, list[str]] = {}
    for item in only:
        method, _, label = item.partition(":")
        known = list(plan["points"].get(method, {}))
        if label not in known:
            have = ", ".join(f"{m}:{x}" for m in plan["points"] for x in plan["points"][m])
            raise ShifuError(f"--only: no point '{item}' in this budget. Choose from: {have}")
        chosen.setdefault(method, []).append(label)
    return {m: [x for x in plan["points"][m] if x in chosen[m]] for m in METHODS if m in chosen}

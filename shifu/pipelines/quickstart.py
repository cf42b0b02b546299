"""``shifu quickstart``: a built-in task end to end — prepare -> SFT -> (pairs -> RM) -> PPO -> evaluation.

Run directory layout (``--out``, default ``runs/quickstart-<task>-<preset>-s<seed>``)::

    RUN/data/                 task files: sft_*.jsonl, prompts_*.jsonl, tokenizer/, base/ (prepare; smollm2:
                              base/ links to the cached conversion, never a copy)
    RUN/teacher/              a plan whose PPO stage trains an agent (ppo.agent): sft_train.jsonl, sft_eval.jsonl,
                              the agent's episodes answered by the plan's teacher (agent_start), SFT's data
    RUN/sft/                  shifu sft run: final/ (the SFT policy = PPO's reference), metrics.jsonl, tb/
                              (smollm2 presets: none, the instruct model data/base is the SFT policy)
    RUN/pairs/                imdb only: pairs_train.jsonl, pairs_eval.jsonl (SFT samples, noisy VADER labels;
                              prompts: data/prompts_pairs.jsonl, topped up to the plan's pairs.num_prompts
                              from data/prompts_train.jsonl)
    RUN/rm/                   imdb only: shifu rm run: final/ (reward model), metrics.jsonl
    RUN/ppo/                  shifu ppo run: final/ (the aligned policy), metrics.jsonl, samples.jsonl, tb/
    RUN/ppo-2/ ... RUN/ppo-M/ a soup plan (``soup.members`` M >= 2): the same PPO stage with seeds seed + 1000,
                              ..., seed + 1000 (M - 1)
    RUN/soup/final/           a soup plan's final policy: sft + soup.scale * mean of the M runs' changes
                              (shifu merge; merge.json says what was merged)
    RUN/samples_before.jsonl  held-out prompts, SFT policy: prompt, response, gold
    RUN/samples_after.jsonl   same prompts, final policy: prompt, response, gold, kl
    RUN/summary.json          gold_before, gold_after, kl, rm_accuracy, seconds, task, preset, seed, policy
                              (the evaluated policy's directory in RUN: ppo/final or soup/final), ...
    RUN/report.html           rendered by shifu.reporting.report (when available)
    RUN/.shifu-pipeline       marks a quickstart run directory; digests of the top-level files it wrote
    RUN/.shifu-lock           held by the running pipeline (shifu.pipelines.stages.claim_run)

Each stage directory gets a ``DONE`` marker (JSON with the seconds it took) when it finished; a rerun with
the same ``--out`` skips finished stages and continues from the first missing one (a trainer stage with a
checkpoint resumes from it). Another ``--out`` that is not empty is refused, as is one a live pipeline runs in;
nothing the quickstart did not write is deleted or overwritten (:mod:`shifu.pipelines.stages`).

Evaluation (``summary.json``): one sample per held-out prompt (``data/prompts_eval.jsonl``, >= 256, never
trained on by any stage; the plan's ``eval.num_prompts`` keeps the first N) at the PPO sampling temperature (``generation.temperature``, 1.0 in every preset),
from the SFT policy (``gold_before``) and the final policy (``gold_after``), scored by the task's gold judge
(exact match for arith, VADER compound for imdb); each mean with its standard error (``*_se``), the gain
paired over prompts (before and after share prompts and the sampling seed, so an unchanged policy gains
exactly 0). ``kl`` is the mean over those prompts of the k3 estimate of KL(pi || pi_ref), summed over the
final policy's response tokens (never negative, nats per response, same temperature); ``kl_k1`` the k1
estimate ``sum_t log pi(a_t|s_t) - log pi_ref(a_t|s_t)`` (unbiased but noisy: it can come out negative).
arith also reports greedy accuracies (``gold_greedy_before/after``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from shifu.config.loader import check_section, opt, read_shipped, shipped, unknown_key
from shifu.config.schema import PPOConfig, RMConfig, SFTConfig
from shifu.errors import ConfigError, ShifuError
from shifu.evaluation.final import GOLD, eval_settings, evaluate
from shifu.pipelines.agent_start import TeacherPlan, agent_start
from shifu.pipelines.side_by_side import overlap, side_by_side
from shifu.pipelines.stages import (
    Stages,
    claim_run,
    clock,
    done,
    elapsed,
    ppo_overrides,
    read_jsonl,
    writing,
)
from shifu.rollout.build import describe, own_prompts
from shifu.rollout.sources import SourceDescription
from shifu.runs import jsonfile

# ----------------------------------------------------------------------------------------- stage plans
# Config overrides per (task, preset) for each stage, in shifu/presets/quickstart/<task>-<preset>.yaml; data
# and model paths are filled in at run time. Every section is checked when a plan is read: a trainer stage
# (STAGE_CONFIGS) as a user's config of that trainer with what a run fills in (FILLED) under it, the others
# against their section (SECTIONS).
STAGE_CONFIGS = {"sft": SFTConfig, "rm": RMConfig, "ppo": PPOConfig}
FILLED = {"out_dir": "<run>/<stage>", "model": {"path": "<run>/<model>"}, "data": {"train": "<run>/<data>"}}


@dataclasses.dataclass(frozen=True)
class PairsPlan:
    """A plan's ``pairs`` section: preference pairs from samples of the SFT policy."""

    max_new_tokens: int | None = opt(None, "tokens per sampled response")
    temperature: float | None = opt(None, "sampling temperature")
    tau: float | None = opt(None, "imdb: the noise of the judge's Bradley-Terry labels")
    drop_ties: bool = opt(False, "imdb: leave out pairs whose two responses the judge scores the same")
    num_prompts: int | None = opt(None, "imdb: pair prompts topped up to this many; arith: prompts")
    samples_per_prompt: int | None = opt(None, "arith (shifu study): SFT samples per prompt")
    shards: int = opt(1, "imdb: parts sampled on one thread each, side by side given a thread per part")


@dataclasses.dataclass(frozen=True)
class SoupPlan:
    """A plan's ``soup`` section: the final policy merges ``members`` PPO runs (:func:`soup`)."""

    members: int = opt(1, "PPO runs merged (1: no merge)")
    scale: float = opt(1.0, "the merge: sft + scale * mean of the runs' changes")

    def validate(self) -> None:
        if self.members < 1:
            raise ConfigError(f"soup.members must be a whole number >= 1 (1: no merge), got {self.members!r}")
        if not math.isfinite(self.scale):
            raise ConfigError(f"soup.scale must be a finite number (1: the plain mean), got {self.scale!r}")


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """A plan's ``eval`` section: the final evaluation on the held-out prompts (:func:`evaluate`)."""

    max_new_tokens: int | None = opt(None, "tokens per sampled response (required; ppo.env: its budgets)")
    temperature: float | None = opt(None, "sampling temperature (required)")
    num_prompts: int | None = opt(
        None, "held-out prompts evaluated: the first N of data/prompts_eval.jsonl (default: all of them)"
    )
    greedy: bool = opt(True, "arith: greedy accuracies as well")
    batch_size: int = opt(
        64, "prompts sampled and scored together (fewer: less memory for a large vocabulary)"
    )
    max_prompt_len: int | None = opt(None, "prompts cut to their last tokens (default: ppo.data's)")
    chat_template: bool | None = opt(None, "render prompts with the chat template (default ppo.data's)")

    def validate(self) -> None:
        if self.temperature is None:
            raise ConfigError("eval needs max_new_tokens and temperature")
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size must be >= 1, got {self.batch_size}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError(
                f"eval.num_prompts must be >= 1 (or unset: every held-out prompt), got {self.num_prompts}"
            )


SECTIONS = {"pairs": PairsPlan, "soup": SoupPlan, "eval": EvalPlan, "teacher": TeacherPlan}


def check_stage(cls: type, section: Any, where: str) -> None:
    """ConfigError naming ``where`` unless ``section`` is a valid config of trainer ``cls`` once the run has
    filled in what it fills in: paths, the plan's reward model for an RL stage without a reward of its own, the
    SFT policy's tokenizer for a bag-of-tokens reward model (:meth:`Stages.rm`)."""
    fill: dict[str, Any] = json.loads(json.dumps(FILLED))
    if isinstance(section, dict):
        model = section.get("model") if isinstance(section.get("model"), dict) else {}
        rewarded = describe(section).spec  # (what rewards the stage; an environment or agent, its episodes)
        if cls is PPOConfig and not rewarded:
            fill["reward"] = {"model_path": "<run>/rm/final"}
        if cls is PPOConfig and own_prompts(section):  # (a verifiers taskset's tasks are its prompts)
            fill.pop("data")
        if cls is RMConfig and model.get("path") == "bag-of-tokens" and not model.get("tokenizer"):
            fill["model"]["tokenizer"] = "<run>/sft/final"
    check_section(cls, section, where, fill)


def check_plan_sections(plan: dict[str, Any], where: str) -> None:
    """ConfigError naming ``where`` and the section for a plan whose sections are not what its stages read:
    trainer stages are checked as a user's config of that trainer, the others against their plan section."""
    known = {*STAGE_CONFIGS, *SECTIONS, "gold"}
    if unknown := sorted(set(plan) - known):
        raise ConfigError(f"{where}: {unknown_key(unknown[0], known)}")
    if missing := sorted({"sft", "ppo", "eval"} - set(plan)):
        raise ConfigError(f"{where}: no '{missing[0]}' section (sft: null for a plan without SFT)")
    if not isinstance(plan.get("gold", ""), str):
        raise ConfigError(f"{where}: gold must be a judge, package.module:function")
    for name, section in plan.items():
        if name in STAGE_CONFIGS and not (name == "sft" and section is None):
            check_stage(STAGE_CONFIGS[name], section, f"{where}, section '{name}'")
        elif name in SECTIONS:
            check_section(SECTIONS[name], section, f"{where}, section '{name}'")
    episodes = isinstance(plan["ppo"], dict) and describe(plan["ppo"]).episodes
    if isinstance(plan["eval"], dict) and plan["eval"].get("max_new_tokens") is None and not episodes:
        raise ConfigError(f"{where}, section 'eval': eval needs max_new_tokens and temperature")


def read_plans(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every ``<task>-<preset>.yaml`` plan in ``folder``, checked (:func:`check_plan_sections`)."""
    plans = {}
    for path in sorted(folder.glob("*.yaml")):
        plan = read_shipped(path)
        check_plan_sections(plan, f"config file '{path}'")
        task, _, preset = path.stem.partition("-")
        if task == "imdb" and (missing := sorted({"pairs", "rm"} - set(plan))):
            raise ConfigError(f"config file '{path}': an imdb plan needs a '{missing[0]}' section")
        plans[(task, preset)] = plan
    return plans


PLANS: dict[tuple[str, str], dict[str, Any]] = read_plans(shipped("quickstart"))
DEFAULT_PRESET = {"imdb": "small", "arith": "tiny", "arith_tool": "tiny", "arith_chain": "tiny"}


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _plan(task: str, preset: str, sets: list[str] | None) -> dict[str, Any]:
    """The (task, preset) plan with the ``--set stage.key=value`` overrides applied (a copy)."""
    if (task, preset) not in PLANS:
        choices = ", ".join(f"--task {t} --preset {p}" for t, p in PLANS)
        raise ShifuError(f"no quickstart plan for task '{task}' with preset '{preset}'. Choose: {choices}")
    plan = json.loads(json.dumps(PLANS[(task, preset)]))
    for item in sets or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ShifuError(f"--set '{item}' must look like stage.key=value (e.g. ppo.iterations=5)")
        import yaml

        key, raw = item.split("=", 1)
        check_set_key(plan, key, item)
        _set(plan, key, yaml.safe_load(raw))
    if sets:
        check_plan_sections(plan, f"the {task}/{preset} plan with --set {' '.join(sets)}")
    return plan


def plan_yaml(plan: dict[str, Any], header: str) -> str:
    """``plan`` as YAML (sections in plan order, no aliases), after a ``# header`` comment."""
    import yaml

    return f"# {header}\n" + yaml.safe_dump(json.loads(json.dumps(plan)), sort_keys=False, width=110)


def check_set_key(plan: dict[str, Any], key: str, item: str) -> None:
    """ShifuError for a ``--set`` key no stage reads: an unknown stage, a key its trainer's config does not
    have, a ``soup`` key other than ``members`` / ``scale``, or a ``teacher`` key :class:`TeacherPlan` lacks (checked before any stage runs, so that a
    misspelt key on a finished stage is not reported as a change of plan)."""
    from shifu.config.loader import check_key, unknown_key
    from shifu.config.schema import PPOConfig, RMConfig, SFTConfig
    from shifu.errors import ConfigError

    stage, rest = key.split(".", 1)
    configs = {"sft": SFTConfig, "rm": RMConfig, "ppo": PPOConfig}
    stages = sorted(set(plan) - {"gold"} | {"soup", "teacher"})
    try:
        if stage not in stages:
            raise ConfigError(f"no stage '{stage}' in this plan; its stages are {', '.join(stages)}")
        if plan.get(stage, {}) is None:
            raise ConfigError(f"this plan has no {stage} stage (it starts from an instruct model)")
        if stage in configs:
            check_key(configs[stage], rest, f"{stage}.")
        elif stage == "soup" and rest not in ("members", "scale"):
            raise unknown_key(key, ("members", "scale"))
        elif stage == "teacher":
            check_key(TeacherPlan, rest, "teacher.")
    except ConfigError as e:
        raise ShifuError(f"--set '{item}': {e}") from None


def preference_prompts(files: dict[str, str], num_prompts: int | None = None) -> list[str]:
    """imdb preference prompts: the task's ``prompts_pairs``, topped up to ``num_prompts`` if it is larger.

    The top-up comes from the start of PPO's training prompts (``prompts_train``; never held-out ones), so
    with ``make_preference_pairs`` taking the last 10 % of pairs as the RM's held-out pairs, those come from
    the added prompts. ``num_prompts`` None (or not above the task's count) keeps the task's prompts alone.
    """
    prompts = [r["prompt"] for r in read_jsonl(files["prompts_pairs"])]
    n_more = (num_prompts or 0) - len(prompts)
    if n_more > 0:
        prompts += [r["prompt"] for r in read_jsonl(files["prompts_train"])[:n_more]]
    return prompts


# --------------------------------------------------------------------------------------------- the run

RESULTS = ["summary.json", "samples_before.jsonl", "samples_after.jsonl"]  # written by run(), top level


def report_files() -> list[str]:
    """What ``shifu.reporting.report.render_report`` writes at the top of the run directory."""
    from shifu.reporting.plots import GOLD_VS_KL, PLOTS

    return ["report.html", *(f"report/{name}.png" for name in [*(p.name for p in PLOTS), GOLD_VS_KL])]


def reward_settings(source: SourceDescription, gold: str | None) -> dict[str, Any]:
    """The PPO stage's reward settings, as its source describes itself: none for episodes (an environment's or
    an agent's reward is their own), the reward function it names, else the task's gold judge ``gold``."""
    if source.episodes:
        return {}
    return {"function": source.spec if source.scored_by == "reward function" else gold}


def run(task: str, preset: str, out: Path, seed: int, sets: list[str] | None = None) -> dict[str, Any]:
    """Run (or continue) the pipeline in ``out``; returns the summary (also written to summary.json).
    ``out`` is held for the rest of the process (:func:`shifu.pipelines.stages.claim_run`)."""
    plan = _plan(task, preset, sets)
    claim_run(out, "quickstart", RESULTS + report_files())
    stages = Stages(out, seed, "quickstart")

    # 1. prepare: data files, tokenizer, untrained (or converted) base model
    files = stages.prepare(task, preset)
    # 2. SFT from the base model (a plan without "sft" starts from an instruct model: it is the SFT policy); with
    # an agent, on the agent's own calls answered by the plan's teacher
    sft_final = out / "data" / "base"
    if plan["sft"] is not None:
        sft_final = stages.sft(*agent_start(stages, plan, files))
    # 3. imdb: preference pairs from the SFT policy, labelled by the noisy judge; then the reward model
    # rule-based reward (arith): the reward function the plan's PPO stage names, by default the gold judge itself;
    # an environment or agent rewards its own episodes
    gold = plan.get("gold", GOLD.get(task))
    reward = reward_settings(describe(plan["ppo"]), gold)
    rm_accuracy = None
    if task == "imdb":
        prompts = preference_prompts(files, plan["pairs"].get("num_prompts"))
        stages.imdb_pairs(sft_final, prompts, plan["pairs"])
        rm_accuracy = stages.rm(plan["rm"], sft_final).get("rm_accuracy")
        reward = {"model_path": str(out / "rm" / "final")}
    # 4. PPO from the SFT policy (also the frozen reference); a soup plan runs it once per member (seeds
    # seed, seed + 1000, ...) and merges the members' changes to the SFT policy (shifu.models.merge)
    policy = soup(stages, plan, sft_final, files, reward, seed)
    seconds, cpu = stages.seconds(), stages.cpu_seconds()  # cpu None: a stage finished by an older run

    # 5. final evaluation on the held-out prompts: SFT policy vs final policy, gold judge, KL
    stages.log("final evaluation on held-out prompts")
    t0 = clock()
    ev = eval_settings(plan)
    with writing(out, RESULTS):
        summary = evaluate(task, sft_final, policy, files["prompts_eval"], ev, seed, out, gold, plan["ppo"])
        took = elapsed(t0)
        seconds["eval"], cpu["eval"] = took["seconds"], took["cpu_seconds"]
        summary.update(
            task=task, preset=preset, seed=seed, rm_accuracy=rm_accuracy, seconds=seconds, cpu_seconds=cpu
        )
        summary["policy"] = str(policy.relative_to(out))
        summary["seconds_total"] = round(sum(seconds.values()) - overlap(stages.markers), 2)
        summary["cpu_seconds_total"] = round(sum(v or 0.0 for v in cpu.values()), 2)
        (out / "summary.json").write_text(jsonfile.dumps(summary, indent=2), encoding="utf-8")
    from shifu.reporting.modelcard import write_model_card

    write_model_card(policy, out / "ppo", "ppo")  # now with gold before/after, held out
    return summary


def soup(stages: Stages, plan: dict, sft_final: Path, files: dict, reward: dict, seed: int) -> Path:
    """The final policy: ``ppo/final``, or with ``soup.members`` M >= 2 the merge (``soup/final``) of M PPO
    runs from the SFT policy, ``ppo`` and ``ppo-2`` ... ``ppo-M`` (seeds ``seed + 1000 * i``), as
    ``sft + soup.scale * mean_i(member_i - sft)`` (:func:`shifu.models.merge.merge_policies`). The runs are
    independent: with more than one torch thread they train side by side (:func:`side_by_side`)."""
    from shifu.models.merge import merge_policies

    out, cfg = stages.root, plan.get("soup") or {}
    members, scale = cfg.get("members", 1), cfg.get("scale", 1.0)
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ShifuError(f"soup.members must be a whole number >= 1 (1: no merge), got {members!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ShifuError(f"soup.scale must be a finite number (1: the plain mean), got {scale!r}")
    runs = {
        "ppo" if i == 0 else f"ppo-{i + 1}": ppo_overrides(
            plan["ppo"], sft_final, files, reward, seed + 1000 * i
        )
        for i in range(members)
    }
    for name, overrides in runs.items():  # finished runs are only read, their plans checked before any trains
        if done(out / name) is not None:
            stages.train(name, "shifu.trainers.ppo", overrides)
    side_by_side(stages, runs)
    for name, overrides in runs.items():
        stages.train(name, "shifu.trainers.ppo", overrides)
    if members == 1:
        return out / "ppo" / "final"
    dirs = [out / name / "final" for name in runs]

    same_settings(out, [d.parent for d in dirs])
    what = {"members": [str(d.relative_to(out)) for d in dirs], "scale": float(scale)}
    marker = done(out / "soup")
    if marker is not None and {k: marker.get(k) for k in what} != what:  # merged other runs or scale: redo
        (out / "soup" / "DONE").unlink()

    def work(stage_dir: Path) -> dict:
        stage_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage_dir / "final", ignore_errors=True)  # an unfinished or outdated merge
        merge_policies(sft_final, dirs, stage_dir / "final", float(scale))
        return what

    stages.run("soup", out / "soup", f"stage soup: merge {members} PPO runs (scale {scale})", work)
    return out / "soup" / "final"


def same_settings(out: Path, runs: list[Path]) -> None:
    """Refuse to merge PPO runs whose recorded configs (``config.yaml``) differ in anything but the seed and
    the output directory: finished stages are kept, so a rerun with other ``ppo.*`` settings trains only the
    members that are new and would otherwise merge them with the old ones."""
    import yaml

    from shifu.runs.tracking import flatten_config

    def settings(run: Path) -> dict[str, str]:
        cfg = flatten_config(yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {})
        return {k: v for k, v in cfg.items() if k not in ("seed", "out_dir")}

    first = settings(runs[0])
    for run in runs[1:]:
        other = settings(run)
        if diff := sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k)):
            k, more = diff[0], f" and {len(diff) - 1} more keys" if len(diff) > 1 else ""
            raise ShifuError(
                f"soup: {out / run.name} was trained with other settings than {out / runs[0].name} ({k}: "
                f"{other.get(k, 'not set')} against {first.get(k, 'not set')}{more}): finished stages are kept, so a changed ppo.* "
                f"plan trains only the new members. Use a new --out, or delete {out}/ppo* to train them all again"
            )


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="shifu quickstart",
        description="Run a built-in task end to end: prepare -> SFT -> (pairs -> RM) -> PPO -> evaluation "
        "-> report. Finished stages are kept; rerunning with the same --out continues.",
    )
    ap.add_argument(
        "--task",
        choices=["imdb", "arith", "arith_tool", "arith_chain"],
        default="imdb",
        help="built-in task (default imdb)",
    )
    ap.add_argument(
        "--preset",
        choices=["tiny", "small", "smollm2"],
        default=None,
        help="size preset (default: small for imdb, tiny for arith)",
    )
    ap.add_argument("--out", default=None, help="run directory (default runs/quickstart-TASK-PRESET-sSEED)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default SHIFU_THREADS)")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="STAGE.KEY=VALUE",
        help="override a stage's config, e.g. --set ppo.iterations=5 (repeatable)",
    )
    ap.add_argument(
        "--print-config",
        action="store_true",
        help="print the plan (after --set) as YAML and exit; nothing is run or written",
    )
    args = ap.parse_args(argv)
    from shifu.parallel.threads import set_threads

    set_threads(args.threads)
    preset = args.preset or DEFAULT_PRESET[args.task]
    if args.print_config:
        source = shipped("quickstart", f"{args.task}-{preset}.yaml")
        sets = "".join(f" --set {item}" for item in args.sets)
        print(
            plan_yaml(_plan(args.task, preset, args.sets), f"shifu quickstart plan: {source}{sets}"), end=""
        )
        return 0
    out = Path(args.out or f"runs/quickstart-{args.task}-{preset}-s{args.seed}")
    from shifu.reporting.report import render_report
    from shifu.reporting.summary import result_lines
    from shifu.runs.checkpoint import release_run_dirs

    try:  # the run directory stays held (claim_run) until the report is written
        summary = run(args.task, preset, out, args.seed, args.sets)
        with writing(out, report_files()):
            print(f"report: {render_report(out)}", file=sys.stderr)
    finally:
        release_run_dirs()
    for line in result_lines(summary, args.task, preset, args.seed, out):
        print(line, file=sys.stderr)
    return 0

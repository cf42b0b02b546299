"""``shifu study frontier``: gold score against KL to the reference (and against training CPU seconds) for
PPO, DPO, REINFORCE and the critic-free methods (GRPO, RLOO, REINFORCE++: :func:`critic_free`).

Every method starts from the **same** SFT policy (also the frozen reference), learns from the same judge
(PPO and REINFORCE through their reward, DPO through preference pairs that judge labelled), and is
measured the same way by :func:`measure`: one sample per held-out prompt (the task's
``prompts_eval.jsonl``, never trained on), at the same temperature, from the same sampling seed;
``gold`` = mean gold-judge score; ``kl`` = mean over prompts of ``sum_t log pi(a_t|s_t) -
log pi_ref(a_t|s_t)`` over the policy's own response tokens (k1, **nats per response**). A method's
"KL budget" is its knob: a fixed beta for PPO and REINFORCE (``kl.controller=fixed``), beta of DPO.

Run directory (``--out``, default ``runs/frontier-<task>-<budget>``)::

    OUT/shared/data/  sft/  pairs/  [rm/]   task files, the SFT policy, preference pairs, imdb reward model
    OUT/runs/<method>-<point>-s<seed>/      one training run each, with RESULT.json (gold, kl, seconds)
    OUT/frontier.json                       every point, per seed and mean/std, cost per method
    OUT/frontier.png                        gold vs KL, one curve per method (mean, std bars over seeds)

(``--name NAME`` writes NAME.json / NAME.png instead; ``--only METHOD:POINT ...`` runs just those points,
e.g. more seeds at a few points, reusing the shared stages and finished runs of the directory.)

Finished stages and runs are kept (``DONE`` / ``RESULT.json`` markers, each with the plan it ran):
rerunning with the same ``--out`` continues, a finished one whose plan differs is refused by key, and a run
stopped with a checkpoint (Ctrl-C) resumes from it (:mod:`shifu.experiments.pipeline`). Seeds
change the RL/DPO run (sampling, shuffling); the SFT policy and the pairs are shared, so the spread over
seeds is the method's own variance.

Arith preference pairs: ``samples_per_prompt`` SFT samples per training prompt, ranked by exact match;
a prompt with at least one right and one wrong (non-empty) sample gives the pair (first right, first
wrong). Both sides are samples of the SFT policy, as in the imdb task's protocol, so DPO sees the same
kind of data as the reward model would; using the answer key as ``chosen`` would hand DPO supervised
targets that PPO only discovers through its samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from shifu.config.loader import check_section, opt, read_shipped, shipped, unknown_key
from shifu.config.schema import DPOConfig, PPOConfig, RMConfig, SFTConfig
from shifu.errors import ConfigError, ShifuError
from shifu.experiments.pipeline import (
    Stages,
    as_recorded,
    check_plan,
    claim_run,
    digest,
    log,
    ppo_overrides,
    read_jsonl,
    train_stage,
    write_jsonl,
    writing,
)
from shifu.experiments.pipeline import (
    merge as _merge,  # a budget's keys on top of quickstart's plan (private here)
)
from shifu.experiments.quickstart import PLANS, PairsPlan, check_stage, plan_yaml

METHODS = ("ppo", "dpo", "reinforce", "grpo", "rloo", "reinforce_pp", "dr_grpo", "reinforce_pp_baseline",
           "gspo")  # fmt: skip
COLOURS = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                             "tab:pink", "tab:olive", "tab:cyan")))  # fmt: skip


def critic_free(ppo: dict, reinforce: dict, betas: tuple[float, ...]) -> dict[str, Any]:
    """The critic-free methods of a budget (issue 16), on its PPO and REINFORCE settings and the same
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
        "dr_grpo": _merge(ppo, {"advantage_estimator": "dr_grpo", "group_size": 4, "kl": {"penalty": "loss"},
                                "loss_aggregation": "token_sum_norm"}),
        "reinforce_pp_baseline": _merge(ppo, {"advantage_estimator": "reinforce_pp_baseline", "group_size": 4}),
        "gspo": _merge(ppo, {"algo": "gspo", "advantage_estimator": "grpo", "group_size": 4, "kl": {"penalty": "loss"},
                             "clip_low": 3e-4, "clip_high": 4e-4}),
        "points": {m: fixed for m in ("grpo", "rloo", "reinforce_pp", "dr_grpo", "reinforce_pp_baseline", "gspo")},
    }  # fmt: skip


def with_critic_free(budget: dict[str, Any], betas: tuple[float, ...]) -> dict[str, Any]:
    """``budget`` with the critic-free methods added (their points next to the others)."""
    extra = critic_free(budget["ppo"], budget["reinforce"], betas)
    points = {**budget["points"], **extra.pop("points")}
    return {**budget, **extra, "points": points}


# Per (task, budget), in shifu/configs/study/<task>-<budget>.yaml: the shared stages, each method's training
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


# ------------------------------------------------------------------------------------- the measurement


def measure(
    policy_dir: str | Path,
    ref_dir: str | Path,
    rows: list[dict],
    gold_fn,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    max_prompt_len: int | None = None,
) -> dict[str, Any]:
    """Gold and KL of one policy on held-out prompt ``rows`` — the one measurement every method gets.

    One sample per prompt at ``temperature`` (sampling generator seeded with ``seed``: every policy is
    drawn with the same random numbers); ``gold`` = mean of ``gold_fn`` over the samples; ``kl`` = mean
    over prompts of the k1 sum over response tokens of ``log pi - log pi_ref`` (nats per response,
    :func:`shifu.tasks.evaluate_policy`); ``response_len`` = mean real tokens, EOS included.
    ``max_prompt_len`` keeps each prompt's last tokens, as the RL trainers' ``data.max_prompt_len``.
    """
    from shifu.tasks import evaluate_policy

    prompts = [r["prompt"] for r in rows]
    ev = evaluate_policy(
        str(policy_dir),
        str(ref_dir),
        prompts,
        max_new_tokens,
        temperature,
        seed,
        max_prompt_len=max_prompt_len,
    )
    gold = [float(g) for g in gold_fn(prompts, ev["responses"], rows)]
    n = len(prompts)
    return {
        "gold": sum(gold) / n,
        "kl": sum(ev["kl"]) / n,
        "response_len": sum(ev["lengths"]) / n,
        "samples": [
            {"prompt": p, "response": y, "gold": g} for p, y, g in zip(prompts[:8], ev["responses"], gold)
        ],
    }


# ------------------------------------------------------------------------------------- shared stages


def arith_pairs(sft_dir: Path, prompt_rows: list[dict], out: Path, pp: dict, seed: int) -> dict[str, Any]:
    """Preference pairs from SFT samples ranked by exact match (see the module docstring)."""
    import torch

    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.tasks import sample_responses
    from shifu.tasks.judges import exact_match

    rows = list(prompt_rows)
    random.Random(seed).shuffle(rows)
    rows = rows[: pp["num_prompts"]]
    tok, model = load_tokenizer(sft_dir), load_causal_lm(sft_dir, dropout=False).eval()
    gen = torch.Generator().manual_seed(seed)
    prompts = [r["prompt"] for r in rows]
    draws = [
        sample_responses(model, tok, prompts, pp["max_new_tokens"], pp["temperature"], gen)
        for _ in range(pp["samples_per_prompt"])
    ]
    pairs = []
    for i, row in enumerate(rows):
        samples = [d[i] for d in draws]
        right = exact_match([row["prompt"]] * len(samples), samples, [row] * len(samples))
        good = [s for s, r in zip(samples, right) if r == 1.0]
        bad = [s for s, r in zip(samples, right) if r == 0.0 and s.strip()]
        if good and bad:
            pairs.append(
                {"prompt": row["prompt"], "chosen": good[0], "rejected": bad[0], "answer": row["answer"]}
            )
    if len(pairs) < 20:
        raise ShifuError(
            f"only {len(pairs)} preference pairs from {len(rows)} prompts: the SFT policy is almost always "
            "right or always wrong; raise pairs.num_prompts or change sft.max_steps"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "pairs.jsonl", pairs)
    n_right = sum(exact_match(prompts, d, rows).count(1.0) for d in draws)
    return {
        "pairs": len(pairs),
        "prompts": len(rows),
        "sft_sample_accuracy": n_right / (len(rows) * len(draws)),
    }


def shared_stages(task: str, plan: dict, out: Path, sets_seed: int = 0) -> dict[str, Any]:
    """prepare -> SFT -> pairs (-> reward model for imdb) in ``out/shared``: quickstart's stages and plan for
    the budget's preset, with the budget's overrides on top; every stage is seeded with ``sets_seed``."""
    from shifu.experiments.quickstart import PLANS, preference_prompts

    qs = PLANS[(task, plan["preset"])]
    stages = Stages(out / "shared", sets_seed, "study")
    quiet = {"progress": False}
    files = stages.prepare(task, plan["preset"])
    sft_final = stages.sft(_merge(_merge(qs["sft"], plan["sft"]), quiet), files)
    info: dict[str, Any] = {"files": files, "sft": str(sft_final)}
    pairs_dir = stages.root / "pairs"
    pp = _merge(qs.get("pairs", {}), plan["pairs"])
    if task == "arith":

        def work(stage_dir: Path) -> dict[str, Any]:
            return arith_pairs(sft_final, read_jsonl(files["prompts_train"]), stage_dir, pp, sets_seed)

        note, inputs = "stage pairs: SFT samples ranked by exact match", {"policy": str(sft_final)}
        pairs = stages.run("pairs", pairs_dir, note, work, plan={**pp, **inputs, "seed": sets_seed})
        info["pairs"] = {"train": str(pairs_dir / "pairs.jsonl"), "eval": ""}
        info["reward"] = {"function": "shifu.tasks.judges:exact_match"}
    else:
        # the task's preference prompts topped up to pp["num_prompts"] with PPO's training prompts
        pairs = stages.imdb_pairs(sft_final, preference_prompts(files, pp.get("num_prompts")), pp)
        info["pairs"] = {
            "train": str(pairs_dir / "pairs_train.jsonl"),
            "eval": str(pairs_dir / "pairs_eval.jsonl"),
        }
        rm = stages.rm(_merge(_merge(qs["rm"], plan.get("rm", {})), quiet), sft_final)
        rm_final = stages.root / "rm" / "final"
        info["reward"] = {"model_path": str(rm_final)}
        info["rm"] = {
            "accuracy": rm.get("rm_accuracy"),
            **rm_gold_accuracy(rm_final, read_jsonl(info["pairs"]["eval"])),
        }
    info["pairs_info"] = {k: v for k, v in pairs.items() if k not in ("seconds", "cpu_seconds")}
    info["seconds"] = stages.seconds()
    return info


def rm_gold_accuracy(rm_path: Path, pairs: list[dict]) -> dict[str, Any]:
    """The reward model against the noiseless judge on held-out pairs: the fraction of pairs whose
    gold-better response it scores higher (pairs with equal gold scores left out). ``accuracy`` from the RM
    trainer is against the noisy (Bradley-Terry) labels it was trained to predict."""
    import torch

    from shifu.rewards.sources.sources import load_reward_model

    decided = [r for r in pairs if r["gold_chosen"] != r["gold_rejected"]]
    if not decided:
        return {"gold_accuracy": None, "gold_pairs": 0}
    model = load_reward_model(rm_path).eval()
    prompts = [r["prompt"] for r in decided]
    with torch.no_grad():
        chosen = model.score_texts(prompts, [r["chosen"] for r in decided]).float().tolist()
        rejected = model.score_texts(prompts, [r["rejected"] for r in decided]).float().tolist()
    right = [
        (c > rj) == (r["gold_chosen"] > r["gold_rejected"]) for c, rj, r in zip(chosen, rejected, decided)
    ]
    return {"gold_accuracy": sum(right) / len(right), "gold_pairs": len(right)}


# ------------------------------------------------------------------------------------- one point


def _trainer_overrides(method: str, plan: dict, point: dict, shared: dict, seed: int) -> dict:
    """The config of one run: the budget's ``plan[method]`` from the SFT policy, then the point's own keys."""
    if method == "dpo":
        data = {"train": shared["pairs"]["train"]}
        if shared["pairs"]["eval"]:
            data["eval"] = shared["pairs"]["eval"]
        base = {
            "seed": seed,
            "model": {"path": shared["sft"]},
            "progress": False,
            "tensorboard": False,
            "data": data,
        }
        over = _merge(plan[method], base)
    else:
        over = ppo_overrides(plan[method], shared["sft"], shared["files"], shared["reward"], seed)
    return _merge(over, point)


def run_point(method: str, label: str, seed: int, plan: dict, shared: dict, out: Path, ev: dict) -> dict:
    """Train one (method, point, seed) from the SFT policy and measure it; cached in RESULT.json."""
    from shifu.rewards.sources.sources import load_function

    run_dir = out / "runs" / f"{method}-{label.replace('=', '')}-s{seed}"
    result_file = run_dir / "RESULT.json"
    name = f"{method} {label} seed {seed}"
    over = _trainer_overrides(method, plan, plan["points"][method][label], shared, seed)
    prompts = digest([r["prompt"] for r in ev["rows"]])  # which held-out prompts measure it
    measured = {**{k: v for k, v in ev.items() if k != "rows"}, "prompts": prompts}
    recorded = as_recorded({"train": over, "eval": measured}, out)
    if result_file.exists():
        result = json.loads(result_file.read_text(encoding="utf-8"))
        check_plan(f"run {name}", run_dir, result, recorded, lambda msg: log("study", msg))
        return result
    log("study", name)
    module = "shifu.trainers.dpo" if method == "dpo" else "shifu.trainers.ppo"
    t0, c0 = time.time(), time.process_time()
    train_stage(module, run_dir, over)
    seconds, cpu_seconds = time.time() - t0, time.process_time() - c0
    rows = ev["rows"]
    m = measure(
        run_dir / "final",
        shared["sft"],
        rows,
        load_function(ev["gold"], "gold judge"),
        ev["max_new_tokens"],
        ev["temperature"],
        ev["seed"],
        ev["max_prompt_len"],
    )
    result = {
        "method": method,
        "point": label,
        "seed": seed,
        "gold": m["gold"],
        "kl": m["kl"],
        "response_len": m["response_len"],
        "train_seconds": round(seconds, 2),
        "train_cpu_seconds": round(cpu_seconds, 2),  # every thread of the process: the critic's cost counts
        "proxy": _proxy(method, run_dir),
        "samples": m["samples"],
        "plan": recorded,
    }
    result_file.write_text(json.dumps(result, indent=2), encoding="utf-8")
    log("study", f"{name}: gold {m['gold']:.3f} at KL {m['kl']:.2f} nats ({seconds:.0f} s)")
    return result


def _proxy(method: str, run_dir: Path) -> float | None:
    """What the method optimised, at its end: mean objective/score of the last 5 iterations (PPO,
    REINFORCE), or the held-out implicit-reward margin (DPO)."""
    from shifu.runs.tracking import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if method == "dpo":
        vals = [r["eval/dpo/margin"] for r in rows if "eval/dpo/margin" in r]
        return vals[-1] if vals else None
    vals = [r["objective/score"] for r in rows if isinstance(r.get("objective/score"), (int, float))][-5:]
    return sum(vals) / len(vals) if vals else None


# ------------------------------------------------------------------------------------- aggregate + plot


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def aggregate(results: list[dict], order: dict[str, list[str]]) -> dict[str, Any]:
    """Per method: each point's per-seed numbers and mean/std of gold and KL; cost per method."""
    methods: dict[str, Any] = {}
    for method, labels in order.items():
        points = []
        for label in labels:
            rs = sorted(
                (r for r in results if r["method"] == method and r["point"] == label), key=lambda r: r["seed"]
            )
            if not rs:
                continue
            g, gs = _mean_std([r["gold"] for r in rs])
            k, ks = _mean_std([r["kl"] for r in rs])
            points.append(
                {
                    "point": label,
                    "gold_mean": g,
                    "gold_std": gs,
                    "kl_mean": k,
                    "kl_std": ks,
                    "per_seed": [
                        {x: r[x] for x in ("seed", "gold", "kl", "response_len", "train_seconds", "proxy")}
                        | {"train_cpu_seconds": r.get("train_cpu_seconds", r["train_seconds"])}
                        for r in rs
                    ],
                }
            )
        secs = [s["train_seconds"] for p in points for s in p["per_seed"]]
        cpu = [s["train_cpu_seconds"] for p in points for s in p["per_seed"]]
        methods[method] = {
            "points": points,
            "train_seconds_per_run": sum(secs) / len(secs) if secs else None,
            "train_cpu_seconds_per_run": sum(cpu) / len(cpu) if cpu else None,
            "train_seconds_total": sum(secs),
            # across-seed spread of gold, averaged over the method's points (the variance target)
            "mean_gold_std": sum(p["gold_std"] for p in points) / len(points) if points else None,
            # the same spread with the part explained by each seed's own KL removed (see _resid_std)
            "gold_std_at_kl": _resid_std([[(s["kl"], s["gold"]) for s in p["per_seed"]] for p in points]),
        }
    return methods


def _resid_std(groups: list[list[tuple[float, float]]]) -> float | None:
    """Spread of gold over seeds *at the same KL*: the residual std of a pooled within-point regression.

    ``groups`` holds one list of (kl, gold) per point, one pair per seed. Within each point, gold and KL
    are centred on the point's means; one slope b (gold per nat, shared by the points) is fitted to the
    centred values, and the result is the sample std of ``gold - b * kl`` deviations with n - P - 1
    degrees of freedom (n runs, P points). A seed that drifted further than its siblings is not counted
    as variance to the extent that gold moves with KL; what is left is the method's scatter at a given
    KL. None when there are not enough seeds (n - P - 1 < 1) or no KL spread within points.
    """
    dx, dy = [], []
    for g in groups:
        if not g:
            continue
        mx, my = sum(x for x, _ in g) / len(g), sum(y for _, y in g) / len(g)
        dx += [x - mx for x, _ in g]
        dy += [y - my for _, y in g]
    dof = len(dx) - sum(1 for g in groups if g) - 1
    sxx = sum(x * x for x in dx)
    if dof < 1 or sxx == 0:
        return None
    b = sum(x * y for x, y in zip(dx, dy)) / sxx
    return math.sqrt(sum((y - b * x) ** 2 for x, y in zip(dx, dy)) / dof)


def _gold_at(curve: list[tuple[float, float]], kl: float) -> float | None:
    """Gold of one seed's frontier at ``kl``: linear in ln KL between its two neighbouring points (the
    measured curves are close to straight lines in ln KL: imdb seed 0 gains 0.24-0.30 gold per unit of
    ln KL between every pair of neighbouring points, for all three methods). None outside the seed's
    range (no extrapolation)."""
    pts = sorted((k, g) for k, g in curve if k > 0)
    for (k0, g0), (k1, g1) in zip(pts, pts[1:]):
        if k0 <= kl <= k1:
            if k1 == k0:
                return (g0 + g1) / 2
            w = (math.log(kl) - math.log(k0)) / (math.log(k1) - math.log(k0))
            return g0 + w * (g1 - g0)
    return None


def matched_kl(methods: dict[str, Any], grid_points: int = 5, min_seeds: int = 2) -> dict[str, Any] | None:
    """Every method's gold read at the same KLs, per seed, along that seed's own frontier.

    Each seed of a method has one (KL, gold) per point; :func:`_gold_at` interpolates it. The KL grid
    spans the range that at least ``min_seeds`` seeds of *every* method cover, ``grid_points`` values
    evenly spaced in ln KL. Per method and grid KL: mean and std over the seeds that reach it; versus
    PPO: the difference of means with its standard error (seeds of two methods are independent). This is
    what "one method's frontier is above another's" and "more variance across seeds at the same KL"
    are read from. None when fewer than two methods have ``min_seeds`` seeds with two points or more.
    """
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for method, m in methods.items():
        by_seed: dict[int, list[tuple[float, float]]] = {}
        for p in m["points"]:
            for s in p["per_seed"]:
                by_seed.setdefault(s["seed"], []).append((s["kl"], s["gold"]))
        usable = [c for c in by_seed.values() if len([k for k, _ in c if k > 0]) >= 2]
        if len(usable) >= min_seeds:
            curves[method] = usable
    if len(curves) < 2:
        return None

    def covered(cs: list[list[tuple[float, float]]]) -> tuple[float, float]:
        # the widest [lo, hi] that min_seeds seeds each span
        los = sorted(min(k for k, _ in c if k > 0) for c in cs)
        his = sorted((max(k for k, _ in c) for c in cs), reverse=True)
        return los[min_seeds - 1], his[min_seeds - 1]

    ranges = [covered(cs) for cs in curves.values()]
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    if not lo < hi:
        return {"kl_grid": [], "methods": {}, "vs_ppo": {}, "note": "the methods' KL ranges do not overlap"}
    n = max(grid_points, 2)
    grid = [math.exp(math.log(lo) + i * (math.log(hi) - math.log(lo)) / (n - 1)) for i in range(n)]
    grid[0], grid[-1] = lo, hi  # exactly the ends (exp(log(x)) may land just outside a seed's range)
    table: dict[str, list[dict[str, Any]]] = {}
    for method, cs in curves.items():
        rows = []
        for kl in grid:
            golds = [g for g in (_gold_at(c, kl) for c in cs) if g is not None]
            mean, std = _mean_std(golds) if golds else (None, None)
            rows.append({"kl": kl, "gold_mean": mean, "gold_std": std, "seeds": len(golds)})
        table[method] = rows
    vs_ppo: dict[str, list[dict[str, Any]]] = {}
    if "ppo" in table:
        for method, rows in table.items():
            if method == "ppo":
                continue
            diffs = []
            for a, b in zip(table["ppo"], rows):
                if a["seeds"] >= 2 and b["seeds"] >= 2:
                    se = math.sqrt(a["gold_std"] ** 2 / a["seeds"] + b["gold_std"] ** 2 / b["seeds"])
                    diffs.append({"kl": a["kl"], "ppo_minus": a["gold_mean"] - b["gold_mean"], "se": se})
            vs_ppo[method] = diffs
    return {"kl_grid": grid, "methods": table, "vs_ppo": vs_ppo}


def vs_ppo_pairwise(methods: dict[str, Any], grid_points: int = 3, min_seeds: int = 2) -> dict[str, Any]:
    """Each method against PPO on the KL range *the two of them* share (:func:`matched_kl` on the pair):
    with many methods the range every one covers is often empty, while each still overlaps PPO. Per
    method: the grid KLs, PPO's and its gold (mean over seeds) and PPO minus it with its standard error."""
    out: dict[str, Any] = {}
    if "ppo" not in methods:
        return out
    for method, m in methods.items():
        mk = (
            None
            if method == "ppo"
            else matched_kl({"ppo": methods["ppo"], method: m}, grid_points, min_seeds)
        )
        if mk and mk["vs_ppo"].get(method):
            ppo_rows = {r["kl"]: r for r in mk["methods"]["ppo"]}
            other = {r["kl"]: r for r in mk["methods"][method]}
            out[method] = [d | {"ppo": ppo_rows[d["kl"]]["gold_mean"], method: other[d["kl"]]["gold_mean"]}
                           for d in mk["vs_ppo"][method]]  # fmt: skip
    return out


def gold_per_cpu(methods: dict[str, Any], sft_gold: float) -> dict[str, list[dict[str, Any]]]:
    """Per method and point: the gold gained over the SFT policy per CPU-minute of training (each seed's
    ``(gold - sft_gold) / train_cpu_seconds * 60``; mean and standard error over seeds), with the CPU
    seconds a run took. What a method buys per unit of compute, its critic (or its G samples) counted."""
    out: dict[str, list[dict[str, Any]]] = {}
    for method, m in methods.items():
        rows = []
        for p in m["points"]:
            rates = [(s["gold"] - sft_gold) / s["train_cpu_seconds"] * 60 for s in p["per_seed"]]
            mean, std = _mean_std(rates)
            cpu, _ = _mean_std([s["train_cpu_seconds"] for s in p["per_seed"]])
            rows.append({"point": p["point"], "gain_per_cpu_minute": mean,
                         "se": std / math.sqrt(len(rates)), "cpu_seconds": cpu, "seeds": len(rates)})  # fmt: skip
        out[method] = rows
    return out


def plot(frontier: dict[str, Any], path: Path) -> Path:
    """Two views: gold vs KL (one curve per method through its points, means, std over seeds as error
    bars) and gold vs training CPU seconds per run (each point's mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_cpu) = plt.subplots(1, 2, figsize=(11.5, 4.4))
    base = frontier["sft"]
    for method, colour in COLOURS.items():
        pts = sorted(frontier["methods"].get(method, {}).get("points", []), key=lambda p: p["kl_mean"])
        if not pts:
            continue
        cpu = [sum(s["train_cpu_seconds"] for s in p["per_seed"]) / len(p["per_seed"]) for p in pts]
        ax_cpu.errorbar(cpu, [p["gold_mean"] for p in pts], yerr=[p["gold_std"] for p in pts], marker="o",
                        linestyle="none", capsize=3, color=colour, label=method)  # fmt: skip
        cost = frontier["methods"][method]["train_seconds_per_run"]
        ax.errorbar(
            [base["kl"]] + [p["kl_mean"] for p in pts],
            [base["gold"]] + [p["gold_mean"] for p in pts],
            xerr=[0.0] + [p["kl_std"] for p in pts],
            yerr=[0.0] + [p["gold_std"] for p in pts],
            marker="o",
            capsize=3,
            color=colour,
            label=f"{method} ({cost:.0f} s/run)",
        )
        for p in pts:
            ax.annotate(
                p["point"],
                (p["kl_mean"], p["gold_mean"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
                color=colour,
            )
    ax.scatter([base["kl"]], [base["gold"]], color="black", zorder=5, label="SFT (reference)")
    ax.set_xlabel("KL(pi || pi_ref), nats per response (k1, held-out prompts)")
    ax.set_ylabel(f"gold ({frontier['gold_judge'].split(':')[-1]}), held-out mean")
    ax.set_title(
        f"{frontier['task']} frontier, {len(frontier['seeds'])} seed(s), budget {frontier['budget']}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_cpu.axhline(base["gold"], color="black", linewidth=0.8, label="SFT (reference)")
    ax_cpu.set_xlabel("training CPU seconds per run (all threads)")
    ax_cpu.set_ylabel("gold, held-out mean")
    ax_cpu.set_title("gold against compute (each point: one knob, mean over seeds)")
    ax_cpu.grid(alpha=0.3)
    ax_cpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------- the study


def _spread(labels: list[str], n: int | None) -> list[str]:
    """``n`` labels spread evenly over the list, first and last included (all when n is None or big)."""
    if n is None or n >= len(labels):
        return labels
    if n == 1:
        return [labels[len(labels) // 2]]
    return [labels[round(i * (len(labels) - 1) / (n - 1))] for i in range(n)]


def frontier(
    task: str,
    budget: str,
    seeds: int,
    out: Path,
    points: int | None = None,
    methods: tuple[str, ...] = METHODS,
    only: list[str] | None = None,
    name: str = "frontier",
    reward_url: str | None = None,
) -> dict[str, Any]:
    """Run (or continue) the frontier study in ``out``; returns the report (``out/<name>.json``).

    ``reward_url``: a ``shifu serve`` service that scores PPO's and REINFORCE's rollouts.
    ``only``: ``method:label`` items (e.g. ``ppo:beta=0.3``) — run just these points, instead of
    ``points`` per method of ``methods``.
    """
    from shifu.experiments.quickstart import GOLD

    if (task, budget) not in BUDGETS:
        choices = ", ".join(f"--task {t} --budget {b}" for t, b in BUDGETS)
        raise ShifuError(f"no frontier budget '{budget}' for task '{task}'. Choose: {choices}")
    if seeds < 1:
        raise ShifuError(f"--seeds must be >= 1 (got {seeds})")
    plan = BUDGETS[(task, budget)]
    if only:
        order = _select(plan, only)
        methods = tuple(order)
    else:
        order = {m: _spread(list(plan["points"][m]), points) for m in methods}
    t_start = time.time()
    reports = [f"{name}.json", f"{name}.png"]
    claim_run(out, "study", reports)  # held for the rest of the process
    shared = shared_stages(task, plan, out)
    if reward_url:  # PPO and REINFORCE scored by a reward service (DPO learns from the pairs as before)
        shared["reward"] = {"url": reward_url}
    e = plan["eval"]
    ev = {
        "rows": read_jsonl(shared["files"]["prompts_eval"])[: e["num_prompts"]],
        "gold": GOLD[task],
        "max_new_tokens": e["max_new_tokens"],
        "temperature": e["temperature"],
        "seed": 777,
        "max_prompt_len": e.get("max_prompt_len"),
    }
    from shifu.rewards.sources.sources import load_function

    base = measure(
        shared["sft"],
        shared["sft"],
        ev["rows"],
        load_function(ev["gold"], "gold judge"),
        ev["max_new_tokens"],
        ev["temperature"],
        ev["seed"],
        ev["max_prompt_len"],
    )
    results = [
        run_point(m, label, seed, plan, shared, out, ev)
        for seed in range(seeds)
        for m in methods
        for label in order[m]
    ]
    methods_report = aggregate(results, order)
    report = {
        "task": task,
        "budget": budget,
        "seeds": list(range(seeds)),
        "gold_judge": ev["gold"],
        "eval": {
            "prompts": len(ev["rows"]),
            "file": shared["files"]["prompts_eval"],
            "temperature": ev["temperature"],
            "max_new_tokens": ev["max_new_tokens"],
            "sampling_seed": ev["seed"],
            "kl": "k1, sum over response tokens, nats per response",
        },
        "sft": {"gold": base["gold"], "kl": base["kl"], "response_len": base["response_len"]},
        "pairs": shared["pairs_info"],
        "reward_model": shared.get("rm"),
        "shared_seconds": shared["seconds"],
        "methods": methods_report,
        "matched_kl": matched_kl(methods_report),
        "vs_ppo_pairwise": vs_ppo_pairwise(methods_report),
        "gold_per_cpu": gold_per_cpu(methods_report, base["gold"]),
        "settings": {m: {label: plan["points"][m][label] for label in order[m]} for m in methods},
        "seconds_total": round(time.time() - t_start, 1),
    }
    with writing(out, reports):
        (out / f"{name}.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        plot(report, out / f"{name}.png")
    return report


def _select(plan: dict, only: list[str]) -> dict[str, list[str]]:
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


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"SFT: gold {report['sft']['gold']:.3f} at KL {report['sft']['kl']:.2f}",
        f"{'method':10s} {'point':10s} {'gold':>14s} {'KL (nats)':>14s} {'s/run':>7s}",
    ]
    for method, m in report["methods"].items():
        for p in m["points"]:
            secs = sum(s["train_seconds"] for s in p["per_seed"]) / len(p["per_seed"])
            lines.append(
                f"{method:10s} {p['point']:10s} {p['gold_mean']:7.3f}±{p['gold_std']:.3f} "
                f"{p['kl_mean']:8.2f}±{p['kl_std']:.2f} {secs:7.0f}"
            )
    mk = report.get("matched_kl")
    if mk and mk["kl_grid"]:
        lines.append("gold at matched KL (each seed read along its own frontier; mean±std over seeds):")
        lines.append(f"{'KL (nats)':>10s} " + " ".join(f"{m:>16s}" for m in mk["methods"]))
        for i, kl in enumerate(mk["kl_grid"]):
            cells = []
            for rows in mk["methods"].values():
                r = rows[i]
                cells.append(
                    f"{r['gold_mean']:.3f}±{r['gold_std']:.3f} ({r['seeds']})" if r["seeds"] else "-"
                )
            lines.append(f"{kl:10.2f} " + " ".join(f"{c:>16s}" for c in cells))
        for method, diffs in mk["vs_ppo"].items():
            lines.append(
                f"ppo - {method}: "
                + ", ".join(f"{d['ppo_minus']:+.3f}±{d['se']:.3f} @ {d['kl']:.1f}" for d in diffs)
            )
    pairs = report.get("vs_ppo_pairwise") or {}
    if pairs:
        lines.append("PPO against each method on the KL range the two share (gold, PPO minus it ± s.e.):")
    for method, diffs in pairs.items():
        lines.append(f"ppo - {method}: " + ", ".join(f"{d['ppo_minus']:+.3f}±{d['se']:.3f} @ {d['kl']:.2f}"
                                                      for d in diffs))  # fmt: skip
    lines.append("gold gained over SFT per CPU-minute of training (mean±s.e. over seeds; CPU s/run):")
    for method, rows in report.get("gold_per_cpu", {}).items():
        lines.append(f"{method:14s} " + ", ".join(
            f"{r['point']} {r['gain_per_cpu_minute']:+.4f}±{r['se']:.4f} ({r['cpu_seconds']:.0f} s)" for r in rows))  # fmt: skip
    for method, m in report["methods"].items():
        if m.get("gold_std_at_kl") is not None:
            lines.append(
                f"{method}: gold std over seeds {m['mean_gold_std']:.3f} (mean over points), "
                f"at matched KL {m['gold_std_at_kl']:.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shifu study", description="studies over shifu's trainers")
    sub = ap.add_subparsers(dest="study", required=True)
    fp = sub.add_parser(
        "frontier", help="gold vs KL (and vs CPU seconds) for PPO, DPO, REINFORCE and the critic-free methods"
    )
    fp.add_argument("--task", choices=["arith", "imdb"], default="arith")
    fp.add_argument(
        "--budget", default=None, help="arith: full (default) or ci; imdb: reduced (default) or smoke"
    )
    fp.add_argument("--seeds", type=int, default=3, help="seeds per point (default 3)")
    fp.add_argument(
        "--points", type=int, default=None, help="points per method (default: all of the budget's)"
    )
    fp.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}"
    )
    fp.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="METHOD:POINT",
        help="run just these points, e.g. --only ppo:beta=0.3 reinforce:beta=0.02 (overrides --points/--methods)",
    )
    fp.add_argument(
        "--name",
        default="frontier",
        help="report file names in --out: NAME.json, NAME.png (default frontier)",
    )
    fp.add_argument("--out", default=None, help="study directory (default runs/frontier-TASK-BUDGET)")
    fp.add_argument(
        "--reward-url",
        default=None,
        help="score PPO and REINFORCE with this reward service (`shifu serve`) instead of the task's reward",
    )
    fp.add_argument("--threads", type=int, default=None, help="torch CPU threads (default SHIFU_THREADS)")
    fp.add_argument(
        "--print-config",
        action="store_true",
        help="print the budget as the study runs it (YAML) and exit; nothing is run or written",
    )
    args = ap.parse_args(argv)
    from shifu.parallel.threads import set_threads

    set_threads(args.threads)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ShifuError(
            f"--methods: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(METHODS)}"
        )
    budget = args.budget or DEFAULT_BUDGET[args.task]
    if args.print_config:
        plan = resolved_budget(args.task, budget_of(args.task, budget))
        print(
            plan_yaml(plan, f"shifu study frontier budget: {shipped('study', f'{args.task}-{budget}.yaml')}"),
            end="",
        )
        return 0
    out = Path(args.out or f"runs/frontier-{args.task}-{budget}")
    from shifu.runs.checkpoint import release_run_dirs

    try:
        report = frontier(
            args.task, budget, args.seeds, out, args.points, methods, args.only, args.name, args.reward_url
        )
    finally:
        release_run_dirs()
    print(_table(report))
    print(
        f"frontier: {out / (args.name + '.json')}, plot: {out / (args.name + '.png')}; "
        f"{report['seconds_total']:.0f} s"
    )
    return 0

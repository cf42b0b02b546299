"""``shifu study frontier``: gold score against KL to the reference (and against training CPU seconds) for
PPO, DPO, REINFORCE and the critic-free methods (GRPO, RLOO, REINFORCE++: :func:`critic_free`).

Every method starts from the **same** SFT policy (also the frozen reference), learns from the same judge (PPO
and REINFORCE through their reward, DPO through preference pairs that judge labelled), and is measured the
same way by :func:`~shifu.study.runs.measure`: one sample per held-out prompt (the task's
``prompts_eval.jsonl``, never trained on), at the same temperature, from the same sampling seed; ``gold`` =
mean gold-judge score; ``kl`` = mean over prompts of ``sum_t log pi(a_t|s_t) - log pi_ref(a_t|s_t)`` over the
policy's own response tokens (k1, **nats per response**). A method's "KL budget" is its knob: a fixed beta for
PPO and REINFORCE (``kl.controller=fixed``), beta of DPO.

Run directory (``--out``, default ``runs/frontier-<task>-<budget>``)::

    OUT/shared/data/  sft/  pairs/  [rm/]   task files, the SFT policy, preference pairs, imdb reward model
    OUT/runs/<method>-<point>-s<seed>/      one training run each, with RESULT.json (gold, kl, seconds)
    OUT/frontier.json                       every point, per seed and mean/std, cost per method
    OUT/frontier.png                        gold vs KL, one curve per method (mean, std bars over seeds)

(``--name NAME`` writes NAME.json / NAME.png instead; ``--only METHOD:POINT ...`` runs just those points,
e.g. more seeds at a few points, reusing the shared stages and finished runs of the directory.)

Finished stages and runs are kept (``DONE`` / ``RESULT.json`` markers, each with the plan it ran):
rerunning with the same ``--out`` continues, a finished one whose plan differs is refused by key, and a run
stopped with a checkpoint (Ctrl-C) resumes from it (:mod:`shifu.pipelines.stages`). Seeds
change the RL/DPO run (sampling, shuffling); the SFT policy and the pairs are shared, so the spread over
seeds is the method's own variance.

The shared stages, one trained point and the measurement are :mod:`shifu.study.runs`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from shifu.config.loader import shipped
from shifu.errors import ShifuError
from shifu.pipelines.quickstart import plan_yaml
from shifu.pipelines.run_dirs import claim_run, writing
from shifu.runs.jsonfile import read_jsonl
from shifu.study.analysis import (
    aggregate,
    gold_per_cpu,
    matched_kl,
    plot,
    summary_table,
    vs_ppo_pairwise,
)
from shifu.study.budgets import (
    BUDGETS,
    DEFAULT_BUDGET,
    METHODS,
    budget_of,
    resolved_budget,
    select_points,
)
from shifu.study.runs import measure, run_point, shared_stages

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
    from shifu.pipelines.quickstart import GOLD

    if (task, budget) not in BUDGETS:
        choices = ", ".join(f"--task {t} --budget {b}" for t, b in BUDGETS)
        raise ShifuError(f"no frontier budget '{budget}' for task '{task}'. Choose: {choices}")
    if seeds < 1:
        raise ShifuError(f"--seeds must be >= 1 (got {seeds})")
    plan = BUDGETS[(task, budget)]
    if only:
        order = select_points(plan, only)
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
    from shifu.config.imports import load_callable

    base = measure(
        shared["sft"],
        shared["sft"],
        ev["rows"],
        load_callable(ev["gold"], "gold judge"),
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
    print(summary_table(report))
    print(
        f"frontier: {out / (args.name + '.json')}, plot: {out / (args.name + '.png')}; "
        f"{report['seconds_total']:.0f} s"
    )
    return 0

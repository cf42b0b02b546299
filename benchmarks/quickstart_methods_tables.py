"""The tables of ``benchmarks/quickstart_methods.py``'s records: the default plans over seeds (``quickstart``,
``quickstart-runs``), and methods compared over seeds on arith (``arith-methods``) and on imdb with dense
rewards (``critic-dense``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from table_parts import (
    METHOD,
    by_key,
    commit_label,
    cpu_label,
    footer,
    gold_cell,
    md,
    metric,
    pm,
    se,
    select,
    span,
    time_cell,
)

GOLD = {"arith": "exact match", "imdb": "VADER"}


def default_runs(records: list[dict]) -> list[dict]:
    """Runs of a task's default plan; the SmolLM2 presets have a table of their own (``smollm2``)."""
    return [
        r
        for r in select(records, "quickstart")
        if r["params"].get("plan") == "default"
        and not r["params"].get("rejudged")
        and r["params"].get("preset") != "smollm2"
    ]


def task_cell(r: dict) -> str:
    p = r["params"]
    label = p.get("plan_label")
    return f"{p['task']} `{p['preset']}`" + (f" ({label})" if label else "")


def quickstart(records: list[dict]) -> str:
    """Per task and CPU: the default plan of the newest commit measured on >= 3 seeds (else the newest)."""
    groups = by_key(default_runs(records), lambda r: (r["params"]["task"], cpu_label(r), r["commit"]))
    chosen: dict[tuple, list[dict]] = {}
    for (task, cpu, _), recs in sorted(groups.items(), key=lambda kv: max(r["date"] for r in kv[1])):
        seeds = {r["params"]["seed"] for r in recs}
        old = chosen.get((task, cpu))
        if old is None or len(seeds) >= 3 or len({r["params"]["seed"] for r in old}) < 3:
            chosen[(task, cpu)] = sorted(recs, key=lambda r: r["params"]["seed"])
    rows = []
    for (task, cpu), recs in sorted(chosen.items()):
        gains = [metric(r, "gold_gain") for r in recs]
        ses = [metric(r, "gold_gain_se") for r in recs]
        before = [metric(r, "gold_before") for r in recs]
        after = [metric(r, "gold_after") for r in recs]
        kls = [metric(r, "kl") for r in recs]
        rows.append(
            [
                task_cell(recs[0]),
                ", ".join(str(r["params"]["seed"]) for r in recs),
                f"{GOLD[task]} {statistics.mean(before):.3f} → {statistics.mean(after):.3f}",
                f"{pm(statistics.mean(gains), se(gains))} (each ± {span(ses, '.3f')})",
                f"{min(kls):.2f}-{max(kls):.2f}",
                time_cell(recs),
                cpu,
                commit_label(recs[0]),
            ]
        )
    used = [r for recs in chosen.values() for r in recs]
    return md(
        [
            "task (plan)",
            "seeds",
            "gold before → after (mean)",
            "gain: mean ± s.e. over seeds",
            "KL (nats)",
            "time per run",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(used)


def quickstart_runs(records: list[dict]) -> str:
    """Every recorded run of a default plan, one row per seed: what one run of yours can be compared with."""
    recs = sorted(
        default_runs(records),
        key=lambda r: (r["params"]["task"], cpu_label(r), r["date"], r["params"]["seed"]),
    )
    rows = [
        [
            task_cell(r),
            r["params"]["seed"],
            gold_cell(r),
            pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
            f"{metric(r, 'kl'):.2f}",
            metric(r, "eval_prompts", default="-"),
            time_cell([r]),
            cpu_label(r),
            commit_label(r),
        ]
        for r in recs
    ]
    return md(
        [
            "task (plan)",
            "seed",
            "gold before → after",
            "gain ± paired s.e.",
            "KL (nats)",
            "held-out prompts",
            "time",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


def seed_table(recs: list[dict]) -> dict[str, dict[int, dict]]:
    """method -> seed -> record, methods in :data:`METHOD` order."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in recs:
        out[r["params"]["method"]][r["params"]["seed"]] = r
    order = list(METHOD)
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def slope_adjusted(
    runs: dict[str, dict[int, dict]], base: str = "ppo"
) -> tuple[float, dict[str, list[float]]]:
    """The gain-KL slope pooled within methods, and each method's per-seed difference from ``base`` moved
    along it to ``base``'s KL."""
    num = den = 0.0
    for seeds in runs.values():
        kls = [metric(r, "kl") for r in seeds.values()]
        gs = [metric(r, "gold_gain") for r in seeds.values()]
        mk, mg = statistics.mean(kls), statistics.mean(gs)
        num += sum((k - mk) * (g - mg) for k, g in zip(kls, gs))
        den += sum((k - mk) ** 2 for k in kls)
    slope = num / den if den else 0.0
    adj = {}
    for method, seeds in runs.items():
        common = sorted(set(seeds) & set(runs[base]))
        adj[method] = [
            metric(seeds[s], "gold_gain")
            - metric(runs[base][s], "gold_gain")
            - slope * (metric(seeds[s], "kl") - metric(runs[base][s], "kl"))
            for s in common
        ]
    return slope, adj


def critic_dense(records: list[dict]) -> str:
    recs = select(records, "quickstart", "dense-critic", task="imdb")
    recs = [r for r in recs if r["params"].get("method") and r["params"].get("plan") != "default"]
    summaries = {r["params"]["method"]: r for r in select(records, "quickstart_methods", "dense-critic")}
    runs = seed_table(recs)
    slope, adj = slope_adjusted(runs)
    rows = []
    for method, seeds in runs.items():
        ss = sorted(seeds)
        gains = [metric(seeds[s], "gold_gain") for s in ss]
        kls = [metric(seeds[s], "kl") for s in ss]
        paired = [g - metric(runs["ppo"][s], "gold_gain") for s, g in zip(ss, gains)]
        summ = summaries.get(method, {"metrics": {}})
        rl = summ["metrics"].get("rl_cpu_seconds_mean")
        per_min = summ["metrics"].get("gain_per_rl_cpu_minute")
        first = seeds[ss[0]]
        rows.append(
            [
                METHOD.get(method, method),
                " / ".join(f"{g:+.3f}" for g in gains),
                pm(statistics.mean(gains), se(gains)),
                " / ".join(f"{k:.2f}" for k in kls),
                "-" if rl is None else f"{rl:.0f}",
                "-" if per_min is None else f"{per_min:.3f}",
                "—" if method == "ppo" else pm(statistics.mean(paired), se(paired)),
                "—" if method == "ppo" else pm(statistics.mean(adj[method]), se(adj[method])),
                cpu_label(first),
                commit_label(first),
            ]
        )
    return md(
        [
            "method",
            "gain per seed",
            "mean ± s.e. over seeds",
            "KL per seed (nats)",
            "RL stage CPU s (mean)",
            "gain per RL CPU-minute",
            "− PPO, paired by seed",
            "− PPO at PPO's KL",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(
        recs + list(summaries.values()),
        f"At PPO's KL: each seed's difference moved along the gain-KL slope fitted within methods "
        f"({slope:.3f} gold per nat). ",
    )


def arith_methods(records: list[dict]) -> str:
    recs = select(records, "quickstart", "arith-methods", task="arith")
    rows = []
    for same in (False, True):
        runs = seed_table([r for r in recs if r["params"].get("same_prompts", False) == same])
        for method, seeds in runs.items():
            ss = sorted(seeds)
            gains = [metric(seeds[s], "gold_gain") for s in ss]
            group = any(s.startswith("ppo.group_size") for s in seeds[ss[0]]["params"]["sets"])
            batch = (
                "512 (128 prompts x 4)"
                if same
                else ("128 (32 prompts x 4)" if group else "128 (128 prompts)")
            )
            wall = [metric(seeds[s], "seconds_total") for s in ss]
            rows.append(
                [
                    METHOD.get(method, method),
                    batch,
                    " / ".join(f"{g:+.3f}" for g in gains),
                    pm(statistics.mean(gains), se(gains)),
                    sum(g >= 0.15 for g in gains),
                    " / ".join(f"{metric(seeds[s], 'kl'):.1f}" for s in ss),
                    f"{min(wall):.0f}-{max(wall):.0f}",
                    cpu_label(seeds[ss[0]]),
                    commit_label(seeds[ss[0]]),
                ]
            )
    return md(
        [
            "method",
            "responses per iteration",
            "gain seed 0 / 1 / 2",
            "mean ± s.e. over seeds",
            "seeds ≥ +0.15",
            "KL (nats)",
            "s wall per run",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "quickstart": quickstart,
    "quickstart-runs": quickstart_runs,
    "critic-dense": critic_dense,
    "arith-methods": arith_methods,
}

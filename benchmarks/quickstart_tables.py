"""The tables of ``shifu quickstart`` runs recorded with their own command (``benchmarks/results/quickstart.jsonl``
and ``arith_tool.jsonl``): arith_tool per method and environment, single-setting variants of the imdb
``small`` plan, its reward models, and bf16.
"""

from __future__ import annotations

import statistics

from table_parts import (
    by_key,
    commit_label,
    cpu_label,
    fmt,
    footer,
    md,
    metric,
    none_yet,
    pm,
    se,
    select,
    sets_label,
    time_cell,
)


def arith_tool(records: list[dict]) -> str:
    """``shifu quickstart --task arith_tool`` per method and environment: the seeds' mean accuracy before and
    after, the gain's mean ± its standard error over seeds, the calculator use, the CPU time of each run."""
    return tool_runs(records, "arith_tool")


def arith_chain(records: list[dict]) -> str:
    """The same for ``--task arith_chain`` (two calculator calls in sequence)."""
    return tool_runs(records, "arith_chain")


def tool_runs(records: list[dict], task: str) -> str:
    """``benchmarks/arith_tool_runs.py``'s records of ``task`` (its benchmark name)."""
    recs = select(records, task)
    if not recs:
        return none_yet(task, f"python benchmarks/arith_tool_runs.py --task {task} --record", "")
    groups = by_key(recs, lambda r: (r["params"]["env"], r["params"]["method"], cpu_label(r), r["commit"]))
    rows = []
    for (env, method, cpu, _), rs in sorted(
        groups.items(),
        key=lambda kv: (kv[0][0] != "shifu.tasks.arith_tool:calculator_env", kv[0][1] != "ppo"),
    ):
        rs = sorted(rs, key=lambda r: r["params"]["seed"])
        gains, ses = [metric(r, "gold_gain") for r in rs], [metric(r, "gold_gain_se") for r in rs]
        mean = statistics.mean
        gain = pm(mean(gains), se(gains)) if len(rs) > 1 else pm(gains[0], ses[0]) + " (paired over prompts)"
        rows.append(
            [
                {
                    "ppo": "PPO (critic)",
                    "grpo": "GRPO (`group_size=4`)",
                    "ppo-lockstep": "PPO (critic), turns in lockstep (`generation.kv_budget_mb=0`)",
                }.get(method, method),
                f"`{env}`",
                ", ".join(str(r["params"]["seed"]) for r in rs),
                f"{mean(metric(r, 'gold_before') for r in rs):.3f} → {mean(metric(r, 'gold_after') for r in rs):.3f}",
                gain,
                f"{mean(metric(r, 'tool_use_before') for r in rs):.3f} → {mean(metric(r, 'tool_use_after') for r in rs):.3f}",
                braces_cell(rs),
                time_cell(rs),
                cpu,
                commit_label(rs[0]),
            ]
        )
    headers = [
        "method",
        "environment",
        "seeds",
        "accuracy before → after (mean)",
        "gain: mean ± s.e. over seeds",
        "calculator use before → after",
        "episodes whose policy wrote `{`/`}` after",
        "time per run",
        "CPU",
        "commit",
    ]
    return md(headers, rows) + footer(recs)


def braces_cell(rs: list[dict]) -> str:
    """Held-out episodes after RL in which the policy wrote the calculator's output syntax, over all seeds."""
    counts = [metric(r, "braces_written_after") for r in rs]
    if any(c is None for c in counts):
        return "not counted"
    return f"{sum(counts)} of {sum(metric(r, 'eval_prompts') for r in rs)}"


# settings the imdb `small` plan (MiniLM era) already had, recorded in full by some runs
PLAN_IMDB = (
    "ppo.batch_size=64",
    "ppo.minibatch_size=32",
    "ppo.ppo_epochs=4",
    "ppo.algo=ppo",
    "ppo.loss_aggregation=token_mean",
    "ppo.ent_coef=0.0",
    "ppo.optim.warmup_steps=0",
    "ppo.optim.betas=[0.9,0.95]",
    "ppo.kl.target=7.0",
    "ppo.kl.horizon=2000",
    "ppo.lora.alpha=32.0",
    "ppo.lora.dropout=0.0",
    "ppo.lora.critic=false",
    "ppo.lora.enabled=true",
)


def gain_row(r: dict, label: str) -> list:
    g, kl = metric(r, "gold_gain"), metric(r, "kl")
    cpu = metric(r, "cpu_seconds_total")
    return [
        label,
        r["params"]["seed"],
        pm(g, metric(r, "gold_gain_se")),
        f"{kl:.2f}",
        f"{g / kl:.3f}",
        metric(r, "eval_prompts", default="-"),
        "-" if cpu is None else f"{cpu:.0f}",
        cpu_label(r),
        commit_label(r),
    ]


def imdb_variants(records: list[dict]) -> str:
    """Every single-setting run of the imdb ``small`` quickstart with the MiniLM reward model, by KL."""
    recs = select(records, "quickstart", ("imdb-variants", "imdb-soups", "imdb-bf16"), task="imdb")
    recs = [
        r
        for r in recs
        if "before the LoRA decoding fix" not in (r.get("note") or "")
        and r["params"].get("plan") != "default"
    ]
    recs.sort(key=lambda r: metric(r, "kl"))
    rows = [
        gain_row(
            r,
            sets_label(r["params"]["sets"], PLAN_IMDB)
            + (" (re-judged)" if r["params"].get("rejudged") else ""),
        )
        for r in recs
    ]
    return md(
        [
            "settings (`--set`, ppo. left out)",
            "seed",
            "gain ± paired s.e.",
            "KL (nats)",
            "gain per nat",
            "held-out prompts",
            "CPU s (pipeline)",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


MINILM_DROP = (
    "ppo.advantage_estimator=",
    "ppo.kl.controller=fixed",
    "ppo.kl.init_coef=0.25",
    "ppo.group_size=",
    "ppo.kl.penalty=",
    "ppo.optim.lr=",
    "ppo.iterations=",
)  # the GRPO setting, in the footer


RM_DROP = (
    "ppo.advantage_estimator=",
    "ppo.group_size=",
    "ppo.kl.penalty=",
    "ppo.optim.lr=",
    "ppo.iterations=",
    "rm.batch_size=",
    "rm.optim.lr=0.05",
    "rm.epochs=",
    "rm.l2_coef=",
    "ppo.reward.dense=",
)


def imdb_reward_models(records: list[dict]) -> str:
    recs = select(records, "quickstart", "imdb-reward-models", task="imdb")
    recs.sort(
        key=lambda r: (
            r["params"]["sets"][:1] == ["rm.model.path=bag-of-tokens"]
            or "rm.model.path=bag-of-tokens" in r["params"]["sets"],
            metric(r, "kl"),
        )
    )
    rows = []
    for r in recs:
        bow = "rm.model.path=bag-of-tokens" in r["params"]["sets"]
        sets = [s for s in r["params"]["sets"] if s != "rm.model.path=bag-of-tokens"]
        rm = ("bag of tokens, dense rewards" if bow else "MiniLM") + (
            " (12000 prompts)" if "pairs.num_prompts=12000" in sets else ""
        )
        label = sets_label(
            [s for s in sets if s != "pairs.num_prompts=12000"], RM_DROP if bow else MINILM_DROP
        )
        g = metric(r, "gold_gain")
        rows.append(
            [
                rm,
                label,
                r["params"]["seed"],
                pm(g, metric(r, "gold_gain_se")),
                f"{metric(r, 'kl'):.2f}",
                f"{metric(r, 'rm_accuracy'):.2f}",
                f"{metric(r, 'cpu_seconds_total'):.0f}",
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "reward model",
            "other settings",
            "seed",
            "gain ± paired s.e.",
            "KL (nats)",
            "RM held-out acc.",
            "CPU s (pipeline)",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(
        recs,
        "MiniLM rows run the GRPO setting `advantage_estimator=grpo group_size=4 kl.penalty=loss "
        "kl.controller=fixed kl.init_coef=0.25 optim.lr=1.5e-4 iterations=80`; bag-of-tokens rows PPO with `rm.batch_size=64 rm.optim.lr=0.05 "
        "rm.epochs=10 rm.l2_coef=1e-3 ppo.reward.dense=true`. ",
    )


def quickstart_bf16(records: list[dict]) -> str:
    recs = sorted(
        select(records, "quickstart", "imdb-bf16", task="imdb"),
        key=lambda r: (len(r["params"]["sets"]), r["params"]["seed"]),
    )
    rows = []
    for r in recs:
        c = metric(r, "cpu_seconds", default={})
        ppo = sum(v for k, v in c.items() if k == "ppo" or k.startswith("ppo-"))
        rows.append(
            [
                sets_label(r["params"]["sets"]),
                r["params"]["seed"],
                fmt(c.get("rm"), ".0f"),
                f"{ppo:.0f}",
                f"{metric(r, 'cpu_seconds_total'):.0f}",
                pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
                f"{metric(r, 'kl'):.2f}",
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "settings",
            "seed",
            "reward model CPU s",
            "PPO CPU s (all runs)",
            "pipeline CPU s",
            "gain ± s.e.",
            "KL (nats)",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "arith-tool": arith_tool,
    "arith-chain": arith_chain,
    "imdb-variants": imdb_variants,
    "imdb-reward-models": imdb_reward_models,
    "quickstart-bf16": quickstart_bf16,
}

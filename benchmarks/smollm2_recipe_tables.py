"""The table of ``benchmarks/smollm2_recipe.py --record``'s runs: the SmolLM2-135M presets, one row per run."""

from __future__ import annotations

from table_parts import (
    commit_label,
    cpu_label,
    fmt,
    footer,
    gold_cell,
    md,
    metric,
    none_yet,
    pm,
    select,
    time_cell,
)


def smollm2(records: list[dict]) -> str:
    """The SmolLM2-135M recipe (``benchmarks/smollm2_recipe.py --record``), one row per run."""
    recs = sorted(
        [r for r in select(records, "quickstart", preset="smollm2") if r.get("series") not in EQUIVALENCE],
        key=lambda r: (r["params"]["task"], r["date"], r["params"]["seed"]),
    )
    if not recs:
        return none_yet("quickstart", "python benchmarks/smollm2_recipe.py --jobs 2 --record", "`smollm2` ")
    rows = [
        [
            r["params"]["task"],
            r["params"]["seed"],
            gold_cell(r),
            pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
            fmt(metric(r, "gain_in_se"), ".1f"),
            f"{metric(r, 'kl'):.2f}",
            tool_use_cell(r),
            time_cell([r]),
            fmt(metric(r, "peak_rss_mb"), ".0f"),
            cpu_label(r),
            commit_label(r),
        ]
        for r in recs
    ]
    headers = [
        "task",
        "seed",
        "gold before → after",
        "gain ± paired s.e.",
        "gain / s.e.",
        "KL (nats)",
        "tool use before → after",
        "time",
        "peak RSS (MiB)",
        "CPU",
        "commit",
    ]
    return md(headers, rows) + footer(recs)


def tool_use_cell(r: dict) -> str:
    before, after = metric(r, "tool_use_before"), metric(r, "tool_use_after")
    return "-" if before is None or after is None else f"{before:.3f} → {after:.3f}"


# (the estimator as the table names it, the environment's series, the agent's series); the environment side
# (arith_tool_agent:environment) reads the agent's first input
EQUIVALENCE = (
    ("PPO, learned critic (GAE)", "agent-equivalence-critic-env", "agent-equivalence-critic-agent"),
    ("RLOO (the preset's)", "agent-equivalence-rloo-env", "agent-equivalence-rloo-agent"),
)


def agent_equivalence(records: list[dict]) -> str:
    """``arith_tool --preset smollm2`` per estimator and seed, through the in-process environment
    (``arith_tool_agent:environment``) and through an agent written against the ``openai`` client
    (``examples/agents/arith_tool_agent.py``), both reading the same first input: the two gains, their
    difference with its standard error (independent runs), the ratio of the runs' process CPU time and their
    peak memory."""
    rows, recs = [], []
    for estimator, env_series, agent_series in EQUIVALENCE:
        env, agent = (
            {r["params"]["seed"]: r for r in select(records, "quickstart", series=name)}
            for name in (env_series, agent_series)
        )
        for seed in sorted(set(env) & set(agent)):
            e, a = env[seed], agent[seed]
            recs += [e, a]
            diff = metric(a, "gold_gain") - metric(e, "gold_gain")
            diff_se = (metric(a, "gold_gain_se") ** 2 + metric(e, "gold_gain_se") ** 2) ** 0.5
            rows.append(
                [
                    estimator,
                    seed,
                    gold_cell(e),
                    gold_cell(a),
                    pm(metric(e, "gold_gain"), metric(e, "gold_gain_se"))
                    + f" ({metric(e, 'gain_in_se'):.1f} s.e.)",
                    pm(metric(a, "gold_gain"), metric(a, "gold_gain_se"))
                    + f" ({metric(a, 'gain_in_se'):.1f} s.e.)",
                    f"{pm(diff, diff_se)} ({abs(diff) / diff_se:.1f} s.e.)",
                    f"{metric(e, 'cpu_seconds_total'):.0f} / {metric(a, 'cpu_seconds_total'):.0f}",
                    f"{metric(a, 'cpu_seconds_total') / metric(e, 'cpu_seconds_total'):.2f}x",
                    f"{metric(e, 'peak_rss_mb'):.0f} / {metric(a, 'peak_rss_mb'):.0f}",
                    f"{commit_label(e)} / {commit_label(a)}",
                ]
            )
    if not rows:
        return none_yet(
            "quickstart", "python benchmarks/smollm2_recipe.py ... --series agent-equivalence-critic-agent"
        )
    headers = ["estimator", "seed", "environment: before → after", "agent: before → after"]
    headers += ["environment: gain ± s.e.", "agent: gain ± s.e.", "agent - environment"]
    headers += ["CPU s (environment / agent)", "CPU ratio", "peak RSS MiB (environment / agent)", "commits"]
    return md(headers, rows) + footer(recs, f"CPU: {cpu_label(recs[0])}. ")


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "smollm2": smollm2,
    "agent-equivalence": agent_equivalence,
}

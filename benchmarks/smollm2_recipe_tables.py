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

from shifu.core.stats import mean_se


def smollm2(records: list[dict]) -> str:
    """The SmolLM2-135M recipe (``benchmarks/smollm2_recipe.py --record``), one row per run of a preset as it
    ships (no ``--set``: the agent-equivalence runs change the plan and have a table of their own)."""
    recs = sorted(
        [r for r in select(records, "quickstart", preset="smollm2") if not r["params"].get("sets")],
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
# (arith_tool_agent:environment) reads the agent's first input. In the series marked "broken calls answered" the
# environment answered a <tool_call> that does not parse with an error and went on, where the agent's episode
# ends (arith_tool_agent.environment has ended it too since invalid_calls="answer")
EQUIVALENCE = (
    (
        "PPO, critic from a zero head (GAE)",
        "agent-equivalence-zero-critic2-env",
        "agent-equivalence-zero-critic-agent",
    ),
    (
        "PPO, critic from a zero head (GAE); broken calls answered",
        "agent-equivalence-zero-critic-env",
        "agent-equivalence-zero-critic-agent",
    ),
    (
        "PPO, critic from a random head (GAE); broken calls answered",
        "agent-equivalence-critic-env",
        "agent-equivalence-critic-agent",
    ),
    (
        "RLOO (the preset's); broken calls answered",
        "agent-equivalence-rloo-env",
        "agent-equivalence-rloo-agent",
    ),
)


def agent_equivalence(records: list[dict]) -> str:
    """``arith_tool --preset smollm2`` per estimator and seed, through the in-process environment
    (``arith_tool_agent:environment``) and through an agent written against the ``openai`` client
    (``examples/agents/arith_tool_agent.py``), both reading the same first input: the two gains, their
    difference with its standard error (independent runs), the ratio of the runs' process CPU time and their
    peak memory, on the CPU the two ran on. An estimator with several seeds gets a row of their mean: the mean
    gain over the seeds, its standard error from the seeds' paired ones (sqrt(sum se^2) / n), the CPU time
    summed, the largest peak, and a second standard error of the difference read off the seeds' own spread
    (the standard deviation of the per-seed differences / sqrt(n), from three seeds up). The first counts only
    the held-out evaluation's noise; the second also counts how differently two training runs of one seed go
    (their sampled episodes differ: the gateway and the environment draw from their own generators)."""
    rows, recs = [], []
    for estimator, env_series, agent_series in EQUIVALENCE:
        env, agent = by_seed(records, env_series), by_seed(records, agent_series)
        seeds = sorted(set(env) & set(agent))
        for seed in seeds:
            recs += [env[seed], agent[seed]]
            rows.append(equivalence_row(estimator, str(seed), [env[seed]], [agent[seed]]))
        if len(seeds) > 1:
            label = f"mean of {len(seeds)}"
            rows.append(equivalence_row(estimator, label, [env[s] for s in seeds], [agent[s] for s in seeds]))
    if not rows:
        return none_yet(
            "quickstart", "python benchmarks/smollm2_recipe.py ... --series agent-equivalence-critic-agent"
        )
    headers = ["estimator", "seed", "environment: before → after", "agent: before → after"]
    headers += ["environment: gain ± s.e.", "agent: gain ± s.e.", "agent - environment"]
    headers += ["agent - environment ± s.e. of the seeds"]
    headers += [
        "CPU s (environment / agent)",
        "CPU ratio",
        "peak RSS MiB (environment / agent)",
        "CPU",
        "commits",
    ]
    return md(headers, rows) + footer(recs)


def by_seed(records: list[dict], series: str) -> dict[int, dict]:
    """The quickstart records of ``series`` by their seed."""
    return {r["params"]["seed"]: r for r in select(records, "quickstart", series=series)}


def difference_cell(diff: float, se: float) -> str:
    return pm(diff, se) + in_se(abs(diff), se)


def in_se(x: float, se: float) -> str:
    """``x`` in standard errors, as a cell's suffix; nothing when the standard error is 0 (a seed whose runs
    answered every held-out prompt alike, before and after: a gain of exactly 0)."""
    return f" ({x / se:.1f} s.e.)" if se > 0 else ""


def equivalence_row(estimator: str, seed: str, env: list[dict], agent: list[dict]) -> list[str]:
    """One row of the agent-equivalence table: the runs of one seed, or the mean over several."""

    def mean(recs: list[dict], name: str) -> float:
        return sum(metric(r, name) for r in recs) / len(recs)

    def gain(recs: list[dict]) -> tuple[float, float]:
        se = sum(metric(r, "gold_gain_se") ** 2 for r in recs) ** 0.5 / len(recs)
        return mean(recs, "gold_gain"), se

    def gain_cell(recs: list[dict]) -> str:
        g, se = gain(recs)
        return pm(g, se) + in_se(g, se)

    (eg, ese), (ag, ase) = gain(env), gain(agent)
    diff, diff_se = ag - eg, (ase**2 + ese**2) ** 0.5
    cpu_env, cpu_agent = (sum(metric(r, "cpu_seconds_total") for r in recs) for recs in (env, agent))
    spread = "-"
    if len(env) >= 3:
        spread = difference_cell(
            *mean_se([metric(a, "gold_gain") - metric(e, "gold_gain") for e, a in zip(env, agent)])
        )
    commits = sorted({commit_label(r) for r in env}), sorted({commit_label(r) for r in agent})
    cpus = "; ".join(dict.fromkeys(cpu_label(r) for r in env + agent))
    return [
        estimator,
        seed,
        f"{mean(env, 'gold_before'):.3f} → {mean(env, 'gold_after'):.3f}",
        f"{mean(agent, 'gold_before'):.3f} → {mean(agent, 'gold_after'):.3f}",
        gain_cell(env),
        gain_cell(agent),
        difference_cell(diff, diff_se),
        spread,
        f"{cpu_env:.0f} / {cpu_agent:.0f}",
        f"{cpu_agent / cpu_env:.2f}x",
        f"{max(metric(r, 'peak_rss_mb') for r in env):.0f} / {max(metric(r, 'peak_rss_mb') for r in agent):.0f}",
        cpus,
        f"{', '.join(commits[0])} / {', '.join(commits[1])}",
    ]


# (the estimator as the table names it, the agent path's series, the same runs' series again)
AGENT_REPEATS = (
    (
        "PPO, critic from a zero head (GAE)",
        "agent-equivalence-zero-critic-agent",
        "agent-equivalence-zero-critic-repeat-agent",
    ),
)


def agent_repeats(records: list[dict]) -> str:
    """The agent path's runs of one seed made twice with the same command: the agent's rollouts are not
    bit-reproducible (calls are batched as they arrive), so the two gains differ by the spread between training
    runs as well as by the evaluation's noise; their difference's standard error is the evaluation's alone."""
    rows, recs = [], []
    for estimator, first_series, again_series in AGENT_REPEATS:
        first, again = by_seed(records, first_series), by_seed(records, again_series)
        for seed in sorted(set(first) & set(again)):
            a, b = first[seed], again[seed]
            recs += [a, b]
            (ga, sa), (gb, sb) = ((metric(r, "gold_gain"), metric(r, "gold_gain_se")) for r in (a, b))
            diff, diff_se = gb - ga, (sa**2 + sb**2) ** 0.5
            rows.append(
                [
                    estimator,
                    str(seed),
                    pm(ga, sa),
                    pm(gb, sb),
                    difference_cell(diff, diff_se),
                    f"{metric(a, 'cpu_seconds_total'):.0f} / {metric(b, 'cpu_seconds_total'):.0f}",
                    "; ".join(dict.fromkeys(cpu_label(r) for r in (a, b))),
                    f"{commit_label(a)} / {commit_label(b)}",
                ]
            )
    if not rows:
        return none_yet(
            "quickstart",
            "python benchmarks/smollm2_recipe.py ... --series agent-equivalence-zero-critic-repeat-agent",
        )
    headers = ["estimator", "seed", "agent: gain ± s.e.", "agent again: gain ± s.e.", "again - first"]
    headers += ["CPU s (first / again)", "CPU", "commits"]
    return md(headers, rows) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "smollm2": smollm2,
    "agent-equivalence": agent_equivalence,
    "agent-repeat": agent_repeats,
}

"""The table of ``benchmarks/arith_tool_agents.py``'s records: per path, critic head and seed, the untrained base
model, the SFT start and the final policy on the held-out prompts, the gain of RL and the gain over the base, then
each path's mean over its seeds. A seed recorded more than once shows its newest record."""

from __future__ import annotations

import math

from table_parts import commit_label, cpu_label, fmt, footer, md, none_yet, pm, se, select

PATH = {
    "env": "environment (`calculator_env`)",
    "env-lockstep": "environment, a sampler call per turn (`generation.kv_budget_mb=0`)",
    "example": "example agent (`arith_tool_agent:solve`)",
    "independent": "independent agent (`math_agent:solve`)",
}


def gain_cell(gain: float | None, err: float | None) -> str:
    if gain is None:
        return "-"
    cell = pm(gain, err)
    return f"{cell} ({gain / err:.1f} s.e.)" if err else cell


def at_ceiling(before: float | None, n: int | None) -> bool:
    """No room left for a gain of 3 standard errors: even answering every one of the ``n`` held-out prompts the
    start got wrong (``k`` of them), and no other, would be a paired gain under 3 of its standard errors (the
    standard error of ``k`` ones among ``n`` differences; ``k`` below about 9 at ``n`` = 128)."""
    if before is None or not n or n < 2:
        return False
    k = round((1 - before) * n)
    if k == 0 or k >= n:
        return k == 0
    gain = k / n
    return gain < 3 * math.sqrt(gain * (1 - gain) / (n - 1))


def verdict(m: dict) -> str:
    if m.get("learned"):
        return "learned"
    return "at ceiling" if at_ceiling(m.get("gold_before"), m.get("eval_prompts")) else "did not learn"


def arith_tool_agents(records: list[dict]) -> str:
    recs = select(records, "arith_tool_agents")
    if not recs:
        return none_yet("arith_tool_agents", "python benchmarks/arith_tool_agents.py --record")
    newest: dict[tuple, dict] = {}
    for r in sorted(recs, key=lambda r: r["date"]):
        p = r["params"]
        newest[(p["path"], critic_head(p), p["seed"])] = r
    rows = []
    groups: dict[tuple, list[dict]] = {}
    for key in sorted(newest, key=lambda k: (list(PATH).index(k[0]) if k[0] in PATH else 9, k[1], k[2])):
        groups.setdefault(key[:2], []).append(newest[key])
    for (path, head), runs in groups.items():
        for r in runs:
            m = r["metrics"]
            rows.append(
                [
                    PATH.get(path, path),
                    head,
                    str(r["params"]["seed"]),
                    fmt(m.get("base_gold"), ".3f"),
                    fmt(m.get("gold_before"), ".3f"),
                    fmt(m.get("gold_after"), ".3f"),
                    gain_cell(m.get("gold_gain"), m.get("gold_gain_se")) + f", {verdict(m)}",
                    gain_cell(m.get("base_gain"), m.get("base_gain_se")),
                    f"{fmt(m.get('base_tool_use'), '.2f')} → {fmt(m.get('tool_use_before'), '.2f')} → "
                    f"{fmt(m.get('tool_use_after'), '.2f')}",
                    fmt(m.get("cpu_seconds_total"), ".0f"),
                    fmt(m.get("peak_rss_mb"), "d"),
                    cpu_label(r),
                    commit_label(r),
                ]
            )
        if len(runs) > 1:
            rows.append(mean_row(path, head, runs))
    headers = ["path", "critic head", "seed", "base", "SFT start", "after RL", "RL gain ± s.e."]
    headers += ["gain over the base ± s.e.", "tool use: base → SFT → after", "CPU s", "peak RSS MiB"]
    headers += ["CPU", "commit"]
    return md(headers, rows) + footer(recs)


def critic_head(params: dict) -> str:
    sets = [s for s in params.get("sets", []) if s.startswith("ppo.critic.head_init=")]
    return sets[-1].split("=", 1)[1] if sets else "normal"


def mean_row(path: str, head: str, runs: list[dict]) -> list[str]:
    """The mean over the seeds, each gain's standard error read off the spread of the per-seed gains."""

    def mean(key: str, partial: bool = False) -> tuple[float | None, float | None]:
        """Over every seed (``partial``: over the seeds that recorded ``key``, two at least)."""
        xs = [r["metrics"][key] for r in runs if r["metrics"].get(key) is not None]
        if len(xs) != len(runs) and not (partial and len(xs) >= 2):
            return None, None
        return sum(xs) / len(xs), se(xs)

    rl, rl_se = mean("gold_gain")
    base, base_se = mean("base_gain", partial=True)
    based = sum(r["metrics"].get("base_gain") is not None for r in runs)
    learned = sum(bool(r["metrics"].get("learned")) for r in runs)
    ceiling = sum(at_ceiling(r["metrics"].get("gold_before"), r["metrics"].get("eval_prompts")) for r in runs)
    cpu = [r["metrics"].get("cpu_seconds_total") for r in runs]
    rss = [r["metrics"].get("peak_rss_mb") for r in runs]
    return [
        PATH.get(path, path),
        head,
        f"mean of {len(runs)}",
        fmt(mean("base_gold")[0], ".3f"),
        fmt(mean("gold_before")[0], ".3f"),
        fmt(mean("gold_after")[0], ".3f"),
        f"{gain_cell(rl, rl_se)}; {learned} learned, {ceiling} at ceiling",
        gain_cell(base, base_se)
        + (f" ({based} of {len(runs)} seeds)" if base is not None and based < len(runs) else ""),
        "",
        f"{min(cpu):.0f}-{max(cpu):.0f}" if None not in cpu else "-",
        str(max(rss)) if None not in rss else "-",
        "",
        "",
    ]


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "arith-tool-agents": arith_tool_agents,
}

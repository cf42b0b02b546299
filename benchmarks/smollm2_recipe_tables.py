"""The table of ``benchmarks/smollm2_recipe.py --record``'s runs: the SmolLM2-135M presets, one row per run."""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, metric, none_yet, pm, select, time_cell


def smollm2(records: list[dict]) -> str:
    """The SmolLM2-135M recipe (``benchmarks/smollm2_recipe.py --record``), one row per run."""
    recs = sorted(
        select(records, "quickstart", preset="smollm2"),
        key=lambda r: (r["params"]["task"], r["date"], r["params"]["seed"]),
    )
    if not recs:
        return none_yet("quickstart", "python benchmarks/smollm2_recipe.py --jobs 2 --record", "`smollm2` ")
    rows = [
        [
            r["params"]["task"],
            r["params"]["seed"],
            f"{metric(r, 'gold_before'):.3f} → {metric(r, 'gold_after'):.3f}",
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


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "smollm2": smollm2,
}

"""The table of ``benchmarks/memory.py``'s records: peak memory and checkpoint size per configuration."""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, none_yet, select


def memory(records: list[dict]) -> str:
    recs = select(records, "memory")
    if not recs:
        return none_yet("memory", "python benchmarks/memory.py --record")
    rows = [
        [
            r["params"]["config"],
            " ".join(f"`{a}`" for a in r["params"].get("args", [])) or "-",
            fmt(r["metrics"]["peak_rss_gb"], ".2f"),
            fmt(r["metrics"]["checkpoint_mb"], ".0f"),
            fmt(r["metrics"]["seconds_per_iteration"], ".1f"),
            cpu_label(r),
            commit_label(r),
        ]
        for r in recs
    ]
    return md(
        ["configuration", "settings", "peak RSS GB", "checkpoint MB", "s per iteration", "CPU", "commit"],
        rows,
    ) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "memory": memory,
}

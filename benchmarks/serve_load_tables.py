"""The table of ``benchmarks/serve_load.py``'s records: the reward service under load."""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, none_yet, select


def serve_load(records: list[dict]) -> str:
    recs = [r for r in select(records, "serve_load") if r["params"].get("mode") in ("merged", "exact")]
    if not recs:
        return none_yet("serve_load", "python benchmarks/serve_load.py --record")
    rows = []
    for r in recs:
        m, p = r["metrics"], r["params"]
        rows.append(
            [
                p["mode"],
                p["clients"],
                fmt(m["rows_per_s"], ".1f"),
                fmt(m.get("in_process_rows_per_s"), ".1f"),
                fmt(m.get("ratio_vs_in_process")),
                f"{fmt(m.get('p50_ms'), '.1f')} / {fmt(m.get('p99_ms'), '.1f')}",
                fmt(m.get("rows_per_forward"), ".1f"),
                cpu_label(r),
                commit_label(r),
            ]
        )
    return md(
        [
            "server",
            "clients",
            "rows/s served",
            "rows/s in process",
            "ratio",
            "latency p50 / p99 ms",
            "rows per forward",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "serve-load": serve_load,
}

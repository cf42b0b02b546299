"""The table of ``benchmarks/async_longtail.py``'s records: the wall time a long tail of slow environment steps
adds to a run, per source (an environment, or an agent through the gateway), staleness bound and schedule, against
the synchronous run (S = 0) of the same invocation and source."""

from __future__ import annotations

from table_parts import by_key, commit_label, cpu_label, fmt, footer, md, none_yet, select


def schedule_cell(p: dict) -> str:
    if p["max_staleness"] == 0:
        return "synchronous"
    if p["async_schedule"] != "bounded":
        return p["async_schedule"]
    samplers = p.get("async_samplers")
    if not samplers:
        return "bounded, samplers not recorded"
    return f"bounded, {samplers} sampler{'s' if samplers > 1 else ''}"


SOURCES = {"env": "environment", "agent": "agent (gateway)"}


def source(r: dict) -> str:
    return r["params"].get("source", "env")  # (records before the agent source: the environment)


def async_longtail(records: list[dict]) -> str:
    recs = select(records, "async_longtail")
    if not recs:
        return none_yet("async_longtail", "python benchmarks/async_longtail.py --record")
    rows = []
    # an invocation's records of one source share the series, the commit and the command, and its S = 0 run is
    # their reference; the newest invocation first
    invocations = by_key(recs, lambda r: (r.get("series"), r["commit"], r["command"], source(r))).values()
    for runs in sorted(invocations, key=lambda rs: min(r["date"] for r in rs), reverse=True):
        runs = sorted(runs, key=lambda r: r["date"])
        sync = [r for r in runs if r["params"]["max_staleness"] == 0]
        base = sync[0]["metrics"]["extra_s"] if sync else None
        for r in runs:
            m = r["metrics"]
            rows.append(
                [
                    r.get("series") or "-",
                    SOURCES[source(r)],
                    str(r["params"]["max_staleness"]),
                    schedule_cell(r["params"]),
                    fmt(m["wall_fast_s"], ".1f"),
                    fmt(m["wall_slow_s"], ".1f"),
                    fmt(m["extra_s"], ".1f"),
                    fmt(m["extra_s"] / base if base else None, ".2f"),
                    cpu_label(r),
                    commit_label(r),
                ]
            )
    headers = [
        "series",
        "source",
        "S",
        "schedule",
        "wall, no latency (s)",
        "wall, long tail (s)",
        "extra (s)",
    ]
    headers += ["extra vs S = 0", "CPU", "commit"]
    return md(headers, rows) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "async-longtail": async_longtail,
}

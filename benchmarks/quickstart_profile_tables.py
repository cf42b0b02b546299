"""The table of ``benchmarks/quickstart_profile.py``'s records: where a quickstart's wall time goes, stage by stage,
with its CPU time, the machine's load while it ran, and the held-out gain it reached."""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, none_yet, pm, select, sets_label

STAGES = ("prepare", "sft", "pairs", "rm", "ppo", "eval")


def stage_cell(m: dict, name: str) -> str:
    """A stage's wall seconds (a soup's second PPO run added to ``ppo``: it ran after the first)."""
    stages = m["stages"]
    names = [s for s in stages if s == name or (name == "ppo" and s.startswith("ppo-"))]
    return fmt(sum(stages[s]["seconds"] for s in names), ".1f") if names else "-"


def quickstart_profile(records: list[dict]) -> str:
    recs = select(records, "quickstart_profile")
    if not recs:
        return none_yet("quickstart_profile", "python benchmarks/quickstart_profile.py --run RUN --record")
    rows = []
    for r in sorted(recs, key=lambda r: r["date"], reverse=True):
        m, p = r["metrics"], r["params"]
        plan = f"{p['task']} `{p.get('preset') or 'default'}` {sets_label(p.get('sets', []))}".strip()
        load = r.get("load_average")
        rows.append(
            [
                plan,
                str(r.get("threads") or "all"),
                str(p["seed"]),
                *(stage_cell(m, s) for s in STAGES),
                fmt(m.get("wall_s", m["seconds_total"]), ".1f"),
                fmt(m.get("process_cpu_s", m["cpu_seconds_total"]), ".0f"),
                fmt(load[0], ".1f") if load else "-",
                pm(m["gold_gain"], m["gold_gain_se"]),
                cpu_label(r),
                commit_label(r),
            ]
        )
    headers = ["plan (at its commit)", "threads", "seed", *(f"{s} s" for s in STAGES), "wall s"]
    headers += ["CPU s", "load", "gain", "CPU", "commit"]
    what = (
        "Wall seconds per stage; `wall s` is the whole command's, `CPU s` its process tree's; `load` is the "
        "machine's one-minute load average as the run ended (above the run's own threads: other work on the "
        "machine, and wall times inflated by it). "
    )
    return md(headers, rows) + footer(recs, what)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "quickstart-profile": quickstart_profile,
}

"""The table of ``benchmarks/verifiers_smollm2.py``'s records: a verifiers taskset trained on SmolLM2-135M-Instruct,
per seed, the held-out score before and after with the paired gain, then the mean over the seeds (its standard
error read off the spread of the per-seed gains). A seed recorded more than once shows its newest record."""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, none_yet, pm, se, select


def gain_cell(gain: float, err: float | None) -> str:
    cell = pm(gain, err)
    return f"{cell} ({gain / err:.1f} s.e.)" if err else cell


def verifiers_smollm2(records: list[dict]) -> str:
    recs = [r for r in select(records, "verifiers_smollm2") if r["params"].get("iterations", 0) > 1]
    if not recs:
        return none_yet("verifiers_smollm2", "python benchmarks/verifiers_smollm2.py --python PY --record")
    newest: dict[tuple, dict] = {}
    for r in sorted(recs, key=lambda r: r["date"]):
        newest[(r["params"]["taskset"], r["params"]["seed"])] = r
    rows, by_taskset = [], {}
    for key in sorted(newest):
        by_taskset.setdefault(key[0], []).append(newest[key])
    for taskset, runs in by_taskset.items():
        for r in runs:
            m = r["metrics"]
            rows.append(
                [
                    f"`{taskset}`",
                    str(r["params"]["seed"]),
                    f"{m['gold_before']:.3f} → {m['gold_after']:.3f}",
                    gain_cell(m["gold_gain"], m.get("gold_gain_se")),
                    str(m.get("eval_prompts", "-")),
                    fmt(m.get("process_user_sys_s"), ".0f"),
                    fmt(m.get("peak_rss_mib"), ".0f"),
                    cpu_label(r),
                    commit_label(r),
                ]
            )
        if len(runs) > 1:
            gains = [r["metrics"]["gold_gain"] for r in runs]
            before = sum(r["metrics"]["gold_before"] for r in runs) / len(runs)
            after = sum(r["metrics"]["gold_after"] for r in runs) / len(runs)
            cpu = [r["metrics"].get("process_user_sys_s") or 0 for r in runs]
            rows.append(
                [
                    f"`{taskset}`",
                    f"mean of {len(runs)}",
                    f"{before:.3f} → {after:.3f}",
                    gain_cell(sum(gains) / len(gains), se(gains)),
                    "",
                    f"{min(cpu):.0f}-{max(cpu):.0f}",
                    "",
                    "",
                    "",
                ]
            )
    headers = ["taskset", "seed", "held-out score before → after", "gain ± s.e. (paired)", "held-out tasks"]
    headers += ["CPU s (the run's process tree)", "peak RSS MiB", "CPU", "commit"]
    return md(headers, rows) + footer(recs)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "verifiers-smollm2": verifiers_smollm2,
}

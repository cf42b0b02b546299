"""The tables of ``shifu study frontier`` records (``benchmarks/results/study_frontier.jsonl``): gold against
KL per method and point, and each method against PPO at matched KL.
"""

from __future__ import annotations

import statistics

from table_parts import METHOD, commit_label, cpu_label, footer, md, pm, se, select


def frontier_imdb(records: list[dict]) -> str:
    recs = select(records, "study_frontier", "imdb-reduced")
    rows = []
    for r in recs:
        m = r["metrics"]
        sft = m["sft"]["gold"]
        rows.append(["SFT", "-", f"{sft:.3f}", "-", "0", "-", "-", cpu_label(r), commit_label(r)])
        for method, res in m["methods"].items():
            for pt in res["points"]:
                golds = [s["gold"] for s in pt["per_seed"]]
                cpu = statistics.mean(s["train_cpu_seconds"] for s in pt["per_seed"])
                rows.append(
                    [
                        METHOD.get(method, method),
                        pt["point"].replace("=", " "),
                        pm(statistics.mean(golds), se(golds), signed=False),
                        f"{statistics.mean(golds) - sft:+.2f}",
                        f"{pt['kl_mean']:.1f}",
                        f"{cpu:.0f}",
                        len(golds),
                        cpu_label(r),
                        commit_label(r),
                    ]
                )
    return md(
        [
            "method",
            "point",
            "gold ± s.e. over seeds",
            "gain over SFT",
            "KL (nats)",
            "CPU s per run",
            "seeds",
            "CPU",
            "commit",
        ],
        rows,
    ) + footer(recs)


def frontier_imdb_vs_ppo(records: list[dict]) -> str:
    recs = select(records, "study_frontier", "imdb-reduced")
    rows = []
    for r in recs:
        for method, pts in r["metrics"]["vs_ppo_pairwise"].items():
            for p in pts:
                rows.append(
                    [
                        METHOD.get(method, method),
                        f"{p['kl']:.1f}",
                        f"{p['ppo']:.3f}",
                        f"{p[method]:.3f}",
                        pm(p["ppo_minus"], p["se"]),
                        cpu_label(r),
                        commit_label(r),
                    ]
                )
    return md(
        ["method", "KL (nats)", "PPO gold", "method's gold", "PPO − method ± s.e.", "CPU", "commit"], rows
    ) + footer(
        recs,
        "Each seed read along its own frontier (linear in ln KL) on the KL range the two methods share. ",
    )


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "frontier-imdb": frontier_imdb,
    "frontier-imdb-vs-ppo": frontier_imdb_vs_ppo,
}

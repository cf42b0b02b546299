"""The tables of ``benchmarks/imdb_headroom.py``'s records: merged policies (``imdb-soups``) and the headroom
diagnostics (``imdb-headroom``).
"""

from __future__ import annotations

from table_parts import commit_label, cpu_label, footer, md, metric, pm, select


def imdb_soups(records: list[dict]) -> str:
    """Each judged policy of a merge experiment: its runs alone, their means, scaled means."""
    recs = select(records, "imdb_headroom", "soups", mode="judge")
    order = list(dict.fromkeys(r["params"]["experiment"] for r in recs))

    def key(r: dict) -> tuple:
        p = r["params"]
        return order.index(p["experiment"]), p["seed"], "alone" not in p["policy"], p["policy"]

    rows = [
        [
            r["params"]["experiment"],
            r["params"]["seed"],
            r["params"]["policy"],
            pm(metric(r, "gold_gain"), metric(r, "gold_gain_se")),
            f"{metric(r, 'kl'):.2f}",
            cpu_label(r),
            commit_label(r),
        ]
        for r in sorted(recs, key=key)
    ]
    return md(
        ["runs", "seed", "policy judged", "gain ± paired s.e.", "KL (nats)", "CPU", "commit"], rows
    ) + footer(
        recs,
        "Merged by `shifu merge` (base + scale x mean of the runs' changes to it); every policy judged by "
        "the quickstart's evaluation on the 1000 held-out prompts. ",
    )


def imdb_headroom(records: list[dict]) -> str:
    mode_order = ["best-of-n", "gold-reward", "raft"]
    recs = sorted(
        select(records, "imdb_headroom", "headroom"),
        key=lambda r: (
            mode_order.index(r["params"]["mode"]),
            r["params"].get("n", 0),
            r["params"].get("lr", 0),
        ),
    )
    rows = []
    for r in recs:
        p, m = r["params"], r["metrics"]
        if p["mode"] == "best-of-n":
            what = f"best of {p['n']} SFT samples, chosen by the reward model (by the gold judge)"
            res = f"gold {m['gold_chosen_by_rm']:.3f} ({m['gold_chosen_by_gold']:.3f}); SFT {m['gold_sft_mean_64x64']:.3f}"
            kl = f"≤ {m['kl_bound']:.2f}"
        elif p["mode"] == "gold-reward":
            what = "the RL stage rewarded by the gold judge instead of the reward model"
            res, kl = f"gain {pm(m['gold_gain'], m['gold_gain_se'])}", f"{m['kl']:.2f}"
        else:
            what = f"offline RAFT: SFT on the best of {p['n']} for {p['prompts']} prompts, lr {p['lr']:g}, {p['epochs']:g} epochs"
            res, kl = f"gain {pm(m['gain'], m['se'])}", f"{m['kl']:.2f}"
        rows.append([what, res, kl, cpu_label(r), commit_label(r)])
    return md(["diagnostic (imdb `small`, seed 0)", "result", "KL (nats)", "CPU", "commit"], rows) + footer(
        recs
    )


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "imdb-soups": imdb_soups,
    "imdb-headroom": imdb_headroom,
}

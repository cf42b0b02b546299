"""The table of ``benchmarks/async_objective.py``'s records: long ``fixed`` runs at a staleness bound, the plain
clipped objective against the decoupled one with SAO's mask, beside the synchronous run: whether the training
return collapsed, and the held-out gain each ended with."""

from __future__ import annotations

from table_parts import commit_label, cpu_label, fmt, footer, md, none_yet, pm, select

LABELS = {
    "synchronous": "synchronous (S = 0)",
    "plain": "plain clipped objective",
    "decoupled_mask": "decoupled + mask",
}
ORDER = tuple(LABELS)


def option(sets: list[str], key: str) -> str | None:
    for s in sets:
        if s.startswith(f"ppo.{key}="):
            return s.split("=", 1)[1]
    return None


def async_objective(records: list[dict]) -> str:
    recs = select(records, "async_objective")
    if not recs:
        return none_yet(
            "async_objective", "SHIFU_THREADS=1 python benchmarks/async_objective.py --seeds 0 --record"
        )
    rows = []
    recs = sorted(recs, key=lambda r: (r["params"]["seed"], ORDER.index(r["params"]["variant"]), r["date"]))
    for r in recs:
        p, m = r["params"], r["metrics"]
        sets = p["sets"]
        mask = option(sets, "is_mask")
        label = LABELS[p["variant"]] + (f" (band [1/{float(mask):g}, {float(mask):g}])" if mask else "")
        collapsed = f"yes, at {m['collapse_at']}" if m["collapsed"] else "no"
        rows.append(
            [
                label,
                option(sets, "max_staleness") or "0",
                option(sets, "iterations") or "-",
                str(p["seed"]),
                f"{m['gold_before']:.3f} → {m['gold_after']:.3f}",
                pm(m["gold_gain"], m["gold_gain_se"]),
                fmt(m["kl"], ".2f"),
                f"{m['return_first']:.2f} → {m['return_best']:.2f} (at {m['return_best_at']}) → {m['return_last']:.2f}",
                collapsed,
                f"{fmt(m.get('clipfrac_mean'), '.3f')} / {fmt(m.get('clipfrac_max'), '.3f')}",
                fmt(m.get("approx_kl_max"), ".3f"),
                fmt(m.get("is_maskfrac_mean"), ".4f"),
                fmt(m.get("cpu_s"), ".0f"),
                cpu_label(r),
                commit_label(r),
            ]
        )
    headers = ["objective", "S", "iterations", "seed", "held-out accuracy", "paired gain", "KL (nats)"]
    headers += ["training return: first → best → last", "collapsed", "clip fraction mean / max"]
    headers += ["approx KL max", "masked fraction", "CPU s", "CPU", "commit"]
    p0 = recs[0]["params"]
    what = (
        f"Training return: means over {p0['window']} iterations; collapsed: the last such mean more than "
        f"{p0['drop']:g} below the best. "
    )
    return md(headers, rows) + footer(recs, what)


# the tables this module renders, by the name of their block in the pages
TABLES = {
    "async-objective": async_objective,
}

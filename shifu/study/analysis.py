"""What a finished study shows: each method's points aggregated over seeds, gold compared at matched KL (and
paired with PPO), gold gained per CPU minute, the gold-against-KL plot and the summary table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shifu.study.budgets import COLOURS

# ------------------------------------------------------------------------------------- aggregate + plot


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def aggregate(results: list[dict], order: dict[str, list[str]]) -> dict[str, Any]:
    """Per method: each point's per-seed numbers and mean/std of gold and KL; cost per method."""
    methods: dict[str, Any] = {}
    for method, labels in order.items():
        points = []
        for label in labels:
            rs = sorted(
                (r for r in results if r["method"] == method and r["point"] == label), key=lambda r: r["seed"]
            )
            if not rs:
                continue
            g, gs = _mean_std([r["gold"] for r in rs])
            k, ks = _mean_std([r["kl"] for r in rs])
            points.append(
                {
                    "point": label,
                    "gold_mean": g,
                    "gold_std": gs,
                    "kl_mean": k,
                    "kl_std": ks,
                    "per_seed": [
                        {x: r[x] for x in ("seed", "gold", "kl", "response_len", "train_seconds", "proxy")}
                        | {"train_cpu_seconds": r.get("train_cpu_seconds", r["train_seconds"])}
                        for r in rs
                    ],
                }
            )
        secs = [s["train_seconds"] for p in points for s in p["per_seed"]]
        cpu = [s["train_cpu_seconds"] for p in points for s in p["per_seed"]]
        methods[method] = {
            "points": points,
            "train_seconds_per_run": sum(secs) / len(secs) if secs else None,
            "train_cpu_seconds_per_run": sum(cpu) / len(cpu) if cpu else None,
            "train_seconds_total": sum(secs),
            # across-seed spread of gold, averaged over the method's points (the variance target)
            "mean_gold_std": sum(p["gold_std"] for p in points) / len(points) if points else None,
            # the same spread with the part explained by each seed's own KL removed (see _resid_std)
            "gold_std_at_kl": _resid_std([[(s["kl"], s["gold"]) for s in p["per_seed"]] for p in points]),
        }
    return methods


def _resid_std(groups: list[list[tuple[float, float]]]) -> float | None:
    """Spread of gold over seeds *at the same KL*: the residual std of a pooled within-point regression.

    ``groups`` holds one list of (kl, gold) per point, one pair per seed. Within each point, gold and KL
    are centred on the point's means; one slope b (gold per nat, shared by the points) is fitted to the
    centred values, and the result is the sample std of ``gold - b * kl`` deviations with n - P - 1
    degrees of freedom (n runs, P points). A seed that drifted further than its siblings is not counted
    as variance to the extent that gold moves with KL; what is left is the method's scatter at a given
    KL. None when there are not enough seeds (n - P - 1 < 1) or no KL spread within points.
    """
    dx, dy = [], []
    for g in groups:
        if not g:
            continue
        mx, my = sum(x for x, _ in g) / len(g), sum(y for _, y in g) / len(g)
        dx += [x - mx for x, _ in g]
        dy += [y - my for _, y in g]
    dof = len(dx) - sum(1 for g in groups if g) - 1
    sxx = sum(x * x for x in dx)
    if dof < 1 or sxx == 0:
        return None
    b = sum(x * y for x, y in zip(dx, dy)) / sxx
    return math.sqrt(sum((y - b * x) ** 2 for x, y in zip(dx, dy)) / dof)


def _gold_at(curve: list[tuple[float, float]], kl: float) -> float | None:
    """Gold of one seed's frontier at ``kl``: linear in ln KL between its two neighbouring points (the
    measured curves are close to straight lines in ln KL: imdb seed 0 gains 0.24-0.30 gold per unit of
    ln KL between every pair of neighbouring points, for all three methods). None outside the seed's
    range (no extrapolation)."""
    pts = sorted((k, g) for k, g in curve if k > 0)
    for (k0, g0), (k1, g1) in zip(pts, pts[1:]):
        if k0 <= kl <= k1:
            if k1 == k0:
                return (g0 + g1) / 2
            w = (math.log(kl) - math.log(k0)) / (math.log(k1) - math.log(k0))
            return g0 + w * (g1 - g0)
    return None


def matched_kl(methods: dict[str, Any], grid_points: int = 5, min_seeds: int = 2) -> dict[str, Any] | None:
    """Every method's gold read at the same KLs, per seed, along that seed's own frontier.

    Each seed of a method has one (KL, gold) per point; :func:`_gold_at` interpolates it. The KL grid
    spans the range that at least ``min_seeds`` seeds of *every* method cover, ``grid_points`` values
    evenly spaced in ln KL. Per method and grid KL: mean and std over the seeds that reach it; versus
    PPO: the difference of means with its standard error (seeds of two methods are independent). This is
    what "one method's frontier is above another's" and "more variance across seeds at the same KL"
    are read from. None when fewer than two methods have ``min_seeds`` seeds with two points or more.
    """
    curves = _seed_curves(methods, min_seeds)
    if len(curves) < 2:
        return None

    def covered(cs: list[list[tuple[float, float]]]) -> tuple[float, float]:
        # the widest [lo, hi] that min_seeds seeds each span
        los = sorted(min(k for k, _ in c if k > 0) for c in cs)
        his = sorted((max(k for k, _ in c) for c in cs), reverse=True)
        return los[min_seeds - 1], his[min_seeds - 1]

    ranges = [covered(cs) for cs in curves.values()]
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    if not lo < hi:
        return {"kl_grid": [], "methods": {}, "vs_ppo": {}, "note": "the methods' KL ranges do not overlap"}
    n = max(grid_points, 2)
    grid = [math.exp(math.log(lo) + i * (math.log(hi) - math.log(lo)) / (n - 1)) for i in range(n)]
    grid[0], grid[-1] = lo, hi  # exactly the ends (exp(log(x)) may land just outside a seed's range)
    table: dict[str, list[dict[str, Any]]] = {}
    for method, cs in curves.items():
        rows = []
        for kl in grid:
            golds = [g for g in (_gold_at(c, kl) for c in cs) if g is not None]
            mean, std = _mean_std(golds) if golds else (None, None)
            rows.append({"kl": kl, "gold_mean": mean, "gold_std": std, "seeds": len(golds)})
        table[method] = rows
    return {"kl_grid": grid, "methods": table, "vs_ppo": _differences_to_ppo(table)}


def _seed_curves(methods: dict[str, Any], min_seeds: int) -> dict[str, list[list[tuple[float, float]]]]:
    """Per method, each seed's (KL, gold) points, for the methods with ``min_seeds`` seeds of two points
    or more at a KL above 0 (:func:`matched_kl`)."""
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for method, m in methods.items():
        by_seed: dict[int, list[tuple[float, float]]] = {}
        for p in m["points"]:
            for s in p["per_seed"]:
                by_seed.setdefault(s["seed"], []).append((s["kl"], s["gold"]))
        usable = [c for c in by_seed.values() if len([k for k, _ in c if k > 0]) >= 2]
        if len(usable) >= min_seeds:
            curves[method] = usable
    return curves


def _differences_to_ppo(table: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Per method of :func:`matched_kl`'s ``table`` but PPO: PPO's mean gold minus the method's at each grid
    KL that both reach with two seeds or more, with its standard error; empty without PPO."""
    vs_ppo: dict[str, list[dict[str, Any]]] = {}
    if "ppo" in table:
        for method, rows in table.items():
            if method == "ppo":
                continue
            diffs = []
            for a, b in zip(table["ppo"], rows):
                if a["seeds"] >= 2 and b["seeds"] >= 2:
                    se = math.sqrt(a["gold_std"] ** 2 / a["seeds"] + b["gold_std"] ** 2 / b["seeds"])
                    diffs.append({"kl": a["kl"], "ppo_minus": a["gold_mean"] - b["gold_mean"], "se": se})
            vs_ppo[method] = diffs
    return vs_ppo


def vs_ppo_pairwise(methods: dict[str, Any], grid_points: int = 3, min_seeds: int = 2) -> dict[str, Any]:
    """Each method against PPO on the KL range *the two of them* share (:func:`matched_kl` on the pair):
    with many methods the range every one covers is often empty, while each still overlaps PPO. Per
    method: the grid KLs, PPO's and its gold (mean over seeds) and PPO minus it with its standard error."""
    out: dict[str, Any] = {}
    if "ppo" not in methods:
        return out
    for method, m in methods.items():
        mk = (
            None
            if method == "ppo"
            else matched_kl({"ppo": methods["ppo"], method: m}, grid_points, min_seeds)
        )
        if mk and mk["vs_ppo"].get(method):
            ppo_rows = {r["kl"]: r for r in mk["methods"]["ppo"]}
            other = {r["kl"]: r for r in mk["methods"][method]}
            out[method] = [
                d | {"ppo": ppo_rows[d["kl"]]["gold_mean"], method: other[d["kl"]]["gold_mean"]}
                for d in mk["vs_ppo"][method]
            ]
    return out


def gold_per_cpu(methods: dict[str, Any], sft_gold: float) -> dict[str, list[dict[str, Any]]]:
    """Per method and point: the gold gained over the SFT policy per CPU-minute of training (each seed's
    ``(gold - sft_gold) / train_cpu_seconds * 60``; mean and standard error over seeds), with the CPU
    seconds a run took. What a method buys per unit of compute, its critic (or its G samples) counted."""
    out: dict[str, list[dict[str, Any]]] = {}
    for method, m in methods.items():
        rows = []
        for p in m["points"]:
            rates = [(s["gold"] - sft_gold) / s["train_cpu_seconds"] * 60 for s in p["per_seed"]]
            mean, std = _mean_std(rates)
            cpu, _ = _mean_std([s["train_cpu_seconds"] for s in p["per_seed"]])
            rows.append(
                {
                    "point": p["point"],
                    "gain_per_cpu_minute": mean,
                    "se": std / math.sqrt(len(rates)),
                    "cpu_seconds": cpu,
                    "seeds": len(rates),
                }
            )
        out[method] = rows
    return out


def plot(frontier: dict[str, Any], path: Path) -> Path:
    """Two views: gold vs KL (one curve per method through its points, means, std over seeds as error
    bars) and gold vs training CPU seconds per run (each point's mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_cpu) = plt.subplots(1, 2, figsize=(11.5, 4.4))
    base = frontier["sft"]
    for method, colour in COLOURS.items():
        pts = sorted(frontier["methods"].get(method, {}).get("points", []), key=lambda p: p["kl_mean"])
        if not pts:
            continue
        cpu = [sum(s["train_cpu_seconds"] for s in p["per_seed"]) / len(p["per_seed"]) for p in pts]
        ax_cpu.errorbar(
            cpu,
            [p["gold_mean"] for p in pts],
            yerr=[p["gold_std"] for p in pts],
            marker="o",
            linestyle="none",
            capsize=3,
            color=colour,
            label=method,
        )
        cost = frontier["methods"][method]["train_seconds_per_run"]
        ax.errorbar(
            [base["kl"]] + [p["kl_mean"] for p in pts],
            [base["gold"]] + [p["gold_mean"] for p in pts],
            xerr=[0.0] + [p["kl_std"] for p in pts],
            yerr=[0.0] + [p["gold_std"] for p in pts],
            marker="o",
            capsize=3,
            color=colour,
            label=f"{method} ({cost:.0f} s/run)",
        )
        for p in pts:
            ax.annotate(
                p["point"],
                (p["kl_mean"], p["gold_mean"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
                color=colour,
            )
    ax.scatter([base["kl"]], [base["gold"]], color="black", zorder=5, label="SFT (reference)")
    ax.set_xlabel("KL(pi || pi_ref), nats per response (k1, held-out prompts)")
    ax.set_ylabel(f"gold ({frontier['gold_judge'].split(':')[-1]}), held-out mean")
    ax.set_title(
        f"{frontier['task']} frontier, {len(frontier['seeds'])} seed(s), budget {frontier['budget']}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_cpu.axhline(base["gold"], color="black", linewidth=0.8, label="SFT (reference)")
    ax_cpu.set_xlabel("training CPU seconds per run (all threads)")
    ax_cpu.set_ylabel("gold, held-out mean")
    ax_cpu.set_title("gold against compute (each point: one knob, mean over seeds)")
    ax_cpu.grid(alpha=0.3)
    ax_cpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary_table(report: dict[str, Any]) -> str:
    lines = [
        f"SFT: gold {report['sft']['gold']:.3f} at KL {report['sft']['kl']:.2f}",
        f"{'method':10s} {'point':10s} {'gold':>14s} {'KL (nats)':>14s} {'s/run':>7s}",
    ]
    for method, m in report["methods"].items():
        for p in m["points"]:
            secs = sum(s["train_seconds"] for s in p["per_seed"]) / len(p["per_seed"])
            lines.append(
                f"{method:10s} {p['point']:10s} {p['gold_mean']:7.3f}±{p['gold_std']:.3f} "
                f"{p['kl_mean']:8.2f}±{p['kl_std']:.2f} {secs:7.0f}"
            )
    mk = report.get("matched_kl")
    if mk and mk["kl_grid"]:
        lines.append("gold at matched KL (each seed read along its own frontier; mean±std over seeds):")
        lines.append(f"{'KL (nats)':>10s} " + " ".join(f"{m:>16s}" for m in mk["methods"]))
        for i, kl in enumerate(mk["kl_grid"]):
            cells = []
            for rows in mk["methods"].values():
                r = rows[i]
                cells.append(
                    f"{r['gold_mean']:.3f}±{r['gold_std']:.3f} ({r['seeds']})" if r["seeds"] else "-"
                )
            lines.append(f"{kl:10.2f} " + " ".join(f"{c:>16s}" for c in cells))
        for method, diffs in mk["vs_ppo"].items():
            lines.append(
                f"ppo - {method}: "
                + ", ".join(f"{d['ppo_minus']:+.3f}±{d['se']:.3f} @ {d['kl']:.1f}" for d in diffs)
            )
    pairs = report.get("vs_ppo_pairwise") or {}
    if pairs:
        lines.append("PPO against each method on the KL range the two share (gold, PPO minus it ± s.e.):")
    for method, diffs in pairs.items():
        lines.append(
            f"ppo - {method}: "
            + ", ".join(f"{d['ppo_minus']:+.3f}±{d['se']:.3f} @ {d['kl']:.2f}" for d in diffs)
        )
    lines.append("gold gained over SFT per CPU-minute of training (mean±s.e. over seeds; CPU s/run):")
    for method, rows in report.get("gold_per_cpu", {}).items():
        lines.append(
            f"{method:14s} "
            + ", ".join(
                f"{r['point']} {r['gain_per_cpu_minute']:+.4f}±{r['se']:.4f} ({r['cpu_seconds']:.0f} s)"
                for r in rows
            )
        )
    for method, m in report["methods"].items():
        if m.get("gold_std_at_kl") is not None:
            lines.append(
                f"{method}: gold std over seeds {m['mean_gold_std']:.3f} (mean over points), "
                f"at matched KL {m['gold_std_at_kl']:.3f}"
            )
    return "\n".join(lines)

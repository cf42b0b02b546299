"""The report's PNG plots: each stage's metrics over its steps (:data:`PLOTS`), and gold against KL.

Titles and legends say what a run measured: the reward plot is titled by the run's reward (a function, a
reward model or ensemble, a reward service: :func:`shifu.reporting.run_data.reward_source`), the gold plots
say how many held-out prompts were sampled at which temperature, and every curve is labelled in words with
its metric key. Plots use matplotlib's object API with the Agg renderer, so drawing never touches pyplot's
global backend state.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from shifu.reporting.run_data import RunData, num, reward_source

X_LABEL = {"ppo": "PPO iteration", "rm": "reward-model step", "dpo": "DPO step", "sft": "SFT step"}
# what each drawn metric is, in the legend next to its key
LEGEND = {
    "objective/score": "rollouts",
    "objective/rlhf_reward": "rollouts, score - beta * KL",
    "eval/score": "held-out prompts",
    "objective/kl": "rollouts",
    "eval/kl": "held-out prompts",
    "policy/clipfrac": "policy",
    "value/clipfrac": "critic",
    "rm/accuracy": "training batches",
    "eval/rm/accuracy": "held-out pairs",
    "sft/loss": "training batches",
    "eval/sft/loss": "held-out rows",
    "dpo/loss": "training batches",
    "eval/dpo/loss": "held-out pairs",
    "dpo/accuracy": "training batches",
    "eval/dpo/accuracy": "held-out pairs",
    "dpo/margin": "training batches",
    "eval/dpo/margin": "held-out pairs",
}
MAX_POINT_LABELS = 12  # gold against KL: at most this many points carry their iteration


@dataclasses.dataclass(frozen=True)
class Plot:
    """One PNG: ``keys`` of one stage's metrics drawn against ``step``."""

    name: str
    title: str
    ylabel: str
    stage: str
    keys: tuple[str, ...]


# The report's plots over iterations, in page order; `gold_vs_kl` is drawn separately (one point per eval).
# The score plot's title is the run's reward (:func:`title`).
PLOTS: tuple[Plot, ...] = (
    Plot("score", "Reward score", "score", "ppo", ("objective/score", "objective/rlhf_reward", "eval/score")),
    Plot("gold", "Gold judge on held-out prompts", "gold score", "ppo", ("gold/score",)),
    Plot("kl", "KL to the reference policy", "nats per response", "ppo", ("objective/kl", "eval/kl")),
    Plot("beta", "KL coefficient beta", "beta", "ppo", ("objective/kl_coef",)),
    Plot("clipfrac", "Clipped fraction", "fraction of tokens", "ppo", ("policy/clipfrac", "value/clipfrac")),
    Plot("entropy", "Policy entropy", "nats per token", "ppo", ("objective/entropy",)),
    Plot("response_len", "Response length", "tokens", "ppo", ("rollout/response_len",)),
    Plot(
        "rm_accuracy", "Reward-model accuracy", "pairwise accuracy", "rm", ("rm/accuracy", "eval/rm/accuracy")
    ),
    Plot("sft_loss", "SFT loss", "nats per token", "sft", ("sft/loss", "eval/sft/loss")),
    Plot("dpo_loss", "DPO loss", "nats per pair", "dpo", ("dpo/loss", "eval/dpo/loss")),
    Plot(
        "dpo_accuracy",
        "DPO implicit-reward accuracy",
        "pairwise accuracy",
        "dpo",
        ("dpo/accuracy", "eval/dpo/accuracy"),
    ),
    Plot(
        "dpo_margin",
        "DPO implicit-reward margin",
        "beta * log-ratio margin",
        "dpo",
        ("dpo/margin", "eval/dpo/margin"),
    ),
)
GOLD_VS_KL = "gold_vs_kl"


def title(plot: Plot, data: RunData) -> str:
    """``plot``'s title for this run: the reward plot named by the run's reward, the gold plot saying how
    PPO's held-out evaluations sampled."""
    if plot.name == "score":
        return reward_source(data.ppo_source)[0]
    if plot.name == "gold" and data.ppo_eval:
        return f"Gold judge during PPO ({data.ppo_eval})"
    return plot.title


def final_evaluation(summary: dict[str, Any] | None) -> str:
    """How the summary's ``gold_before`` / ``gold_after`` were measured, e.g. "512 prompts sampled at T=1"."""
    s = summary or {}
    n, T = s.get("eval_prompts"), num(s.get("eval_temperature"))
    if n is None or T is None:
        return "final evaluation"
    return f"final evaluation: {n} prompts sampled at T={T:g}"


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float], int]:
    """(steps, values, number of non-finite values) of ``key``; non-finite values become NaN gaps."""
    xs, ys, nonfinite = [], [], 0
    for i, row in enumerate(rows):
        y = num(row.get(key))
        if y is None:
            continue
        x = num(row.get("step"))
        xs.append(float(i) if x is None or not math.isfinite(x) else x)
        if not math.isfinite(y):
            nonfinite += 1
            y = math.nan
        ys.append(y)
    return xs, ys, nonfinite


def figure():
    """A (figure, axes) pair of the report's size, with a light grid."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    # fixed margins: constrained layout would double the drawing time
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def save(fig, path: Path) -> None:
    """``fig`` as a PNG at ``path``, written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def draw(plot: Plot, rows: list[dict[str, Any]], data: RunData, path: Path) -> str | None:
    """Draw one plot to ``path``; returns None, or why nothing (or not everything) was drawn."""
    drawn, notes = 0, []
    fig, ax = figure()
    for key in plot.keys:
        xs, ys, nonfinite = series(rows, key)
        if not any(math.isfinite(y) for y in ys):
            continue
        # sparse series (evaluation rows) get markers so single points are visible
        label = f"{LEGEND[key]} ({key})" if key in LEGEND else key
        if plot.stage == "ppo" and key.startswith(("eval/", "gold/")) and data.ppo_eval:
            label = f"held-out: {data.ppo_eval} ({key})"
        ax.plot(xs, ys, marker="o" if len(xs) <= 40 else None, markersize=4, label=label)
        drawn += 1
        if nonfinite:
            notes.append(f"{nonfinite} non-finite value(s) of {key} left as gaps")
    if not drawn:
        return f"no finite values of {', '.join(plot.keys)} in {plot.stage}/metrics.jsonl"
    before = num((data.summary or {}).get("gold_before"))
    if plot.name == "gold" and before is not None:
        label = f"SFT policy, {final_evaluation(data.summary)} (gold_before)"
        ax.axhline(before, color="gray", linestyle="--", label=label)
    ax.set_title(title(plot, data))
    ax.set_xlabel(X_LABEL[plot.stage])
    ax.set_ylabel(plot.ylabel)
    if len(ax.get_lines()) > 1:
        ax.legend(fontsize=8)
    save(fig, path)
    return "; ".join(notes) if notes else None


def gold_vs_kl_figure(rows: list[dict[str, Any]], data: RunData):
    """(figure, axes) of gold score against KL, or why there is nothing to draw.

    One point per PPO evaluation, not joined (KL need not grow with the iteration: a line in iteration order
    would zig-zag), each labelled with its iteration (at most :data:`MAX_POINT_LABELS`, the last always), and
    the summary's final evaluation: the SFT policy at KL 0 (the reference, by definition) and the final policy.
    KL is the k3 estimate where every evaluation logged it (``eval/kl_k3``; the summary's ``kl`` is k3 too),
    else ``eval/kl``. Over-optimisation shows as gold turning down while KL keeps growing."""
    key = "eval/kl_k3" if any("eval/kl_k3" in r for r in rows) else "eval/kl"
    points = []
    for row in rows:
        kl, gold = num(row.get(key)), num(row.get("gold/score"))
        if kl is not None and gold is not None and math.isfinite(kl) and math.isfinite(gold):
            points.append((kl, gold, row.get("step")))
    s = data.summary or {}
    before, after, kl_after = num(s.get("gold_before")), num(s.get("gold_after")), num(s.get("kl"))
    has_before = before is not None and math.isfinite(before)
    has_after = all(v is not None and math.isfinite(v) for v in (after, kl_after))
    if not points and not (has_before or has_after):
        return f"no evaluation rows with both {key} and gold/score, and no gold_before/gold_after in summary.json"
    fig, ax = figure()
    if points:
        how = f" ({data.ppo_eval})" if data.ppo_eval else ""
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            markersize=5,
            linestyle="none",
            label=f"PPO evaluations{how}",
        )
        every = math.ceil(len(points) / MAX_POINT_LABELS)
        for i, (kl, gold, step) in enumerate(points):
            if i % every == 0 or i == len(points) - 1:
                ax.annotate(f"it {step}", (kl, gold), textcoords="offset points", xytext=(4, 4), fontsize=7)
    final = final_evaluation(data.summary)
    if has_before:
        ax.plot([0.0], [before], marker="*", markersize=12, linestyle="none", label=f"SFT policy, {final}")
    if has_after:
        ax.plot(
            [kl_after], [after], marker="s", markersize=7, linestyle="none", label=f"final policy, {final}"
        )
    ax.set_title("Gold score against KL")
    k3 = key == "eval/kl_k3" or not points
    ax.set_xlabel(f"KL to the reference{', k3 estimate' if k3 else ''} (nats per response)")
    ax.set_ylabel("gold score")
    ax.legend(fontsize=8)
    return fig, ax


def draw_gold_vs_kl(rows: list[dict[str, Any]], data: RunData, path: Path) -> str | None:
    """:func:`gold_vs_kl_figure` to ``path``; returns None, or why nothing was drawn."""
    made = gold_vs_kl_figure(rows, data)
    if isinstance(made, str):
        return made
    save(made[0], path)
    return None

"""``shifu report RUN_A RUN_B ...``: one page that overlays the training curves of several runs.

For the questions asked after a sweep ("did the new beta help?"): each plot draws one line per run (the same
colour for a run in every plot) for the reward-model score, the gold judge, KL, beta, entropy, response
length, and gold against KL; a summary table puts each run's end values side by side (gold before/after with
standard errors when the run kept per-prompt samples), and a second table lists the config keys whose values
differ between the runs. Runs are read with :func:`shifu.reporting.report.load_run`, so any directory the single-run
report accepts works (a quickstart run or a single ``shifu ppo`` run directory).

The page is one file: inline CSS, the plots as PNG data URIs, no scripts and no external resources, so it
can be mailed or attached to an issue as it is.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from shifu.errors import ShifuError
from shifu.reporting import report
from shifu.reporting.card_results import gold_comparison
from shifu.reporting.names import run_name, shown_config
from shifu.reporting.plots import figure, series
from shifu.reporting.report import CSS, esc
from shifu.reporting.run_data import RunData, load_run, num, reward_source

LAST = 5  # end-of-run values are the mean of the last LAST finite points (single iterations are noisy)


@dataclasses.dataclass(frozen=True)
class Overlay:
    """One plot: ``key`` of each run's PPO metrics against the iteration."""

    name: str
    title: str
    ylabel: str
    key: str


OVERLAYS: tuple[Overlay, ...] = (
    Overlay("score", "Reward score (rollouts)", "score", "objective/score"),
    Overlay("gold", "Gold judge on held-out prompts", "gold score", "gold/score"),
    Overlay("kl", "KL to the reference policy", "nats per response", "objective/kl"),
    Overlay("beta", "KL coefficient beta", "beta", "objective/kl_coef"),
    Overlay("entropy", "Policy entropy", "nats per token", "objective/entropy"),
    Overlay("response_len", "Response length", "tokens", "rollout/response_len"),
)
GOLD_VS_KL = "gold_vs_kl"
_EXTRA_CSS = """
td.best { font-weight: bold; background: #e8f5e9; }
tr > th:first-child { white-space: nowrap; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em; vertical-align: -0.1em; }
"""


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Short distinct names: each run's directory name, with as many parent names as it takes to tell
    runs of the same name apart (``a/s0`` vs ``b/s0``)."""
    parts = [p.resolve().parts for p in run_dirs]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            return labels
        depth += 1


def _beside(run: Path, page: Path) -> str:
    """A run directory as the comparison page ``page`` reaches it (a relative path, never an absolute one)."""
    return Path(os.path.relpath(run.resolve(), page.resolve().parent)).as_posix()


def tail_mean(rows: list[dict[str, Any]], key: str, n: int = LAST) -> float | None:
    """Mean of the last ``n`` finite values of ``key`` (None when there are none)."""
    values = [y for y in series(rows, key)[1] if math.isfinite(y)]
    return sum(values[-n:]) / len(values[-n:]) if values else None


def last_value(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [y for y in series(rows, key)[1] if math.isfinite(y)]
    return values[-1] if values else None


def flat_config(run: Path) -> dict[str, str]:
    """A run's config as ``{"ppo:kl.target": "6.0"}``, every key prefixed with its stage: each stage's
    ``config.yaml`` of a quickstart run, or ``RUN/config.yaml`` of a trainer's run (its stage read from its
    keys; ``run:`` when unknown). ``out_dir`` is left out (it always differs)."""
    from shifu.reporting.modelcard import infer_kind
    from shifu.runs.tracking import flatten_config

    sources = [(s, run / s / "config.yaml") for s in ("sft", "rm", "ppo", "dpo")]
    if (run / "config.yaml").is_file():
        sources.append((infer_kind(run) or "run", run / "config.yaml"))
    out: dict[str, str] = {}
    for stage, path in sources:
        if not path.is_file():
            continue
        try:
            config = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError:
            continue
        if isinstance(config, dict):
            flat = flatten_config(shown_config(config, run))  # (paths never absolute, as in a model card)
            out.update({f"{stage}:{k}": v for k, v in flat.items() if k != "out_dir"})
    return out


def config_differences(configs: list[dict[str, str]]) -> list[tuple[str, list[str]]]:
    """(key, value per run) for every key whose value is not the same in all runs ("—": not set). Only the
    stages every run recorded are compared (a ``shifu ppo`` run has no sft config to hold against a
    quickstart run's)."""
    stages = [{k.split(":", 1)[0] for k in c} for c in configs]
    common = set.intersection(*stages) if stages else set()
    keys = sorted({k for c in configs for k in c if k.split(":", 1)[0] in common})
    rows = []
    for k in keys:
        values = [c.get(k, "—") for c in configs]
        if len(set(values)) > 1:
            rows.append((k, values))
    return rows


# ---------------------------------------------------------------------------------------------- plots


def _png_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _colors(n: int) -> list[str]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _hex(color) -> str:
    return "#" + "".join(f"{round(c * 255):02x}" for c in color[:3])


def draw_overlay(
    plot: Overlay, runs: list[RunData], labels: list[str], colors: list
) -> tuple[str | None, list]:
    """The data URI of one overlay plot (None when no run has the key) and the labels of runs without it."""
    fig, ax = figure()
    missing = []
    for data, label, color in zip(runs, labels, colors):
        xs, ys, _ = series(data.stages.get("ppo", []), plot.key)
        if not any(math.isfinite(y) for y in ys):
            missing.append(label)
            continue
        ax.plot(xs, ys, color=color, label=label, marker="o" if len(xs) <= 40 else None, markersize=3)
        if plot.key == "gold/score" and data.summary is not None:  # the run's starting gold, dashed
            before = num(data.summary.get("gold_before"))
            if before is not None and math.isfinite(before):
                ax.axhline(before, color=color, linestyle="--", linewidth=1)
    if len(missing) == len(runs):
        return None, missing
    ax.set_title(overlay_title(plot, runs))
    ax.set_xlabel("PPO iteration")
    ax.set_ylabel(plot.ylabel)
    ax.legend(fontsize=8)
    return _png_data_uri(fig), missing


def overlay_title(plot: Overlay, runs: list[RunData]) -> str:
    """``plot``'s title; the reward plot named by the runs' reward when they all have the same kind."""
    if plot.name != "score":
        return plot.title
    kinds = {reward_source(data.ppo_source)[0] for data in runs}
    return f"{kinds.pop()} (rollouts)" if len(kinds) == 1 else plot.title


def draw_gold_vs_kl(runs: list[RunData], labels: list[str], colors: list) -> str | None:
    """Gold against KL, one line per run through its evaluations in order of KL (the frontier the runs
    trace; in iteration order the line would zig-zag wherever KL fell between evaluations)."""
    fig, ax = figure()
    drawn = 0
    for data, label, color in zip(runs, labels, colors):
        pts = [(num(r.get("eval/kl")), num(r.get("gold/score"))) for r in data.stages.get("ppo", [])]
        pts = [
            (k, g)
            for k, g in pts
            if k is not None and g is not None and math.isfinite(k) and math.isfinite(g)
        ]
        if pts:
            pts.sort()
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], color=color, marker="o", markersize=3, label=label
            )
            drawn += 1
    if not drawn:
        return None
    ax.set_title("Gold score against KL (one point per evaluation, in order of KL)")
    ax.set_xlabel("KL to the reference (nats per response)")
    ax.set_ylabel("gold score")
    ax.legend(fontsize=8)
    return _png_data_uri(fig)


# ---------------------------------------------------------------------------------------------- table


def _fmt(x: float | None, digits: int = 3, se: float | None = None, signed: bool = False) -> str:
    if x is None:
        return "—"
    text = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return text + (f" ± {se:.{digits}f}" if se is not None else "")


def summary_rows(data: RunData) -> dict[str, tuple[str, float | None]]:
    """column -> (shown text, number used to pick the best run) for one run."""
    ppo = data.stages.get("ppo", [])
    s = data.summary or {}
    steps = [num(r.get("step")) for r in ppo]
    steps = [x for x in steps if x is not None and math.isfinite(x)]
    out: dict[str, tuple[str, float | None]] = {"iterations": (_fmt(max(steps), 0) if steps else "—", None)}
    for col, key in (
        (f"score (last {LAST})", "objective/score"),
        (f"KL (last {LAST})", "objective/kl"),
        (f"entropy (last {LAST})", "objective/entropy"),
        (f"response len (last {LAST})", "rollout/response_len"),
    ):
        v = tail_mean(ppo, key)
        out[col] = (_fmt(v), v)
    beta = last_value(ppo, "objective/kl_coef")
    out["final beta"] = (_fmt(beta, 4), beta)
    gold = last_value(ppo, "gold/score")
    out["gold (last eval)"] = (_fmt(gold), gold)
    out["KL (last eval)"] = (_fmt(last_value(ppo, "eval/kl")), None)
    paired = gold_comparison(data.before or [], data.after or [])
    before, after = num(s.get("gold_before")), num(s.get("gold_after"))
    if paired is not None:
        (b, sb), (a, sa), (g, sg) = paired["before"], paired["after"], paired["gain"]
        out["gold before"] = (_fmt(b, se=sb), b)
        out["gold after"] = (_fmt(a, se=sa), a)
        out["gold gain"] = (_fmt(g, se=sg, signed=True), g)
    elif before is not None or after is not None:
        out["gold before"] = (_fmt(before), before)
        out["gold after"] = (_fmt(after), after)
        gain = after - before if before is not None and after is not None else None
        out["gold gain"] = (_fmt(gain, signed=True), gain)
    out["KL after (summary)"] = (_fmt(num(s.get("kl"))), None)
    out["RM accuracy"] = (_fmt(num(s.get("rm_accuracy"))), num(s.get("rm_accuracy")))
    return out


# higher is better for these columns: the best run's cell is highlighted
_BEST = {f"score (last {LAST})", "gold (last eval)", "gold after", "gold gain", "RM accuracy"}


def summary_table(runs: list[RunData], labels: list[str], colors: list) -> str:
    rows = [summary_rows(d) for d in runs]
    columns = [
        c for c in dict.fromkeys(k for r in rows for k in r) if any(r.get(c, ("—",))[0] != "—" for r in rows)
    ]
    best = {}
    for c in columns:
        values = [r.get(c, ("—", None))[1] for r in rows]
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if c in _BEST and len(runs) > 1 and len(finite) > 1 and len(set(finite)) > 1:
            best[c] = max(finite)
    head = "<tr><th>run</th>" + "".join(f"<th>{esc(c)}</th>" for c in columns) + "</tr>"
    body = []
    for r, label, color, data in zip(rows, labels, colors, runs):
        cells = []
        for c in columns:
            text, value = r.get(c, ("—", None))
            cls = "num best" if c in best and value == best[c] else "num"
            cells.append(f'<td class="{cls}">{esc(text)}</td>')
        swatch = f'<span class="swatch" style="background:{_hex(color)}"></span>'
        body.append(
            f'<tr><th title="{esc(run_name(data.run_dir))}">{swatch}{esc(label)}</th>'
            + "".join(cells)
            + "</tr>"
        )
    return "<table>\n" + head + "\n" + "\n".join(body) + "\n</table>"


def differences_table(runs: list[RunData], labels: list[str]) -> str:
    diffs = config_differences([flat_config(d.run_dir) for d in runs])
    if not diffs:
        return "<p>No config.yaml differences between these runs (or no config.yaml recorded).</p>"

    def cell(v: str) -> str:
        return esc(v if len(v) <= 80 else v[:77] + "...")

    head = "<tr><th>key</th>" + "".join(f"<th>{esc(x)}</th>" for x in labels) + "</tr>"
    body = [
        f"<tr><th>{esc(k)}</th>" + "".join(f'<td class="text">{cell(v)}</td>' for v in values) + "</tr>"
        for k, values in diffs
    ]
    return "<table>\n" + head + "\n" + "\n".join(body) + "\n</table>"


# ----------------------------------------------------------------------------------------------- page


def render_comparison(run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    """Write the comparison page of ``run_dirs`` to ``out``; returns its path. Raises :class:`ShifuError`
    when a run directory is missing or empty, when fewer than two are given, or when ``out`` cannot be
    written."""
    dirs = [Path(d) for d in run_dirs]
    if len(dirs) < 2:
        raise ShifuError(
            "a comparison needs at least two run directories (`shifu report RUN` renders one run)"
        )
    if labels is not None and len(labels) != len(dirs):
        raise ShifuError(f"--labels gives {len(labels)} names for {len(dirs)} runs; give one per run")
    runs = [load_run(d) for d in dirs]
    labels = labels or run_labels(dirs)
    colors = _colors(len(runs))
    notes = [f"{label}: {n}" for label, data in zip(labels, runs) for n in data.notes]
    figures = []
    for plot in OVERLAYS:
        uri, missing = draw_overlay(plot, runs, labels, colors)
        if uri is None:
            notes.append(f"{plot.name}: no run has {plot.key} in its PPO metrics")
            continue
        figures.append((plot.name, uri, f"{overlay_title(plot, runs)}: {plot.key} per run"))
        if missing:
            notes.append(f"{plot.name}: no {plot.key} in {', '.join(missing)}")
    uri = draw_gold_vs_kl(runs, labels, colors)
    if uri is None:
        notes.append(f"{GOLD_VS_KL}: no run has evaluations with both eval/kl and gold/score")
    else:
        figures.append((GOLD_VS_KL, uri, "gold/score against eval/kl, one line per run in order of KL"))

    title = "shifu run comparison: " + ", ".join(labels)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{CSS}{_EXTRA_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        '<p class="sub">'
        + "<br>".join(f"{esc(x)}: {esc(_beside(d, Path(out)))}" for x, d in zip(labels, dirs))
        + "</p>",
        "<h2>Summary</h2>",
        f"<p>End-of-run values; (last {LAST}) is the mean of the last {LAST} iterations. ± is one standard "
        "error over held-out prompts (paired for the gain). The best value of a column is highlighted.</p>",
        summary_table(runs, labels, colors),
        "<h2>Config differences</h2>",
        differences_table(runs, labels),
    ]
    if notes:
        parts.append('<div class="notes"><b>Not shown or partly shown:</b><ul>')
        parts += [f"<li>{esc(n)}</li>" for n in notes]
        parts.append("</ul></div>")
    parts.append('<h2>Training curves</h2><div class="plots">')
    for name, uri, caption in figures:
        parts.append(
            f'<figure><img src="{uri}" alt="{esc(name)}" width="640" height="360">'
            f"<figcaption>{esc(caption)}</figcaption></figure>"
        )
    parts += ["</div>", "</body></html>"]

    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("\n".join(parts) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise ShifuError(f"cannot write the comparison to {path}: {e}") from e
    return path


def main(argv: list[str] | None = None) -> int:
    """``shifu report RUN_DIR [--max-samples N]``, or ``shifu report RUN_A RUN_B ... [--out FILE]``."""
    p = argparse.ArgumentParser(
        prog="shifu report",
        description="render report.html for a run directory; with several, one page comparing them",
    )
    p.add_argument("run_dir", nargs="+", help="run directories written by `shifu quickstart` or a trainer")
    p.add_argument("--max-samples", type=int, default=64, help="sample rows shown before/after (default 64)")
    p.add_argument(
        "--out", default=None, help="comparison page to write (several runs only; default compare.html)"
    )
    p.add_argument(
        "--labels", default=None, help="comparison: comma-separated run names (default: dir names)"
    )
    args = p.parse_args(argv)
    if len(args.run_dir) > 1:
        labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
        path = render_comparison(args.run_dir, args.out or "compare.html", labels)
        print(f"wrote {path} ({len(args.run_dir)} runs)", file=sys.stderr)
        return 0
    if args.out or args.labels:
        raise ShifuError(
            "--out and --labels are for comparisons of several runs; one run's report is RUN_DIR/report.html"
        )
    path = report.render_report(args.run_dir[0], max_samples=args.max_samples)
    n_png = len(list((path.parent / "report").glob("*.png")))
    print(f"wrote {path} ({n_png} plots)", file=sys.stderr)
    return 0

"""``shifu report RUN_DIR``: render ``RUN_DIR/report.html`` and its PNG plots from what a run wrote.
(The command ``shifu report`` is :func:`shifu.reporting.compare.main`: one run's report, or several runs compared.)

Reads (every piece optional; whatever is missing is named in the page instead of drawn):

- ``summary.json``: ``gold_before``, ``gold_after``, ``kl`` (nats per response), ``rm_accuracy``,
  ``seconds`` (stage -> seconds), ``task``, ``preset``, ``seed`` and any other scalars;
- ``sft/metrics.jsonl``, ``rm/metrics.jsonl``, ``ppo/metrics.jsonl`` (one row per step, keys from
  :data:`shifu.runs.metrics.METRICS`; non-finite values are the strings ``"nan"``/``"inf"``). A single trainer's
  run directory with ``metrics.jsonl`` at its top works too: its rows go to the stage their keys name;
- ``samples_before.jsonl`` / ``samples_after.jsonl``: ``{"prompt", "response", "gold"}`` rows for the same
  held-out prompts in the same order, shown side by side; for a ``shifu ppo`` run, its ``samples.jsonl``
  (``{"iteration", "prompt", "response", "score", "gold"?}`` per evaluation): its first and its last evaluation
  side by side.

Any stage's run directory works: a quickstart run (``sft/``, ``rm/``, ``ppo/``), or the ``--out`` of
``shifu sft`` (loss), ``shifu rm`` (accuracy), ``shifu dpo`` (loss, accuracy, margin) or ``shifu ppo``
(score, gold, KL, ... and its samples). Only the plots of the stages the run has are drawn or listed.

Writes ``report.html`` (self-contained: inline CSS, no scripts, no external resources) and
``report/NAME.png`` (referenced by relative path). Plots use matplotlib's object API with the Agg
renderer, so rendering never touches pyplot's global backend state.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from pathlib import Path
from typing import Any

from shifu.errors import ShifuError

STAGES = ("sft", "rm", "dpo", "ppo")
QUICKSTART_STAGES = ("sft", "rm", "ppo")  # the stages a quickstart run is expected to have
# which stage a top-level metrics.jsonl row belongs to, from the namespace of its keys
_STAGE_PREFIXES = {
    "ppo": ("objective/", "policy/", "value/", "rollout/", "gold/", "eval/score", "eval/kl"),
    "rm": ("rm/", "eval/rm/"),
    "dpo": ("dpo/", "eval/dpo/"),
    "sft": ("sft/", "eval/sft/"),
}
_X_LABEL = {"ppo": "PPO iteration", "rm": "reward-model step", "dpo": "DPO step", "sft": "SFT step"}


@dataclasses.dataclass(frozen=True)
class Plot:
    """One PNG: ``keys`` of one stage's metrics drawn against ``step``."""

    name: str
    title: str
    ylabel: str
    stage: str
    keys: tuple[str, ...]


# The report's plots over iterations, in page order; `gold_vs_kl` is drawn separately (one point per eval).
PLOTS: tuple[Plot, ...] = (
    Plot(
        "score",
        "Reward-model score",
        "score",
        "ppo",
        ("objective/score", "objective/rlhf_reward", "eval/score"),
    ),
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
_INPUTS = (
    "summary.json",
    *(f"{s}/metrics.jsonl" for s in STAGES),
    "samples_before.jsonl",
    "samples_after.jsonl",
    "samples.jsonl",
)


@dataclasses.dataclass
class RunData:
    """Everything read from a run directory; ``notes`` lists what was missing or unreadable.

    ``kind``: ``quickstart`` (stages in subdirectories), a trainer's stage (``sft``, ``rm``, ``dpo``,
    ``ppo``: its ``metrics.jsonl`` at the top), or ``run`` (only samples or a summary). ``sample_labels``
    name the two sides of the sample table (``before``, ``after``)."""

    run_dir: Path
    summary: dict[str, Any] | None
    stages: dict[str, list[dict[str, Any]]]
    before: list[dict[str, Any]] | None
    after: list[dict[str, Any]] | None
    notes: list[str]
    kind: str = "quickstart"
    sample_labels: tuple[str, str] = ("before PPO (SFT policy)", "after PPO (final policy)")

    @property
    def expected_stages(self) -> tuple[str, ...]:
        """The stages this run should have: a missing one is named in the page, the others are not."""
        if self.kind == "quickstart":
            return tuple(s for s in STAGES if s in QUICKSTART_STAGES or s in self.stages)
        return (self.kind,) if self.kind in STAGES else tuple(self.stages)


def _num(v: Any) -> float | None:
    """A metric value as float: numbers as they are, ``"nan"``/``"inf"``/``"-inf"`` strings as floats,
    anything else (null, bool, text) as None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            return None
        return x if not math.isfinite(x) else None  # only the non-finite spellings Tracker writes
    return None


def read_json(path: Path, notes: list[str], consequence: str = "") -> dict[str, Any] | None:
    """A JSON object file of a run, or None (missing; or unreadable, with a note ending in ``consequence``)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        notes.append(f"{path.name} is not valid JSON ({e}){consequence}")
        return None
    if not isinstance(value, dict):
        notes.append(f"{path.name} is not a JSON object{consequence}")
        return None
    return value


def _read_jsonl(path: Path, notes: list[str], run_dir: Path) -> list[dict[str, Any]] | None:
    """Rows of a JSONL file; a bad line (e.g. the last line of a killed run) is skipped with a note."""
    if not path.is_file():
        return None
    rows, bad = [], []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(i)
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(i)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        notes.append(
            f"{path.relative_to(run_dir)}: skipped {len(bad)} line(s) that are not JSON objects (line {shown})"
        )
    return rows


def _stage_of(row: dict[str, Any]) -> str | None:
    for stage, prefixes in _STAGE_PREFIXES.items():
        if any(k.startswith(prefixes) for k in row):
            return stage
    return None


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory. Raises :class:`ShifuError` if it does not exist or holds nothing to report."""
    run = Path(run_dir)
    if not run.exists():
        raise ShifuError(
            f"run directory {run} does not exist (pass the --out directory of `shifu quickstart` or a trainer)"
        )
    if not run.is_dir():
        raise ShifuError(f"{run} is not a directory (pass a run directory, not a file inside it)")
    notes: list[str] = []
    summary = read_json(run / "summary.json", notes, "; the summary table is omitted")
    stages: dict[str, list[dict[str, Any]]] = {}
    for stage in STAGES:
        rows = _read_jsonl(run / stage / "metrics.jsonl", notes, run)
        if rows is not None:
            stages[stage] = rows
    top = _read_jsonl(run / "metrics.jsonl", notes, run) or []
    for row in top:  # a single trainer's run: its rows go to the stage their keys name
        stage = _stage_of(row)
        if stage is not None and not (run / stage / "metrics.jsonl").is_file():
            stages.setdefault(stage, []).append(row)
    before = _read_jsonl(run / "samples_before.jsonl", notes, run)
    after = _read_jsonl(run / "samples_after.jsonl", notes, run)
    labels = RunData.sample_labels
    if before is None and after is None:  # a `shifu ppo` run: its evaluations' samples
        before, after, labels = _ppo_samples(_read_jsonl(run / "samples.jsonl", notes, run), notes)
    if summary is None and not any(stages.values()) and not before and not after:
        raise ShifuError(
            f"{run}: nothing to report: none of {', '.join(_INPUTS)} (or a top-level metrics.jsonl) "
            "exists with content (pass the --out directory of `shifu quickstart` or a trainer)"
        )
    if any((run / stage / "metrics.jsonl").is_file() for stage in STAGES) or "gold_before" in (summary or {}):
        kind = "quickstart"
    else:  # a trainer's run: the stage its metric keys name
        kind = next((s for s in STAGES if s in stages), "ppo" if after else "run")
    return RunData(run, summary, stages, before, after, notes, kind, labels)


def _ppo_samples(
    rows: list[dict[str, Any]] | None, notes: list[str]
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None, tuple[str, str]]:
    """(first evaluation's rows, last evaluation's rows, their labels) of a ``shifu ppo`` run's
    ``samples.jsonl``; one evaluation only is shown as the "after" side, and said so."""
    if not rows:
        return None, None, RunData.sample_labels
    by_iteration: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        it = _num(row.get("iteration"))
        if it is not None and math.isfinite(it):
            by_iteration.setdefault(int(it), []).append(row)
    if not by_iteration:
        notes.append("samples.jsonl: no row has an iteration number; the sample table is omitted")
        return None, None, RunData.sample_labels
    first, last = min(by_iteration), max(by_iteration)
    after_label = f"iteration {last} (last evaluation)"
    if first == last:
        notes.append(f"samples.jsonl holds one evaluation (iteration {last}): no earlier samples to compare")
        return None, by_iteration[last], ("", after_label)
    before_label = f"iteration {first}" + (" (initial policy)" if first == 0 else " (first evaluation)")
    return by_iteration[first], by_iteration[last], (before_label, after_label)


# ---------------------------------------------------------------------------------------------- plots


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float], int]:
    """(steps, values, number of non-finite values) of ``key``; non-finite values become NaN gaps."""
    xs, ys, nonfinite = [], [], 0
    for i, row in enumerate(rows):
        y = _num(row.get(key))
        if y is None:
            continue
        x = _num(row.get("step"))
        xs.append(float(i) if x is None or not math.isfinite(x) else x)
        if not math.isfinite(y):
            nonfinite += 1
            y = math.nan
        ys.append(y)
    return xs, ys, nonfinite


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    # fixed margins: constrained layout would double the drawing time
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def _draw(plot: Plot, rows: list[dict[str, Any]], summary: dict[str, Any] | None, path: Path) -> str | None:
    """Draw one plot to ``path``; returns None, or why nothing was drawn."""
    drawn, notes = 0, []
    fig, ax = _figure()
    for key in plot.keys:
        xs, ys, nonfinite = _series(rows, key)
        if not any(math.isfinite(y) for y in ys):
            continue
        # sparse series (evaluation rows) get markers so single points are visible
        ax.plot(xs, ys, marker="o" if len(xs) <= 40 else None, markersize=4, label=key)
        drawn += 1
        if nonfinite:
            notes.append(f"{nonfinite} non-finite value(s) of {key} left as gaps")
    if not drawn:
        return f"no finite values of {', '.join(plot.keys)} in {plot.stage}/metrics.jsonl"
    if plot.name == "gold" and summary is not None and _num(summary.get("gold_before")) is not None:
        ax.axhline(
            _num(summary["gold_before"]), color="gray", linestyle="--", label="SFT policy (gold_before)"
        )
    ax.set_title(plot.title)
    ax.set_xlabel(_X_LABEL[plot.stage])
    ax.set_ylabel(plot.ylabel)
    if len(ax.get_lines()) > 1:
        ax.legend(fontsize=8)
    _save(fig, path)
    return "; ".join(notes) if notes else None


def _draw_gold_vs_kl(rows: list[dict[str, Any]], summary: dict[str, Any] | None, path: Path) -> str | None:
    """Gold score against KL, one point per evaluation (in iteration order), plus the summary's end points.

    The SFT policy is the reference, so "before" sits at KL = 0 by definition. Over-optimisation shows as
    the curve turning down while KL keeps growing."""
    points = []
    for row in rows:
        kl, gold = _num(row.get("eval/kl")), _num(row.get("gold/score"))
        if kl is not None and gold is not None and math.isfinite(kl) and math.isfinite(gold):
            points.append((kl, gold, row.get("step")))
    s = summary or {}
    before, after, kl_after = _num(s.get("gold_before")), _num(s.get("gold_after")), _num(s.get("kl"))
    has_before = before is not None and math.isfinite(before)
    has_after = all(v is not None and math.isfinite(v) for v in (after, kl_after))
    if not points and not (has_before or has_after):
        return "no evaluation rows with both eval/kl and gold/score, and no gold_before/gold_after in summary.json"
    fig, ax = _figure()
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4, label="evaluations")
        ends = [(points[0], (4, 4), "left")] + ([(points[-1], (-4, 6), "right")] if len(points) > 1 else [])
        for (kl, gold, step), offset, align in ends:
            ax.annotate(
                f"it {step}", (kl, gold), textcoords="offset points", xytext=offset, ha=align, fontsize=7
            )
    if has_before:
        ax.plot([0.0], [before], marker="*", markersize=12, linestyle="none", label="SFT policy (before)")
    if has_after:
        ax.plot([kl_after], [after], marker="s", markersize=7, linestyle="none", label="final policy (after)")
    ax.set_title("Gold score against KL")
    ax.set_xlabel("KL to the reference (nats per response)")
    ax.set_ylabel("gold score")
    ax.legend(fontsize=8)
    _save(fig, path)
    return None


# ----------------------------------------------------------------------------------------------- html

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1340px;
       color: #222; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.85em; max-width: 30em; }
.up { color: #1a7f37; } .down { color: #c62828; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
figure { margin: 0; } figcaption { font-size: 0.85em; color: #555; max-width: 640px; }
.notes { background: #fff8e1; border-left: 4px solid #f0b400; padding: 0.5em 1em; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _f(v: Any, digits: int = 3, signed: bool = False) -> str:
    x = _num(v)
    if x is None:
        return "—"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _summary_html(summary: dict[str, Any], n_prompts: int | None) -> str:
    s = summary
    before, after = _num(s.get("gold_before")), _num(s.get("gold_after"))
    delta = after - before if before is not None and after is not None else None
    rows: list[tuple[str, str, str]] = []  # (label, value html, css class)
    for key in ("task", "preset", "seed"):
        if key in s:
            rows.append((key, _e(s[key]), ""))
    if "gold_before" in s or "gold_after" in s:
        rows.append(("gold before PPO (SFT policy)", _f(before), "num"))
        rows.append(("gold after PPO (final policy)", _f(after), "num"))
        cls = "" if delta is None or delta == 0 else ("up" if delta > 0 else "down")
        rows.append(
            ("gold delta (after - before)", f'<span class="{cls}">{_f(delta, signed=True)}</span>', "num")
        )
    if "kl" in s:
        rows.append(("KL final vs reference (nats per response)", _f(s["kl"]), "num"))
    if "rm_accuracy" in s:
        shown = _f(s["rm_accuracy"]) if s["rm_accuracy"] is not None else "— (no learned reward model)"
        rows.append(("reward-model accuracy (held-out)", shown, "num"))
    if n_prompts:
        rows.append(("held-out prompts in the samples", str(n_prompts), "num"))
    seconds = s.get("seconds")
    if isinstance(seconds, dict):
        total = 0.0
        for stage, sec in seconds.items():
            x = _num(sec)
            total += x if x is not None and math.isfinite(x) else 0.0
            rows.append((f"time: {_e(stage)}", f"{_f(sec, 1)} s", "num"))
        rows.append(("time: total", f"{total:.1f} s", "num"))
    # shown above (gold_gain and seconds_total are the delta and total rows)
    known = {"task", "preset", "seed", "gold_before", "gold_after", "gold_gain", "kl", "rm_accuracy"}
    known |= {"seconds", "seconds_total"}
    for key, value in s.items():  # anything else the run recorded, verbatim
        if key in known:
            continue
        if isinstance(value, (list, dict)) and len(json.dumps(value)) > 200:
            # (a ppo run's `evals`: every evaluation's metrics, which the plots show)
            shown = f"{len(value)} entries (in summary.json)"
            rows.append((_e(key), shown, ""))
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            shown, c = (str(value) if isinstance(value, int) else f"{value:.4g}"), "num"
        else:
            shown, c = _e(value if isinstance(value, str) else json.dumps(value)), ""
        rows.append((_e(key), shown, c))
    body = "\n".join(f'<tr><th>{label}</th><td class="{c}">{v}</td></tr>' for label, v, c in rows)
    return f"<table>\n{body}\n</table>"


def _response(row: dict[str, Any]) -> str:
    """A sample's response cell: a multi-turn episode's transcript shows the policy's turns (the trained spans,
    between the marks of :data:`shifu.generation.episodes.MARKS`) highlighted."""
    return _e(row.get("response", "")).replace("\u27e6", "<mark>").replace("\u27e7", "</mark>")


def _samples_html(data: RunData, max_samples: int, notes: list[str]) -> str:
    before, after = data.before or [], data.after or []
    files = "samples.jsonl" if data.kind == "ppo" else "samples_before.jsonl / samples_after.jsonl"
    if not before and not after:
        notes.append(f"no {files}: the sample table is omitted")
        return "<p>No samples were written for this run.</p>"
    if data.kind != "ppo" and (not before or not after):  # (a ppo run's notes come from _ppo_samples)
        missing = "samples_before.jsonl" if not before else "samples_after.jsonl"
        notes.append(f"{missing} is missing or empty: only one side of the sample table is shown")
    n = max(len(before), len(after))
    if before and after and len(before) != len(after):
        notes.append(f"the two sample sets have {len(before)} and {len(after)} rows; paired by position")
    # the gold judge's value when the run had one, else the reward's score (a ppo run without a gold judge)
    key = "gold" if any("gold" in r for r in before + after) else "score"
    with_kl = any(_num(r.get("kl")) is not None for r in after)  # quickstart stores each response's KL
    one_side = not before
    mismatched = 0
    rows = []
    for i in range(min(n, max_samples)):
        b = before[i] if i < len(before) else {}
        a = after[i] if i < len(after) else {}
        prompt = b.get("prompt", a.get("prompt", ""))
        if b and a and b.get("prompt") != a.get("prompt"):
            mismatched += 1
            prompt = f"{b.get('prompt', '')}\n[after: {a.get('prompt', '')}]"
        gb, ga = _num(b.get(key)), _num(a.get(key))
        d = ga - gb if gb is not None and ga is not None else None
        cls = "" if d is None or d == 0 else ("up" if d > 0 else "down")
        cells = [f'<td class="num">{i + 1}</td><td class="text">{_e(prompt)}</td>']
        if not one_side:
            cells.append(f'<td class="text">{_response(b)}</td><td class="num">{_f(gb)}</td>')
        cells.append(f'<td class="text">{_response(a)}</td><td class="num">{_f(ga)}</td>')
        if not one_side:
            cells.append(f'<td class="num {cls}">{_f(d, signed=True)}</td>')
        if with_kl:
            cells.append(f'<td class="num">{_f(a.get("kl"), 2)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    if mismatched:
        notes.append(f"{mismatched} sample row(s) have different prompts before and after; both are shown")
    label_before, label_after = data.sample_labels
    value = "gold" if key == "gold" else "score (reward)"
    head = "<tr><th>#</th><th>prompt</th>"
    if not one_side:
        head += f"<th>{_e(label_before)}</th><th>{value}</th>"
    head += f"<th>{_e(label_after)}</th><th>{value}</th>"
    head += ("" if one_side else "<th>delta</th>") + ("<th>KL after (nats)</th>" if with_kl else "") + "</tr>"
    shown = f"<p>First {min(n, max_samples)} of {n} held-out prompts.</p>" if n > max_samples else ""
    return shown + "<table>\n" + head + "\n" + "\n".join(rows) + "\n</table>"


def render_report(run_dir: str | Path, max_samples: int = 64) -> Path:
    """Write ``run_dir/report.html`` and ``run_dir/report/*.png``; returns the path of the HTML file.

    Missing files or keys omit their plot or table and are listed in the page. Raises
    :class:`ShifuError` when ``run_dir`` does not exist or holds nothing to report.
    """
    data = load_run(run_dir)
    try:
        return _render(data, max_samples)
    except OSError as e:  # read-only directory, disk full, `report` exists as a file, ...
        raise ShifuError(f"cannot write the report into {data.run_dir}: {e}") from e


def _render(data: RunData, max_samples: int) -> Path:
    run = data.run_dir
    notes = list(data.notes)
    img_dir = run / "report"
    img_dir.mkdir(exist_ok=True)
    for name in [p.name for p in PLOTS] + [GOLD_VS_KL]:  # drop plots of an earlier render
        (img_dir / f"{name}.png").unlink(missing_ok=True)

    figures = []
    ppo_rows = data.stages.get("ppo", [])
    for plot in PLOTS:
        rows = data.stages.get(plot.stage)
        if not rows and plot.stage not in data.expected_stages:
            continue  # another stage's plot (a DPO run has no PPO curves): nothing is missing
        if not rows:
            no_rm = (
                plot.stage == "rm" and data.summary is not None and data.summary.get("rm_accuracy", 0) is None
            )
            why = "this run has no learned reward model" if no_rm else f"no {plot.stage}/metrics.jsonl rows"
            notes.append(f"{plot.name}.png omitted: {why}")
            continue
        why = _draw(plot, rows, data.summary, img_dir / f"{plot.name}.png")
        if (img_dir / f"{plot.name}.png").exists():
            figures.append((plot.name, f"{plot.title}: {', '.join(plot.keys)} over {_X_LABEL[plot.stage]}s"))
            if why:
                notes.append(f"{plot.name}.png: {why}")
        else:
            notes.append(f"{plot.name}.png omitted: {why}")
    if "ppo" in data.expected_stages:
        why = _draw_gold_vs_kl(ppo_rows, data.summary, img_dir / f"{GOLD_VS_KL}.png")
        if why is None:
            figures.append(
                (GOLD_VS_KL, "gold/score against eval/kl, one point per evaluation; star: SFT policy")
            )
        else:
            notes.append(f"{GOLD_VS_KL}.png omitted: {why}")

    if data.summary is None:
        notes.append("no summary.json: the summary table is omitted")
    # sft, rm and dpo runs generate nothing: no sample table to miss
    has_samples = data.kind in ("quickstart", "ppo", "run") or data.before or data.after
    samples = _samples_html(data, max_samples, notes) if has_samples else None
    n_prompts = len(data.before or data.after or []) or None

    s = data.summary or {}
    if "task" in s:
        title = f"shifu run report: {s['task']}"
    elif data.kind in STAGES:
        title = f"shifu run report: shifu {data.kind} run {run.resolve().name}"
    else:
        title = "shifu run report"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(run.resolve())}</p>',
    ]
    if data.summary is not None:
        parts += ["<h2>Summary</h2>", _summary_html(data.summary, n_prompts)]
    if notes:
        parts.append('<div class="notes"><b>Not shown or partly shown:</b><ul>')
        parts += [f"<li>{_e(n)}</li>" for n in notes]
        parts.append("</ul></div>")
    parts.append('<h2>Training curves</h2><div class="plots">')
    for name, caption in figures:
        parts.append(
            f'<figure><img src="report/{name}.png" alt="{_e(name)}" width="640" height="360">'
            f"<figcaption>{_e(caption)}</figcaption></figure>"
        )
    parts.append("</div>")
    if samples is not None:
        parts += ["<h2>Samples on held-out prompts</h2>", samples]
    parts.append("</body></html>")

    out = run / "report.html"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(parts) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return out

"""``shifu report RUN_DIR``: render ``RUN_DIR/report.html`` and its PNG plots from what a run wrote.
(The command ``shifu report`` is :func:`shifu.reporting.compare.main`: one run's report, or several runs compared.)

What is read, and how a missing piece is named instead of drawn: :mod:`shifu.reporting.run_data`. The plots:
:mod:`shifu.reporting.plots`. The summary and time tables' wording: :mod:`shifu.reporting.summary`.

Any stage's run directory works: a quickstart run (``sft/``, ``rm/``, ``ppo/``), or the ``--out`` of
``shifu sft`` (loss), ``shifu rm`` (accuracy), ``shifu dpo`` (loss, accuracy, margin) or ``shifu ppo``
(score, gold, KL, ... and its samples). Only the plots of the stages the run has are drawn or listed.

Writes ``report.html`` (self-contained: inline CSS, no scripts, no external resources) and
``report/NAME.png`` (referenced by relative path).
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from shifu.errors import ShifuError
from shifu.reporting import summary as words
from shifu.reporting.names import run_name
from shifu.reporting.plots import GOLD_VS_KL, PLOTS, X_LABEL, draw, draw_gold_vs_kl, title
from shifu.reporting.run_data import (
    QUICKSTART_STAGES,
    STAGES,
    RunData,
    load_run,
    num,
    read_json,
    reward_source,
)

__all__ = ["GOLD_VS_KL", "PLOTS", "QUICKSTART_STAGES", "RunData", "load_run", "read_json", "render_report"]

# ----------------------------------------------------------------------------------------------- html

CSS = """
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
th.section { background: #e8eef7; }
.notes { background: #fff8e1; border-left: 4px solid #f0b400; padding: 0.5em 1em; }
"""


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _f(v: Any, digits: int = 3, signed: bool = False) -> str:
    x = num(v)
    if x is None:
        return "—"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _table(head: list[str], rows: list[str]) -> str:
    top = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>\n" if head else ""
    return "<table>\n" + top + "\n".join(rows) + "\n</table>"


def _summary_html(data: RunData, n_prompts: int | None) -> str:
    """The summary table (sections of labelled figures, :func:`shifu.reporting.summary.summary_sections`) and
    the time table (wall-clock and CPU seconds per stage)."""
    s = dict(data.summary or {})
    if n_prompts and "eval_prompts" not in s:
        s.setdefault("held-out prompts in the sample table", n_prompts)
    rows = []
    for heading, section in words.summary_sections(
        s, data.stages.get("ppo", []), data.ppo_eval, data.ppo_config, data.ppo_source
    ):
        if heading:
            rows.append(f'<tr><th colspan="2" class="section">{esc(heading)}</th></tr>')
        for label, value, kind in section:
            cls = {"up": "num up", "down": "num down"}.get(kind, kind)
            rows.append(f'<tr><th>{esc(label)}</th><td class="{cls}">{esc(value)}</td></tr>')
    out = _table([], rows)
    if times := words.time_rows(s):
        cells = [
            f'<tr><th>{esc(stage)}</th><td class="num">{w}</td><td class="num">{c}</td></tr>'
            for stage, w, c in times
        ]
        out += "\n<h3>Time per stage</h3>\n" + _table(["stage", "wall-clock", "CPU (all threads)"], cells)
    return out


def _response(row: dict[str, Any]) -> str:
    """A sample's response cell: a multi-turn episode's transcript shows the policy's turns (the trained spans,
    between the marks of :data:`shifu.rollout.batch.MARKS`) highlighted."""
    return esc(row.get("response", "")).replace("\u27e6", "<mark>").replace("\u27e7", "</mark>")


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
    with_kl = any(num(r.get("kl")) is not None for r in after)  # quickstart stores each response's KL
    one_side = not before
    mismatched = 0
    rows = []
    for i in range(min(n, max_samples)):
        b = before[i] if i < len(before) else {}
        a = after[i] if i < len(after) else {}
        # an episode's first input as the policy read it (the environment's reset), else the row's prompt
        prompt = b.get("input", b.get("prompt", a.get("input", a.get("prompt", ""))))
        if b and a and b.get("prompt") != a.get("prompt"):
            mismatched += 1
            prompt = f"{b.get('prompt', '')}\n[after: {a.get('prompt', '')}]"
        gb, ga = num(b.get(key)), num(a.get(key))
        d = ga - gb if gb is not None and ga is not None else None
        cls = "" if d is None or d == 0 else ("up" if d > 0 else "down")
        cells = [f'<td class="num">{i + 1}</td><td class="text">{esc(prompt)}</td>']
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
    T = num((data.summary or {}).get("eval_temperature"))
    if "gold_before" in (data.summary or {}) and T is not None:  # how the final evaluation sampled them
        label_before, label_after = (f"{x}, sampled at T={T:g}" for x in (label_before, label_after))
    value = "gold" if key == "gold" else "score (reward)"
    first = "first input (what the policy read)" if any("input" in r for r in before + after) else "prompt"
    head = f"<tr><th>#</th><th>{first}</th>"
    if not one_side:
        head += f"<th>{esc(label_before)}</th><th>{value}</th>"
    head += f"<th>{esc(label_after)}</th><th>{value}</th>"
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


def _caption(plot, data: RunData) -> str:
    """What a plot shows: its title for this run, its keys, its x axis; the reward plot names the reward."""
    text = f"{title(plot, data)}: {', '.join(plot.keys)} over {X_LABEL[plot.stage]}s"
    if plot.name == "score":
        text += f"; the reward is {reward_source(data.ppo_source)[1]}"
    return text


def _title(data: RunData) -> str:
    """The page's title: the task of a pipeline run, the kind and name of a trainer's run."""
    s = data.summary or {}
    if "task" in s:
        return f"shifu run report: {s['task']}"
    if data.kind in STAGES:
        return f"shifu run report: shifu {data.kind} run {data.run_dir.resolve().name}"
    return "shifu run report"


def _figures(data: RunData, img_dir: Path, notes: list[str]) -> list[tuple[str, str]]:
    """Draw the run's plots into ``img_dir``; returns ``(name, caption)`` of each drawn, and adds to
    ``notes`` why any expected plot was omitted or is partial."""
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
        why = draw(plot, rows, data, img_dir / f"{plot.name}.png")
        if (img_dir / f"{plot.name}.png").exists():
            figures.append((plot.name, _caption(plot, data)))
            if why:
                notes.append(f"{plot.name}.png: {why}")
        else:
            notes.append(f"{plot.name}.png omitted: {why}")
    if "ppo" in data.expected_stages:
        why = draw_gold_vs_kl(ppo_rows, data, img_dir / f"{GOLD_VS_KL}.png")
        if why is None:
            caption = (
                "gold/score against KL, one point per PPO evaluation (labelled with its iteration, not joined); "
                "star and square: the SFT and the final policy in the final evaluation"
            )
            figures.append((GOLD_VS_KL, caption))
        else:
            notes.append(f"{GOLD_VS_KL}.png omitted: {why}")
    return figures


def _render(data: RunData, max_samples: int) -> Path:
    run = data.run_dir
    notes = list(data.notes)
    img_dir = run / "report"
    img_dir.mkdir(exist_ok=True)
    for name in [p.name for p in PLOTS] + [GOLD_VS_KL]:  # drop plots of an earlier render
        (img_dir / f"{name}.png").unlink(missing_ok=True)

    figures = _figures(data, img_dir, notes)
    if data.summary is None:
        notes.append("no summary.json: the summary table is omitted")
    # sft, rm and dpo runs generate nothing: no sample table to miss
    has_samples = data.kind in ("quickstart", "ppo", "run") or data.before or data.after
    samples = _samples_html(data, max_samples, notes) if has_samples else None
    n_prompts = len(data.before or data.after or []) or None

    title = _title(data)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="sub">{esc(run_name(run))}</p>',  # (never an absolute path: reports are shared)
    ]
    if data.summary is not None:
        parts += ["<h2>Summary</h2>", _summary_html(data, n_prompts)]
    if notes:
        parts.append('<div class="notes"><b>Not shown or partly shown:</b><ul>')
        parts += [f"<li>{esc(n)}</li>" for n in notes]
        parts.append("</ul></div>")
    parts.append('<h2>Training curves</h2><div class="plots">')
    for name, caption in figures:
        parts.append(
            f'<figure><img src="report/{name}.png" alt="{esc(name)}" width="640" height="360">'
            f"<figcaption>{esc(caption)}</figcaption></figure>"
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

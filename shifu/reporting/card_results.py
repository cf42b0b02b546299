"""What a model card says a run measured: the results rows, read from the run's own files.

:func:`collect_results` reads, each optional (a missing or unreadable file leaves its part out, with a note):

- ``RUN/summary.json`` and ``RUN/metrics.jsonl``: the stage's final and first held-out metrics;
- ``RUN/samples.jsonl`` (PPO): per-prompt gold scores at each evaluation; the first and the last evaluation
  give gold before/after with standard errors (the same prompts, so the gain's error is the paired one);
- the final evaluation of a ``shifu ppo`` run with a gold judge (``eval.gold_function``, or its source's own: an
  environment's or an agent's episode return; its ``summary.json`` holds
  ``gold_before``), or of the ``shifu quickstart`` run it belongs to (``RUN/..``): gold before/after, the paired
  gain and KL (and the quickstart's reward-model accuracy), standard errors from ``samples_before.jsonl`` /
  ``samples_after.jsonl``;
- the reward model's own ``summary.json`` (next to ``reward.model_path``) for its held-out accuracy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from shifu.config.loader import lookup
from shifu.core.stats import mean_se
from shifu.reporting.run_data import ran_source, read_json, reward_source


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; unreadable lines (a killed run's last line) are skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_config(run_dir: Path, notes: list[str]) -> dict[str, Any]:
    """``RUN/config.yaml`` as a dict (empty when missing or unreadable, with a note)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        notes.append("no config.yaml in the run directory: base model and hyper-parameters are not recorded")
        return {}
    try:
        value = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        notes.append(f"config.yaml is not valid YAML ({e})")
        return {}
    return value if isinstance(value, dict) else {}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def gold_comparison(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Gold before/after (mean, standard error) and the gain from per-prompt rows with ``gold``. When both
    lists cover the same prompts in the same order, the gain's error is that of the paired differences;
    otherwise the two errors are combined as independent."""
    gb = [_num(r.get("gold")) for r in before]
    ga = [_num(r.get("gold")) for r in after]
    gb, ga = [x for x in gb if x is not None], [x for x in ga if x is not None]
    if not gb or not ga:
        return None
    (mb, sb), (ma, sa) = mean_se(gb), mean_se(ga)
    paired = len(gb) == len(ga) == len(before) == len(after) and all(
        b.get("prompt") == a.get("prompt") for b, a in zip(before, after)
    )
    if paired:
        _, sg = mean_se([a - b for a, b in zip(ga, gb)])
    else:
        sg = math.sqrt(sb**2 + sa**2) if sb is not None and sa is not None else None
    return {"before": (mb, sb), "after": (ma, sa), "gain": (ma - mb, sg), "n": len(ga), "paired": paired}


def final_summaries(run_dir: Path, notes: list[str]) -> list[tuple[dict[str, Any], Path]]:
    """The summaries with a final evaluation (``gold_before``) of this run and of the quickstart run it
    belongs to (one level up), each with the directory it is in."""
    out = []
    for d in (run_dir, run_dir.parent):
        s = read_json(d / "summary.json", notes)
        if s is not None and "gold_before" in s:
            out.append((s, d))
    return out


def _reward_model_accuracy(source: Any, notes: list[str]) -> float | None:
    """Held-out accuracy of the reward model PPO used (``source``, what made its rollouts), from the summary
    of its ``shifu rm`` run."""
    path = source.reward_model if source is not None else None
    if not path:
        return None
    for d in (Path(path), Path(path).parent):
        s = read_json(d / "summary.json", notes)
        if s is not None and _num(s.get("eval/rm/accuracy")) is not None:
            return _num(s["eval/rm/accuracy"])
    return None


def collect_results(
    kind: str, run_dir: Path, config: dict[str, Any], notes: list[str], source: Any = None
) -> list[tuple]:
    """(label, value text) rows of the measured results of one stage; a PPO run's ``source``: what made its
    rollouts (None: as its ``summary.json`` records it, else as its config names it)."""
    summary = read_json(run_dir / "summary.json", notes) or {}
    source = source if source is not None else ran_source(summary, config) if kind == "ppo" else None
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    rows: list[tuple[str, str]] = []
    if kind == "sft":
        first, last = _first_last(metrics, "eval/sft/loss")
        if first is not None and first != last:
            rows.append(("held-out SFT loss, before -> after (nats/token)", f"{first:.4f} -> {last:.4f}"))
        else:
            _add(rows, "held-out SFT loss (nats/token)", summary.get("eval/sft/loss", last))
        _add(rows, "training loss, last window (nats/token)", summary.get("sft/loss"))
        _add(rows, "steps", summary.get("step"), 0)
    elif kind == "rm":
        _add(rows, "reward-model accuracy, held-out pairs", summary.get("eval/rm/accuracy"))
        _add(rows, "reward-model margin, held-out pairs", summary.get("eval/rm/margin"))
        _add(rows, "length correlation of held-out scores", summary.get("eval/rm/len_corr"))
        _add(rows, "accuracy, training pairs (last window)", summary.get("rm/accuracy"))
    elif kind == "dpo":
        _add(rows, "implicit-reward accuracy, held-out pairs", summary.get("eval/dpo/accuracy"))
        _add(rows, "implicit-reward margin, held-out pairs", summary.get("eval/dpo/margin"))
        _add(rows, "DPO loss, held-out pairs", summary.get("eval/dpo/loss"))
        _add(rows, "steps", summary.get("step"), 0)
    elif kind == "ppo":
        rows += _ppo_results(run_dir, summary, metrics, config, notes, source)
    for final, d in final_summaries(run_dir, notes) if kind in ("ppo", "dpo") else []:
        rows += _final_rows(final, d, _gold_name(config, source) if d == run_dir else None)
    if not rows:
        notes.append("no results recorded (summary.json / metrics.jsonl missing or empty)")
    return rows


def _first_last(metrics: list[dict], key: str) -> tuple[float | None, float | None]:
    vals = [_num(r.get(key)) for r in metrics]
    vals = [v for v in vals if v is not None]
    return (vals[0], vals[-1]) if vals else (None, None)


def _add(rows: list[tuple[str, str]], label: str, value: Any, digits: int = 4) -> None:
    x = _num(value)
    if x is not None:
        rows.append((label, f"{x:.{digits}f}"))


def _ppo_results(
    run_dir: Path, summary: dict, metrics: list[dict], config: dict, notes: list[str], source: Any
) -> list:
    """:func:`collect_results` of a ppo run: gold and score from first to last evaluation, KL, beta."""
    rows: list[tuple[str, str]] = []
    samples = _read_jsonl(run_dir / "samples.jsonl")
    its = sorted({r["iteration"] for r in samples if isinstance(r.get("iteration"), int)})
    if len(its) >= 2:
        gold = gold_comparison(
            [r for r in samples if r.get("iteration") == its[0]],
            [r for r in samples if r.get("iteration") == its[-1]],
        )
        if gold is not None:
            label = (
                f"{_gold_name(config, source)}, held-out prompts, iteration {its[0]} -> {its[-1]} "
                f"(n = {gold['n']})"
            )
            rows += _gold_rows(gold, label)
    evals = [e for e in summary.get("evals", []) if isinstance(e, dict)]
    if evals:
        s0, s1 = _num(evals[0].get("eval/score")), _num(evals[-1].get("eval/score"))
        episodes = source is not None and source.episodes  # (episodes: the return, the gold above)
        if s0 is not None and s1 is not None and not episodes:
            label = f"score by {reward_source(source, run_dir)[1]}, held-out, first -> last evaluation"
            rows.append((label, f"{s0:.4f} -> {s1:.4f}"))
        _add(rows, "KL to the reference at the last evaluation (nats/response)", evals[-1].get("eval/kl"))
    _add(rows, "KL of the last rollout (nats/response)", _first_last(metrics, "objective/kl")[1])
    _add(rows, "final beta (KL coefficient)", summary.get("kl_coef"))
    _add(rows, "iterations", summary.get("iterations"), 0)
    if summary.get("guard"):
        rows.append(("stopped by the guard", str(summary["guard"])))
    _add(rows, "reward-model accuracy, held-out pairs", _reward_model_accuracy(source, notes))
    return rows


def _gold_name(config: dict[str, Any], source: Any) -> str:
    """What a PPO run's per-prompt ``gold`` is: its judge's score (named), or the episode return of the
    environment or agent that made its rollouts (``source``)."""
    judge = lookup(config, "eval.gold_function")
    if not judge and source is not None and source.gold:
        return f"episode return of `{source.spec}`"
    return f"gold (`{judge}`)" if judge else "gold"


def _pm(value: tuple[float, float | None], signed: bool = False) -> str:
    mean, se = value
    text = f"{mean:+.4f}" if signed else f"{mean:.4f}"
    return text + (f" ± {se:.4f}" if se is not None else "")


def _gold_rows(gold: dict[str, Any], label: str) -> list[tuple[str, str]]:
    how = "paired" if gold["paired"] else "independent"
    return [
        (f"{label}: before", _pm(gold["before"])),
        (f"{label}: after", _pm(gold["after"])),
        (f"{label}: gain ({how} standard error)", _pm(gold["gain"], signed=True)),
    ]


def _final_rows(s: dict[str, Any], d: Path, own: str | None) -> list[tuple[str, str]]:
    """Gold before/after of a final evaluation (with standard errors from the sample files): the quickstart's
    end-to-end one, or (``own``: what its gold is) the ppo run's own, of its start and its final policy."""
    gold = gold_comparison(_read_jsonl(d / "samples_before.jsonl"), _read_jsonl(d / "samples_after.jsonl"))
    n = s.get("eval_prompts") or (gold["n"] if gold else None)
    T = _num(s.get("eval_temperature"))
    if own is not None:
        how = ", ".join(x for x in (f"n = {n}" if n else "", f"T = {T:g}" if T is not None else "") if x)
        label = f"{own}, final evaluation: model.path -> final policy, held-out prompts ({how})"
        rows = _gold_rows(gold, label) if gold is not None else []
        if _num(s.get("kl")) is not None:
            rows.append(("KL to the reference, final evaluation (nats/response)", f"{_num(s['kl']):.4f}"))
        return rows
    label = "gold, end-to-end evaluation" + (f" (n = {n})" if n else "")
    if gold is not None:
        rows = _gold_rows(gold, label)
    else:  # only the means were kept
        rows = [
            (f"{label}: {k}", f"{_num(s[key]):.4f}")
            for k, key in (("before", "gold_before"), ("after", "gold_after"))
            if _num(s.get(key)) is not None
        ]
    if s.get("gold_judge"):
        rows.append(("gold judge", str(s["gold_judge"])))
    for label, key in (
        ("KL to the reference, end-to-end (nats/response)", "kl"),
        ("reward-model accuracy, held-out pairs (quickstart)", "rm_accuracy"),
    ):
        if _num(s.get(key)) is not None:
            rows.append((label, f"{_num(s[key]):.4f}"))
    return rows

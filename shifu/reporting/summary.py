"""A run's ``summary.json`` in words: the rows of the report's summary and time tables, and the quickstart's
result lines on the console, with one wording for both.

A quickstart run measures its policy's gold score three ways, and each figure says which: PPO's own held-out
evaluations (``gold/score``: ``ppo.eval.num_prompts`` prompts sampled at ``ppo.eval.temperature``), the final
evaluation on the held-out prompts sampled at ``eval.temperature`` (``gold_before`` / ``gold_after``, with
standard errors and the paired gain), and for arith the same prompts decoded greedily (``gold_greedy_*``).
Keys without a label here are shown under their own name; nested values as ``key: value`` text, never JSON.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shifu.reporting.recipe import method_summary
from shifu.reporting.run_data import num, reward_source

# scalar summary keys and their labels; the final evaluation's keys are labelled by :func:`summary_sections`
LABELS = {
    "task": "task",
    "preset": "preset",
    "seed": "seed",
    "policy": "final policy (directory in the run)",
    "gold_judge": "gold judge",
    "rm_accuracy": "reward-model accuracy (held-out pairs)",
    "iterations": "PPO iterations",
    "best": "best held-out metric (kept in best/)",
    "best_iteration": "iteration of best/",
    "guard": "stopped by the guard",
    "skipped_steps": "optimiser steps skipped (non-finite)",
    "kl_coef": "final KL coefficient beta",
}
TIME_KEYS = ("seconds", "cpu_seconds", "seconds_total", "cpu_seconds_total")
# an environment's episodes: the share that called a tool (None: no episode's Step.info reported tool_calls)
TOOL_USE_KEYS = ("tool_use_before", "tool_use_after", "tool_use_before_se", "tool_use_after_se")
NOT_REPORTED = "not reported (no Step.info of the environment had tool_calls)"
# the final evaluation's figures (:func:`final_evaluation_rows`)
FINAL_KEYS = {
    "gold_before",
    "gold_after",
    "gold_gain",
    "gold_before_se",
    "gold_after_se",
    "gold_gain_se",
    "gold_greedy_before",
    "gold_greedy_after",
    "kl",
    "kl_k1",
    "response_len_before",
    "response_len_after",
    *TOOL_USE_KEYS,
}
Row = tuple[str, str, str]  # (label, value, kind: "num", "up", "down" or "" for text)


def _f(v: Any, digits: int = 3, signed: bool = False) -> str:
    x = num(v)
    if x is None:
        return "—"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _with_se(s: dict[str, Any], key: str, signed: bool = False) -> str:
    se = num(s.get(f"{key}_se"))
    return _f(s.get(key), signed=signed) + (f" ± {se:.3f}" if se is not None else "")


def _text(value: Any) -> tuple[str, str]:
    """(shown value, kind) of a key without a label: numbers as numbers, mappings and lists as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (str(value) if isinstance(value, int) else f"{value:.4g}"), "num"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_text(v)[0]}" for k, v in value.items()), ""
    if isinstance(value, list):
        return ", ".join(_text(v)[0] for v in value), ""
    return ("—" if value is None else str(value)), ""


def final_evaluation_rows(s: dict[str, Any]) -> list[Row]:
    """The final evaluation: gold before/after (sampled, with standard errors), the paired gain, greedy
    accuracies, KL and response lengths; each label says how it was measured."""
    T = num(s.get("eval_temperature"))
    sampled = f", sampled at T={T:g}" if T is not None else ""
    rows: list[Row] = []
    if "gold_before" in s or "gold_after" in s:
        before, after = num(s.get("gold_before")), num(s.get("gold_after"))
        delta = num(s.get("gold_gain"))
        delta = after - before if delta is None and before is not None and after is not None else delta
        s = {**s, "gold_gain": delta}
        rows.append((f"gold, SFT policy (before PPO){sampled}", _with_se(s, "gold_before"), "num"))
        rows.append((f"gold, final policy (after PPO){sampled}", _with_se(s, "gold_after"), "num"))
        trend = "num" if not delta else ("up" if delta > 0 else "down")
        rows.append(
            ("gold gain (after - before, paired over prompts)", _with_se(s, "gold_gain", True), trend)
        )
    for key, who in (
        ("gold_greedy_before", "SFT policy (before PPO)"),
        ("gold_greedy_after", "final policy (after PPO)"),
    ):
        if key in s:
            rows.append((f"gold, {who}, greedy", _f(s[key]), "num"))
    if any(k in s for k in TOOL_USE_KEYS):  # episodes with an environment
        for key, who in (("tool_use_before", "SFT policy"), ("tool_use_after", "final policy")):
            shown = _with_se(s, key) if num(s.get(key)) is not None else NOT_REPORTED
            rows.append((f"tool use, {who} (share of episodes that called a tool)", shown, "num"))
    at = f", T={T:g}" if T is not None else ""
    if "kl" in s:
        rows.append((f"KL final policy to SFT policy (k3, nats per response{at})", _f(s["kl"]), "num"))
    if "kl_k1" in s:
        rows.append(("KL, k1 estimate (nats per response; unbiased, can be negative)", _f(s["kl_k1"]), "num"))
    for key, who in (("response_len_before", "SFT policy"), ("response_len_after", "final policy")):
        if key in s:
            rows.append((f"response length, {who} (tokens)", _f(s[key], 2), "num"))
    return rows


def summary_sections(
    s: dict[str, Any],
    ppo_rows: list[dict[str, Any]],
    ppo_eval: str,
    ppo_config: dict[str, Any] | None = None,
    ppo_source: Any = None,
) -> list[tuple[str, list[Row]]]:
    """(heading, rows) of the report's summary table: the run (with ``ppo_config``, the PPO run's recorded
    config: the method; with ``ppo_source``, what made its rollouts: the reward that ran), the final
    evaluation, PPO's last held-out evaluation (from ``ppo_rows``, sampled as ``ppo_eval`` says), then every
    other key the run recorded."""
    shown = set(TIME_KEYS) | {"eval_prompts", "eval_temperature", "gold_judge", "source"}
    run = [(LABELS[k], _text(s[k])[0], "") for k in ("task", "preset", "seed", "policy") if k in s]
    if ppo_config:
        run += [
            ("method (shifu ppo)", method_summary(ppo_config, ppo_source), ""),
            ("reward", reward_source(ppo_source)[1], ""),
        ]
    shown |= {"task", "preset", "seed", "policy"}
    final = final_evaluation_rows(s)
    shown |= FINAL_KEYS
    n, judge = s.get("eval_prompts"), s.get("gold_judge")
    heading = "Final evaluation" + (f" on {n} held-out prompts" if n is not None else "")
    heading += f", gold judge {judge}" if judge else ""
    sections = [("Run", run), (heading, final)]
    last = next((r for r in reversed(ppo_rows) if num(r.get("gold/score")) is not None), None)
    if last is not None:
        how = f": {ppo_eval}" if ppo_eval else ""
        label = f"gold, last PPO evaluation (iteration {last.get('step')}{how})"
        sections.append(("During PPO", [(label, _f(last["gold/score"]), "num")]))
    other: list[Row] = []
    for key, value in s.items():
        if key in shown:
            continue
        if isinstance(value, (list, dict)) and len(value) > 8:
            # (a ppo run's `evals`: every evaluation's metrics, which the plots show)
            other.append((LABELS.get(key, key), f"{len(value)} entries (in summary.json)", ""))
            continue
        if key == "rm_accuracy":
            other.append(
                (LABELS[key], _f(value) if value is not None else "— (no learned reward model)", "num")
            )
            continue
        shown_value, kind = _text(value)
        other.append((LABELS.get(key, key), shown_value, kind))
    sections.append(("Other figures" if final or run else "", other))
    return [(h, rows) for h, rows in sections if rows]


def time_rows(s: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(stage, wall-clock, CPU) rows of the report's time table, then the total; [] without ``seconds``."""
    wall, cpu = s.get("seconds"), s.get("cpu_seconds")
    wall = wall if isinstance(wall, dict) else {}
    cpu = cpu if isinstance(cpu, dict) else {}
    stages = list(wall) + [k for k in cpu if k not in wall]
    if not stages:
        return []

    def secs(v: Any) -> str:
        x = num(v)
        return f"{x:.1f} s" if x is not None and math.isfinite(x) else "—"

    def total(values: dict[str, Any]) -> float:
        return sum(x for x in map(num, values.values()) if x is not None and math.isfinite(x))

    rows = [(stage, secs(wall.get(stage)), secs(cpu.get(stage))) for stage in stages]
    rows.append(("total", secs(total(wall)), secs(total(cpu)) if cpu else "—"))
    return rows


def result_lines(summary: dict[str, Any], task: str, preset: str, seed: int, out: Path) -> list[str]:
    """A quickstart's result on the console: the gold judge on the held-out prompts, sampled (with the paired
    standard error and the KL it cost) and, for arith, greedy; each figure says how it was measured, so that
    it is not mistaken for PPO's own evaluations (fewer prompts, ``ppo.eval.temperature``)."""
    s, T = summary, summary["eval_temperature"]
    unit = "exact-match accuracy" if task.startswith("arith") else "VADER compound"
    lines = [
        f"{task}/{preset} seed {seed}: gold judge ({unit}) on {s['eval_prompts']} held-out prompts, SFT policy "
        "(before) -> final policy (after):",
        f"  sampled at T={T:g}: before {s['gold_before']:.3f} -> after {s['gold_after']:.3f} (gain "
        f"{s['gold_gain']:+.3f} +- {s['gold_gain_se']:.3f}, paired standard error) at KL {s['kl']:.2f} "
        "nats/response (k3)",
    ]
    if any(
        k in s for k in TOOL_USE_KEYS
    ):  # an environment (ppo.env): the share of episodes that called a tool
        before, after = num(s.get("tool_use_before")), num(s.get("tool_use_after"))
        said = f"before {before:.3f} -> after {after:.3f}" if before is not None and after is not None else ""
        lines.append(f"  tool use: {said or NOT_REPORTED}")
    if "gold_greedy_after" in s:
        greedy = f"before {s['gold_greedy_before']:.3f} -> after {s['gold_greedy_after']:.3f}"
        lines.append(f"  greedy:{' ' * (len(f'sampled at T={T:g}') - 5)}{greedy}")
    lines.append(
        f"{s['seconds_total']:.0f} s; outputs in {out} (summary.json, report.html; policy in {s['policy']})"
    )
    return lines

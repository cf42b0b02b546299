"""What a run directory holds, read for the reports: :func:`load_run` gives a :class:`RunData`.

Reads (every piece optional; whatever is missing or unreadable becomes a note the page shows):

- ``summary.json``: ``gold_before``, ``gold_after``, ``kl`` (nats per response), ``rm_accuracy``,
  ``seconds`` (stage -> seconds), ``task``, ``preset``, ``seed`` and any other scalars;
- ``sft/metrics.jsonl``, ``rm/metrics.jsonl``, ``ppo/metrics.jsonl`` (one row per step, keys from
  :data:`shifu.runs.metrics.METRICS`; non-finite values are the strings ``"nan"``/``"inf"``). A single trainer's
  run directory with ``metrics.jsonl`` at its top works too: its rows go to the stage their keys name;
- ``ppo/summary.json`` (a single ``shifu ppo`` run: ``summary.json``): what made its rollouts, as the run recorded
  its rollout source (:func:`ran_source`), for what its reward is (:func:`reward_source`);
- ``ppo/config.yaml`` (a single ``shifu ppo`` run: ``config.yaml``): the PPO run's settings, for its method and
  how its held-out evaluations sampled (and what made its rollouts, for a run that did not record it);
- ``samples_before.jsonl`` / ``samples_after.jsonl``: ``{"prompt", "response", "gold"}`` rows for the same
  held-out prompts in the same order; for a ``shifu ppo`` run, its ``samples.jsonl`` (``{"iteration", "prompt",
  "response", "score", "gold"?}`` per evaluation): its first and its last evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from shifu.errors import ShifuError
from shifu.reporting.names import model_name, shown_path

STAGES = ("sft", "rm", "dpo", "ppo")
QUICKSTART_STAGES = ("sft", "rm", "ppo")  # the stages a quickstart run is expected to have
# which stage a top-level metrics.jsonl row belongs to, from the namespace of its keys
_STAGE_PREFIXES = {
    "ppo": ("objective/", "policy/", "value/", "rollout/", "gold/", "eval/score", "eval/kl"),
    "rm": ("rm/", "eval/rm/"),
    "dpo": ("dpo/", "eval/dpo/"),
    "sft": ("sft/", "eval/sft/"),
}

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
    name the two sides of the sample table (``before``, ``after``). ``ppo_config``: the PPO run's recorded
    config (None without one); ``ppo_eval``: how its held-out evaluations sampled, e.g. "128 prompts sampled
    at T=0.7" ("" when unknown); ``ppo_source``: what made its rollouts (:func:`ran_source`; None when
    unknown)."""

    run_dir: Path
    summary: dict[str, Any] | None
    stages: dict[str, list[dict[str, Any]]]
    before: list[dict[str, Any]] | None
    after: list[dict[str, Any]] | None
    notes: list[str]
    kind: str = "quickstart"
    sample_labels: tuple[str, str] = ("before PPO (SFT policy)", "after PPO (final policy)")
    ppo_config: dict[str, Any] | None = None
    ppo_eval: str = ""
    ppo_source: Any = None

    @property
    def expected_stages(self) -> tuple[str, ...]:
        """The stages this run should have: a missing one is named in the page, the others are not."""
        if self.kind == "quickstart":
            return tuple(s for s in STAGES if s in QUICKSTART_STAGES or s in self.stages)
        return (self.kind,) if self.kind in STAGES else tuple(self.stages)


def num(v: Any) -> float | None:
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


def read_jsonl_rows(path: Path, notes: list[str], run_dir: Path) -> list[dict[str, Any]] | None:
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


def stage_of(row: dict[str, Any]) -> str | None:
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
        rows = read_jsonl_rows(run / stage / "metrics.jsonl", notes, run)
        if rows is not None:
            stages[stage] = rows
    top = read_jsonl_rows(run / "metrics.jsonl", notes, run) or []
    for row in top:  # a single trainer's run: its rows go to the stage their keys name
        stage = stage_of(row)
        if stage is not None and not (run / stage / "metrics.jsonl").is_file():
            stages.setdefault(stage, []).append(row)
    before = read_jsonl_rows(run / "samples_before.jsonl", notes, run)
    after = read_jsonl_rows(run / "samples_after.jsonl", notes, run)
    labels = RunData.sample_labels
    if (
        before is None and after is None
    ):  # a `shifu ppo` run without a final evaluation: its evaluations' samples
        before, after, labels = _ppo_samples(read_jsonl_rows(run / "samples.jsonl", notes, run), notes)
    if summary is None and not any(stages.values()) and not before and not after:
        raise ShifuError(
            f"{run}: nothing to report: none of {', '.join(_INPUTS)} (or a top-level metrics.jsonl) "
            "exists with content (pass the --out directory of `shifu quickstart` or a trainer)"
        )
    # a quickstart: stage directories, or its final evaluation without them (a ppo run's own final evaluation
    # has its metrics.jsonl at the top)
    if any((run / stage / "metrics.jsonl").is_file() for stage in STAGES) or (
        "gold_before" in (summary or {}) and not top
    ):
        kind = "quickstart"
    else:  # a trainer's run: the stage its metric keys name
        kind = next((s for s in STAGES if s in stages), "ppo" if after else "run")
    ppo_dir = run if kind == "ppo" else run / "ppo"
    config = read_config(ppo_dir / "config.yaml", notes) if kind in ("quickstart", "ppo") else None
    how = ppo_eval_settings(config, read_jsonl_rows(ppo_dir / "samples.jsonl", [], run) if config else None)
    source = None
    if kind in ("quickstart", "ppo"):
        source = ran_source(summary if ppo_dir == run else read_json(ppo_dir / "summary.json", []), config)
    return RunData(run, summary, stages, before, after, notes, kind, labels, config, how, source)


def read_config(path: Path, notes: list[str]) -> dict[str, Any] | None:
    """A run's recorded ``config.yaml``, or None (missing; or unreadable, with a note)."""
    import yaml

    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        notes.append(f"{path.name} is not valid YAML ({e}); the reward is not named")
        return None
    return config if isinstance(config, dict) else None


def ppo_eval_settings(config: dict[str, Any] | None, samples: list[dict[str, Any]] | None) -> str:
    """How a PPO run's held-out evaluations (``eval/*``, ``gold/score``) sampled: "N prompts sampled at T=t",
    N counted in its ``samples.jsonl`` (the last evaluation; else ``eval.num_prompts``, an upper bound)."""
    ev = (config or {}).get("eval")
    if not isinstance(ev, dict) or num(ev.get("temperature")) is None:
        return ""
    n: Any = f"up to {ev.get('num_prompts')}"
    if samples:
        last = max((r.get("iteration") for r in samples if isinstance(r.get("iteration"), int)), default=None)
        n = sum(r.get("iteration") == last for r in samples) if last is not None else n
    return f"{n} prompts sampled at T={num(ev['temperature']):g}"


def ran_source(summary: dict[str, Any] | None, config: dict[str, Any] | None):
    """What made a PPO run's rollouts (a :class:`shifu.rollout.sources.SourceDescription`): the description
    its ``summary.json`` records (``source``); for a run that recorded none (written before runs recorded it,
    or not finished), what its recorded ``config.yaml`` names (:func:`shifu.rollout.build.describe_settings`);
    None with neither."""
    from shifu.config.loader import lookup
    from shifu.rollout.sources import SourceDescription

    recorded = SourceDescription.from_record((summary or {}).get("source"))
    if recorded is not None or not config:
        return recorded
    from shifu.rollout.build import describe_settings

    return describe_settings(lambda key: lookup(config, key))


def reward_source(source, run_dir: Path | None = None) -> tuple[str, str]:
    """(plot title, description) of what a PPO run's reward is, as its rollout source (:func:`ran_source`)
    names it: a reward function, a reward model or an ensemble of them (the model's own name,
    :func:`shifu.reporting.names.model_name`), a reward service (its URL), an environment or an agent (the
    episode's return). With ``run_dir``, a model inside the run is named relative to it."""
    if source is None or not source.spec:
        return "Reward score", "the run's reward (the run does not record which)"
    spec, short = source.spec, source.spec.rsplit(":", 1)[-1]
    if source.episodes:  # an environment's or an agent's own return
        what = "environment" if source.kind == "environment" else "agent"
        return f"Episode return: {what} {short}", f"the {what} {spec} (its episode return)"
    if source.scored_by == "reward service":
        return "Reward-service score", f"the reward service at {spec}"
    if source.scored_by == "reward function":
        return f"Reward: function {short}", f"the reward function {spec}"
    if source.reward_model:
        name = model_name(Path(os.path.expanduser(spec))) if run_dir is None else shown_path(spec, run_dir)
        if source.scored_by == "reward-model ensemble":
            return "Reward-model ensemble score", f"the reward-model ensemble {name}"
        return "Reward-model score", f"the reward model {name}"
    return f"Score: {source.scored_by}", f"the {source.name}"


def _ppo_samples(
    rows: list[dict[str, Any]] | None, notes: list[str]
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None, tuple[str, str]]:
    """(first evaluation's rows, last evaluation's rows, their labels) of a ``shifu ppo`` run's
    ``samples.jsonl``; one evaluation only is shown as the "after" side, and said so."""
    if not rows:
        return None, None, RunData.sample_labels
    by_iteration: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        it = num(row.get("iteration"))
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

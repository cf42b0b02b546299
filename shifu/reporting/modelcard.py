"""Model cards: ``final/README.md`` in the Hugging Face model-card format, generated from a run's own files.

:func:`write_model_card` (``final_dir``, ``run_dir``, ``kind``) writes YAML metadata (``base_model``,
``library_name``, ``pipeline_tag``, ``tags``) between ``---`` lines, then the training recipe, the data, the
key config and the measured results, and the full config. It reads, each optional (a missing or unreadable
file leaves its part out and the card says so):

- ``RUN/config.yaml``: the resolved config (base model, data files, hyper-parameters);
- ``RUN/summary.json`` and ``RUN/metrics.jsonl``: the stage's final and first held-out metrics;
- ``RUN/samples.jsonl`` (PPO): per-prompt gold scores at each evaluation; the first and the last evaluation
  give gold before/after with standard errors (the same prompts, so the gain's error is the paired one);
- a ``shifu quickstart`` run (``RUN/..`` holds ``summary.json`` with ``gold_before``): its gold before/after,
  KL and reward-model accuracy, standard errors from ``samples_before.jsonl`` / ``samples_after.jsonl``;
- the reward model's own ``summary.json`` (next to ``reward.model_path``) for its held-out accuracy.

``python -m shifu.reporting.modelcard RUN_DIR [--kind sft|rm|ppo|dpo]`` writes the card of a trainer's run directory,
or of every stage of a quickstart run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from shifu.config.loader import lookup
from shifu.core.stats import mean_se
from shifu.errors import ShifuError
from shifu.reporting.run_data import read_json

KINDS = ("sft", "rm", "ppo", "dpo")
TITLES = {
    "sft": "supervised fine-tuned policy",
    "rm": "Bradley-Terry reward model",
    "ppo": "policy aligned with PPO",
    "dpo": "policy aligned with DPO",
}
TAGS = {"sft": ["sft"], "rm": ["reward-model"], "ppo": ["ppo"], "dpo": ["dpo"]}
# where each stage's config names the model it started from (first match wins)
BASE_MODEL_KEYS = {
    "sft": ("model.path",),
    "rm": ("model.path",),
    "ppo": ("model.path",),
    "dpo": ("model.path",),
}
# the config keys a reader asks about first, per stage (absent or empty ones are skipped)
KEY_CONFIG = {
    "sft": ("model.path", "data.max_len", "epochs", "max_steps", "batch_size", "grad_accum"),
    "rm": ("model.path", "ensemble.k", "ensemble.aggregate", "center_coef", "epochs", "max_steps"),
    "ppo": (
        "model.path",
        "model.ref_path",
        "algo",
        "reward.model_path",
        "reward.function",
        "iterations",
        "batch_size",
        "minibatch_size",
        "ppo_epochs",
        "clip_low",
        "clip_high",
        "vf_coef",
        "gamma",
        "lam",
        "kl.controller",
        "kl.init_coef",
        "kl.target",
        "kl.estimator",
        "critic.init",
        "generation.max_new_tokens",
        "generation.temperature",
        "eval.gold_function",
    ),
    "dpo": ("model.path", "model.ref_path", "beta", "epochs", "max_steps", "batch_size"),
}
COMMON_CONFIG = ("optim.lr", "optim.schedule", "optim.warmup_steps", "seed", "bf16", "distributed.strategy")
DATA_KEYS = ("data.train", "data.eval", "data.ptx")
RECIPE = {
    "sft": "Supervised fine-tuning (`shifu sft`): next-token loss on the trained response tokens of (prompt, "
    "response) or chat demonstrations; prompt, read-only spans (tool outputs, non-assistant turns) and padding "
    "positions are masked out.",
    "rm": "Reward modelling (`shifu rm`): a scalar head on the backbone trained with the Bradley-Terry loss "
    "-log sigmoid(r(chosen) - r(rejected)) on preference pairs; scores normalised after training.",
    "ppo": "RLHF with PPO (`shifu ppo`): the policy samples responses to prompts, a reward model (or reward "
    "function) scores them, the score minus beta x KL to the frozen reference policy is the reward, and "
    "the clipped PPO objective with GAE on a learned critic updates the policy; a KL controller sets beta.",
    "dpo": "Direct preference optimisation (`shifu dpo`): the policy is trained on preference pairs to "
    "raise the log-probability ratio of chosen over rejected responses relative to a frozen reference.",
}


# ------------------------------------------------------------------------------------------ reading


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


def quickstart_summary(run_dir: Path, notes: list[str]) -> tuple[dict[str, Any], Path] | None:
    """The end-to-end summary of a quickstart run this stage belongs to (``summary.json`` with
    ``gold_before`` here or one level up), and the directory it is in."""
    for d in (run_dir, run_dir.parent):
        s = read_json(d / "summary.json", notes)
        if s is not None and "gold_before" in s:
            return s, d
    return None


def _reward_model_accuracy(config: dict[str, Any], notes: list[str]) -> float | None:
    """Held-out accuracy of the reward model PPO used, from the summary of its ``shifu rm`` run."""
    path = lookup(config, "reward.model_path")
    if not isinstance(path, str) or not path:
        return None
    for d in (Path(path), Path(path).parent):
        s = read_json(d / "summary.json", notes)
        if s is not None and _num(s.get("eval/rm/accuracy")) is not None:
            return _num(s["eval/rm/accuracy"])
    return None


def collect_results(kind: str, run_dir: Path, config: dict[str, Any], notes: list[str]) -> list[tuple]:
    """(label, value text) rows of the measured results of one stage."""
    summary = read_json(run_dir / "summary.json", notes) or {}
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
        rows += _ppo_results(run_dir, summary, metrics, config, notes)
    quick = quickstart_summary(run_dir, notes) if kind in ("ppo", "dpo") else None
    if quick is not None:
        rows += _quickstart_rows(*quick)
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


def _ppo_results(run_dir: Path, summary: dict, metrics: list[dict], config: dict, notes: list[str]) -> list:
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
            label = f"gold, held-out prompts, iteration {its[0]} -> {its[-1]} (n = {gold['n']})"
            rows += _gold_rows(gold, label)
    evals = [e for e in summary.get("evals", []) if isinstance(e, dict)]
    if evals:
        s0, s1 = _num(evals[0].get("eval/score")), _num(evals[-1].get("eval/score"))
        if s0 is not None and s1 is not None:
            rows.append(("reward-model score, held-out, first -> last evaluation", f"{s0:.4f} -> {s1:.4f}"))
        _add(rows, "KL to the reference at the last evaluation (nats/response)", evals[-1].get("eval/kl"))
    _add(rows, "KL of the last rollout (nats/response)", _first_last(metrics, "objective/kl")[1])
    _add(rows, "final beta (KL coefficient)", summary.get("kl_coef"))
    _add(rows, "iterations", summary.get("iterations"), 0)
    if summary.get("guard"):
        rows.append(("stopped by the guard", str(summary["guard"])))
    _add(rows, "reward-model accuracy, held-out pairs", _reward_model_accuracy(config, notes))
    return rows


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


def _quickstart_rows(s: dict[str, Any], d: Path) -> list[tuple[str, str]]:
    """Gold before/after of the end-to-end evaluation (with standard errors from the sample files)."""
    gold = gold_comparison(_read_jsonl(d / "samples_before.jsonl"), _read_jsonl(d / "samples_after.jsonl"))
    n = s.get("eval_prompts") or (gold["n"] if gold else None)
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


def _count_rows(path: str) -> str:
    p = Path(path)
    if p.is_file() and p.suffix == ".jsonl":
        with p.open(encoding="utf-8", errors="replace") as f:
            return f" ({sum(1 for line in f if line.strip())} rows)"
    return "" if p.exists() else " (not found when the card was written)"


# ---------------------------------------------------------------------------------------- rendering


def metadata(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """The card's YAML metadata: base model, library, pipeline tag and tags."""
    meta: dict[str, Any] = {}
    base = next((lookup(config, k) for k in BASE_MODEL_KEYS[kind] if lookup(config, k)), None)
    if isinstance(base, str) and base:
        meta["base_model"] = base
    meta["library_name"] = "shifu" if kind == "rm" else "transformers"
    if kind != "rm":
        meta["pipeline_tag"] = "text-generation"
    tags = ["shifu", "rlhf", *TAGS[kind]]
    algo = lookup(config, "algo")
    if kind == "ppo" and isinstance(algo, str) and algo != "ppo":
        tags.append(algo.replace("_", "-"))
    k = lookup(config, "ensemble.k")
    if kind == "rm" and isinstance(k, int) and k > 1:
        tags.append("reward-ensemble")
    meta["tags"] = tags
    return meta


def _table(rows: list[tuple[str, str]], head: tuple[str, str]) -> str:
    def cell(x: str) -> str:
        return str(x).replace("|", r"\|").replace("\n", " ")

    lines = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    lines += [f"| {cell(a)} | {cell(b)} |" for a, b in rows]
    return "\n".join(lines)


def _value(v: Any) -> str:
    return "`" + (v if isinstance(v, str) else json.dumps(v)) + "`"


def _run_name(run_dir: Path) -> str:
    """The run's name: its directory, with the parent for a quickstart stage (``quickstart-arith/ppo``)."""
    run = run_dir.resolve()
    return f"{run.parent.name}/{run.name}" if run.name in KINDS else run.name


def render_card(kind: str, final_dir: Path, run_dir: Path) -> str:
    """The model card's text (see the module docstring for what it reads)."""
    if kind not in KINDS:
        raise ShifuError(f"unknown model kind '{kind}'; choose one of {', '.join(KINDS)}")
    notes: list[str] = []
    config = read_config(run_dir, notes)
    meta = metadata(kind, config)
    results = collect_results(kind, run_dir, config, notes)
    parts = [
        "---",
        yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(),
        "---",
        "",
        f"# {_run_name(run_dir)}: {TITLES[kind]}",
        "",
        f"Trained with shifu (`shifu-rlhf`, `shifu {kind}`); this card was generated "
        "from the run's own files (config.yaml, summary.json, metrics.jsonl"
        + (", samples.jsonl" if kind == "ppo" else "")
        + ").",
        "",
        "## Training recipe",
        "",
        RECIPE[kind],
        "",
    ]
    base = meta.get("base_model")
    parts += [f"Started from: `{base}`." if base else "Started from: not recorded.", ""]
    if (merged := final_dir / "merge.json").is_file():  # written by shifu merge (a quickstart soup plan)
        m = json.loads(merged.read_text(encoding="utf-8"))
        parts += [
            f"Merged (`shifu merge`): `{m['base']}` + {m['scale']} x the mean change of "
            f"{len(m['policies'])} runs ({', '.join(f'`{p}`' for p in m['policies'])}); the recipe, config and "
            "training rows below are the first run's; the quickstart's held-out rows (when present) are "
            "the merged policy's.",
            "",
        ]
    data = [
        (k, f"`{lookup(config, k)}`{_count_rows(lookup(config, k))}") for k in DATA_KEYS if lookup(config, k)
    ]
    parts += ["## Data", ""]
    parts += [_table(data, ("config key", "file")) if data else "Not recorded (no config.yaml).", ""]
    keys = [
        (k, _value(lookup(config, k)))
        for k in (*KEY_CONFIG[kind], *COMMON_CONFIG)
        if lookup(config, k) not in (None, "", [], {})
    ]
    parts += ["## Key config", ""]
    parts += [_table(keys, ("key", "value")) if keys else "Not recorded (no config.yaml).", ""]
    parts += ["## Results", ""]
    if results:
        parts += [
            "Means over held-out prompts or pairs; ± is one standard error. KL is against the frozen "
            "reference policy, in nats per response.",
            "",
            _table(results, ("measure", "value")),
            "",
        ]
    else:
        parts += ["No results were recorded.", ""]
    parts += ["## How to use", "", "```python"]
    if kind == "rm":
        parts += [
            "from shifu.rewards.sources import load_reward_model",
            "",
            f'rm = load_reward_model("{final_dir}")',
            'scores = rm.score_texts(["a prompt"], ["a response"])',
        ]
    else:
        parts += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{final_dir}", local_files_only=True)',
            f'tokenizer = AutoTokenizer.from_pretrained("{final_dir}", local_files_only=True)',
        ]
    parts += ["```", ""]
    if kind != "rm":
        parts += [f'Or from the command line: `shifu sample {final_dir} --prompt "..."`.', ""]
    if notes:
        parts += ["## Not recorded", ""] + [f"- {n}" for n in notes] + [""]
    if config:
        full = yaml.safe_dump(config, sort_keys=False, allow_unicode=True).rstrip()
        parts += ["<details><summary>Full config</summary>", "", "```yaml", full, "```", "", "</details>", ""]
    return "\n".join(parts)


def write_model_card(final_dir: str | Path, run_dir: str | Path, kind: str) -> Path:
    """Write ``final_dir/README.md`` for a ``kind`` (sft, rm, ppo, dpo) model trained in ``run_dir``;
    returns its path. Missing run files leave their part out (listed under "Not recorded")."""
    final, run = Path(final_dir), Path(run_dir)
    if not final.is_dir():
        raise ShifuError(f"{final} is not a directory: write the card after the model was saved there")
    text = render_card(kind, final, run)
    out = final / "README.md"
    if out.exists() and out.read_text(encoding="utf-8") == text:
        return out  # unchanged: leave the file (and the directory's mtime) alone
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


def read_card_metadata(path: str | Path) -> dict[str, Any]:
    """The YAML metadata of a model card (the block between the first two ``---`` lines)."""
    text = Path(path).read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        raise ShifuError(f"{path}: a model card starts with a '---' line of YAML metadata")
    head = text[4:].split("\n---\n", 1)[0]
    value = yaml.safe_load(head)
    return value if isinstance(value, dict) else {}


def infer_kind(run_dir: Path) -> str | None:
    """The stage of a trainer's run directory, from its config keys (or a reward model's marker file)."""
    config = read_config(run_dir, [])
    for kind, key in (("ppo", "iterations"), ("dpo", "beta"), ("rm", "ensemble")):  # each stage's own key
        if lookup(config, key) is not None:
            return kind
    if any((run_dir / "final" / m).exists() for m in ("shifu_scalar.json", "ensemble.json")):
        return "rm"
    return "sft" if lookup(config, "model.path") is not None else None


def main(argv: list[str] | None = None) -> int:
    """``python -m shifu.reporting.modelcard RUN_DIR [--kind K]``: write final/README.md of a run (or of every stage
    of a quickstart run)."""
    p = argparse.ArgumentParser(prog="python -m shifu.reporting.modelcard", description=main.__doc__)
    p.add_argument("run_dir", help="a trainer's run directory (with final/) or a quickstart run")
    p.add_argument("--kind", choices=KINDS, help="the stage (default: read from config.yaml)")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    if (run / "final").is_dir():
        targets = [(run, args.kind or infer_kind(run))]
    else:
        targets = [(run / k, args.kind or k) for k in KINDS if (run / k / "final").is_dir()]
    if not targets:
        raise ShifuError(
            f"{run} has no final/ (nor sft/final, rm/final, ppo/final, dpo/final): nothing to describe"
        )
    for stage_dir, kind in targets:
        if kind is None:
            raise ShifuError(f"cannot tell which stage wrote {stage_dir}; pass --kind {'|'.join(KINDS)}")
        print(f"wrote {write_model_card(stage_dir / 'final', stage_dir, kind)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

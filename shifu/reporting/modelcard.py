"""Model cards: ``final/README.md`` in the Hugging Face model-card format, generated from a run's own files.

:func:`write_model_card` (``final_dir``, ``run_dir``, ``kind``) writes YAML metadata (``base_model``,
``library_name``, ``pipeline_tag``, ``tags``) between ``---`` lines, then the training recipe, the data, the
key config and the measured results, and the full config (``RUN/config.yaml``). What the run did is worded by
:mod:`shifu.reporting.card_recipe`, what it measured is read by :mod:`shifu.reporting.card_results`; a
missing or unreadable file leaves its part out and the card says so.

``python -m shifu.reporting.modelcard RUN_DIR [--kind sft|rm|ppo|dpo]`` writes the card of a trainer's run directory,
or of every stage of a quickstart run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from shifu.config.loader import lookup
from shifu.errors import ShifuError
from shifu.reporting.card_results import collect_results, read_config
from shifu.reporting.names import run_name, shown_config, shown_path
from shifu.reporting.recipe import (
    DATA_KEYS,
    KINDS,
    count_rows,
    key_values,
    metadata,
    recipe,
    title,
    without_unused,
)
from shifu.reporting.run_data import ran_source, read_json

__all__ = ["infer_kind", "main", "read_card_metadata", "render_card", "write_model_card"]


def _table(rows: list[tuple[str, str]], head: tuple[str, str]) -> str:
    def cell(x: str) -> str:
        return str(x).replace("|", r"\|").replace("\n", " ")

    lines = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    lines += [f"| {cell(a)} | {cell(b)} |" for a, b in rows]
    return "\n".join(lines)


def _value(v: Any) -> str:
    return "`" + (v if isinstance(v, str) else json.dumps(v)) + "`"


def _merged(final_dir: Path, run_dir: Path) -> list[str]:
    """The lines on a merged policy (``merge.json``, written by ``shifu merge``: a quickstart soup plan)."""
    if not (final_dir / "merge.json").is_file():
        return []
    m = json.loads((final_dir / "merge.json").read_text(encoding="utf-8"))
    runs = ", ".join(f"`{shown_path(p, run_dir)}`" for p in m["policies"])
    return [
        f"Merged (`shifu merge`): `{shown_path(m['base'], run_dir)}` + {m['scale']} x the mean change of "
        f"{len(m['policies'])} runs ({runs}); the recipe, config and training rows below are the first run's; "
        "the quickstart's held-out rows (when present) are the merged policy's.",
        "",
    ]


def _how_to_use(kind: str, model: str) -> list[str]:
    """Loading the model, ``model`` named from the directory that holds the run."""
    if kind == "rm":
        code = [
            "from shifu.rewards.sources import load_reward_model",
            "",
            f'rm = load_reward_model("{model}")',
            'scores = rm.score_texts(["a prompt"], ["a response"])',
        ]
    else:
        code = [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{model}", local_files_only=True)',
            f'tokenizer = AutoTokenizer.from_pretrained("{model}", local_files_only=True)',
        ]
    parts = ["## How to use", "", "```python", *code, "```", ""]
    if kind != "rm":
        parts += [f'Or from the command line: `shifu sample {model} --prompt "..."`.', ""]
    return parts


def _config_sections(kind: str, config: dict[str, Any], run_dir: Path, source: Any) -> list[str]:
    """The Data and Key config tables."""
    data = [
        (k, f"`{shown_path(lookup(config, k), run_dir)}`{count_rows(lookup(config, k))}")
        for k in DATA_KEYS
        if lookup(config, k)
    ]
    parts = ["## Data", ""]
    parts += [_table(data, ("config key", "file")) if data else "Not recorded (no config.yaml).", ""]
    keys = [(k, _value(v)) for k, v in key_values(kind, config, run_dir, source)]
    parts += ["## Key config", ""]
    parts += [_table(keys, ("key", "value")) if keys else "Not recorded (no config.yaml).", ""]
    return parts


def _full_config(kind: str, config: dict[str, Any], run_dir: Path, source: Any) -> list[str]:
    if not config:
        return []
    shown = shown_config(without_unused(config, source) if kind == "ppo" else config, run_dir)
    note = (
        [
            "Settings without effect in this run are left out; the run directory's config.yaml has them all.",
            "",
        ]
        if kind == "ppo"
        else []
    )
    full = yaml.safe_dump(shown, sort_keys=False, allow_unicode=True).rstrip()
    return [
        "<details><summary>Full config</summary>",
        "",
        *note,
        "```yaml",
        full,
        "```",
        "",
        "</details>",
        "",
    ]


def render_card(kind: str, final_dir: Path, run_dir: Path) -> str:
    """The model card's text (see the module docstring for what it reads). Paths are never absolute: inside
    the run relative to it, elsewhere a model's own name or a file's name (:mod:`shifu.reporting.names`)."""
    if kind not in KINDS:
        raise ShifuError(f"unknown model kind '{kind}'; choose one of {', '.join(KINDS)}")
    notes: list[str] = []
    config = read_config(run_dir, notes)
    source = ran_source(read_json(run_dir / "summary.json", []), config) if kind == "ppo" else None
    meta = metadata(kind, config, run_dir, source)
    results = collect_results(kind, run_dir, config, notes, source)
    base = meta.get("base_model")
    parts = [
        "---",
        yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(),
        "---",
        "",
        f"# {run_name(run_dir)}: {title(kind, config)}",
        "",
        f"Trained with shifu (`shifu-rlhf`, `shifu {kind}`); this card was generated "
        "from the run's own files (config.yaml, summary.json, metrics.jsonl"
        + (", samples.jsonl" if kind == "ppo" else "")
        + ").",
        "",
        "## Training recipe",
        "",
        recipe(kind, config, run_dir, source),
        "",
        f"Started from: `{base}`." if base else "Started from: not recorded.",
        "",
        *_merged(final_dir, run_dir),
        *_config_sections(kind, config, run_dir, source),
        "## Results",
        "",
    ]
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
    # the model, named from the directory that holds the run (as `shifu sample` takes it from there)
    model = f"{Path(run_name(run_dir)).parts[0]}/{shown_path(str(final_dir.resolve()), run_dir)}"
    parts += _how_to_use(kind, model)
    if notes:
        parts += ["## Not recorded", ""] + [f"- {n}" for n in notes] + [""]
    parts += _full_config(kind, config, run_dir, source)
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

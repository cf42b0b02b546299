"""How a run's records name files and models: never by an absolute path, which says where a file lay on the
machine that trained (a cache, a home directory) and nothing a reader can use.

- A path inside the run (:func:`run_root`: the run directory, or the pipeline run a stage belongs to) is
  written relative to it: ``sft/final``, ``data/prompts.jsonl``.
- A model directory elsewhere is named by the model's own name (:func:`model_name`): the hub id its
  ``config.json`` was saved from when there is one, a shifu run's ``<run>/final``, else the directory's
  name (the converted SmolLM2 cache: ``smollm2-135m-instruct``).
- Any other file is named by its file name (``prompts.jsonl``).

Relative paths (as the user typed them) and other values (``package.module:function``, URLs, ``minilm``) are
kept as they are.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

# a pipeline's stage directories (a soup's members: ppo-2, ...): their run is the directory above
STAGE_DIR = re.compile(r"(sft|rm|ppo|dpo|soup)(-\d+)?")


def run_root(run_dir: str | Path) -> Path:
    """The directory a run's paths are written relative to: the run directory, or for a pipeline's stage
    (``quickstart-arith/ppo``) the pipeline's run (``quickstart-arith``)."""
    run = Path(run_dir).resolve()
    return run.parent if STAGE_DIR.fullmatch(run.name) else run


def run_name(run_dir: str | Path) -> str:
    """The run's name: its directory, with the pipeline's for a stage (``quickstart-arith/ppo``)."""
    run = Path(run_dir).resolve()
    return f"{run.parent.name}/{run.name}" if STAGE_DIR.fullmatch(run.name) else run.name


def is_absolute(value: Any) -> bool:
    """Whether ``value`` is a string naming an absolute path (``/...``, ``~/...``, ``C:\\...``)."""
    return isinstance(value, str) and bool(value) and (os.path.isabs(value) or value.startswith("~"))


def model_name(path: str | Path) -> str:
    """A model directory's own name: the hub id in its ``config.json`` (``_name_or_path`` when that is an id,
    not a path), ``<run>/final`` (or ``best``) for a shifu run's model, else the directory's name."""
    p = Path(os.path.expanduser(str(path)))
    try:
        saved = json.loads((p / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        saved = None
    if (
        isinstance(saved, str)
        and saved.count("/") == 1
        and not is_absolute(saved)
        and not saved.startswith(".")
    ):
        return saved
    if p.name in ("final", "best") and (p.parent / "config.yaml").is_file():
        return f"{run_name(p.parent)}/{p.name}"
    return p.name or str(path)


def shown_path(value: Any, run_dir: str | Path) -> Any:
    """``value`` as a record shows it (see the module docstring); anything but an absolute path unchanged."""
    if not is_absolute(value):
        return value
    path = Path(os.path.expanduser(value)).resolve()
    root = run_root(run_dir)
    if path == root:
        return root.name
    if path.is_relative_to(root):
        return path.relative_to(root).as_posix()
    if path.is_dir() or path.suffix == "":
        return model_name(path)
    return path.name


def shown_config(value: Any, run_dir: str | Path) -> Any:
    """A config (nested dicts and lists) with every absolute path in it shown by :func:`shown_path`."""
    if isinstance(value, dict):
        return {k: shown_config(v, run_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [shown_config(v, run_dir) for v in value]
    return shown_path(value, run_dir)

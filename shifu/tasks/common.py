"""What every built-in task shares: its presets (``shifu/presets/tasks/<task>.yaml``) and their lookup, and
the base model and file paths its ``prepare`` writes and returns."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from shifu.config.loader import read_shipped_table, shipped
from shifu.errors import ConfigError

T = TypeVar("T")


def read_presets(task: str, cls: type[T]) -> dict[str, T]:
    """The presets of ``task``: ``shifu/presets/tasks/<task>.yaml``, each checked against ``cls``'s fields,
    in the file's order."""
    return read_shipped_table(shipped("tasks", f"{task}.yaml"), cls)


def preset_of(task: str, presets: dict[str, T], name: str) -> T:
    """The preset ``name`` of ``task``; a ConfigError naming the presets there are otherwise."""
    if name not in presets:
        raise ConfigError(f"task {task} has no preset '{name}'. Choose one of: {', '.join(presets)}")
    return presets[name]


def write_base(out: Path, pretrained: str | None, untrained: Callable[[], tuple[Any, Any]]) -> None:
    """``out/base`` and ``out/tokenizer``: with ``pretrained="smollm2"`` links to the cached SmolLM2 conversion
    (:func:`shifu.tasks.link_pretrained`, no copy of its weights); otherwise ``untrained()`` builds the task's
    (tokenizer, model), the tokenizer saved in ``out/tokenizer``, and both are saved in ``out/base``."""
    if pretrained == "smollm2":
        from shifu.tasks import link_pretrained
        from shifu.tasks.assets import converted_smollm2

        link_pretrained(converted_smollm2(), out)
        return
    tok, model = untrained()
    model.save_pretrained(str(out / "base"))
    tok.save_pretrained(str(out / "base"))


def data_paths(out: Path, names: list[str]) -> dict[str, str]:
    """What ``prepare`` returns: name -> path of each ``<name>.jsonl`` in ``out``, then ``tokenizer`` and
    ``base``."""
    return {n: str(out / f"{n}.jsonl") for n in names} | {
        "tokenizer": str(out / "tokenizer"),
        "base": str(out / "base"),
    }

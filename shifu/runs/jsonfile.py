"""JSON as shifu writes it: strict (RFC 8259), which every parser reads. A number that is not finite (NaN,
+-Infinity: an undefined statistic, such as the accuracy of an empty group) is written as ``null``.
``metrics.jsonl`` keeps its own spelling of such values (``"nan"``, see :mod:`shifu.runs.tracking`).

The JSON Lines files of a run and of a task's data (``samples*.jsonl``, ``prompts_*.jsonl``, pairs,
``metrics.jsonl``) are written, read and trimmed on resume here."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every float that is not finite replaced by None, inside dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite_or_null` of ``obj``, refusing anything else that is not strict JSON."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kwargs)


def write_jsonl(path: str | Path, rows: Iterable[Any], **kwargs: Any) -> None:
    """``path`` written whole as JSON Lines: one :func:`dumps` of each row per line (``kwargs`` to it)."""
    Path(path).write_text("".join(dumps(r, **kwargs) + "\n" for r in rows), encoding="utf-8")


def read_jsonl(path: str | Path) -> list[Any]:
    """The rows of a JSON Lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def keep_rows(path: str | Path, keep: Callable[[Any], bool]) -> None:
    """Rewrite the JSON Lines file ``path`` with only the lines whose row ``keep`` accepts, each line's text as
    it was (what a resumed run does to the rows an interrupted one wrote after its checkpoint)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    path.write_text("".join(x + "\n" for x in lines if x.strip() and keep(json.loads(x))), encoding="utf-8")

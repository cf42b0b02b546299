"""JSON as shifu writes it: strict (RFC 8259), which every parser reads. A number that is not finite (NaN,
+-Infinity: an undefined statistic, such as the accuracy of an empty group) is written as ``null``.
``metrics.jsonl`` keeps its own spelling of such values (``"nan"``, see :mod:`shifu.runs.tracking`)."""

from __future__ import annotations

import json
import math
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

"""The parts every results table is made of: record selection, cells, the Markdown table and its footer.

A table's renderer (``benchmarks/*_tables.py``, beside the script that records it) takes every record of
``benchmarks/results/`` and returns Markdown; ``benchmarks/tables.py`` puts it into the pages.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable


def cpu_label(rec: dict) -> str:
    """The CPU in a few words: model, the widest vector ISA with native bf16 or AMX, cores."""
    cpu = rec.get("cpu")
    if cpu is None:
        return "unknown"
    flags = set(cpu["flags"])
    if {"amx_bf16", "amx_tile"} & flags:
        isa = "AMX"
    elif "avx512_bf16" in flags:
        isa = "AVX-512 + bf16"
    elif "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2"
    else:
        isa = "+".join(sorted(flags)) or "no vector flags"
    return f"{cpu['model']}, {isa}, {cpu['cores']} cores"


def commit_label(rec: dict) -> str:
    return rec["commit"][:7] + ("+" if rec.get("dirty") else "")


def md(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def footer(recs: list[dict], what: str = "") -> str:
    """Where the records are and the command(s) that made them."""
    files = sorted({f"benchmarks/results/{r['benchmark']}.jsonl" for r in recs})
    series = (
        sorted({r["series"] for r in recs if r.get("series")}) if all(r.get("series") for r in recs) else []
    )
    where = ", ".join(f"`{f}`" for f in files) + (f" (series {', '.join(series)})" if series else "")
    commands = list(dict.fromkeys(r["command"] for r in recs))
    if len(commands) <= 2:
        cmd = "; ".join(f"`{c}`" for c in commands)
    else:
        cmd = f"{len(commands)} commands, each in its record's `command`"
    migrated = sum("migrated" in r for r in recs)
    note = f"; {migrated} of them migrated from older files (their `migrated` field)" if migrated else ""
    n = f"{len(recs)} record{'s' if len(recs) != 1 else ''}"
    return f"\n\n{what}{n} in {where}{note}. Command: {cmd}."


def span(xs: list[float], spec: str) -> str:
    lo, hi = format(min(xs), spec), format(max(xs), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def none_yet(benchmark: str, command: str, what: str = "") -> str:
    return f"No {what}record in `benchmarks/results/{benchmark}.jsonl` yet: `{command}` writes them."


def se(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def pm(x: float, e: float | None = None, signed: bool = True, digits: int = 3) -> str:
    s = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return s if e is None or math.isnan(e) else f"{s} ± {e:.{digits}f}"


def fmt(x, spec=".2f", default="-"):
    return default if x is None else format(x, spec)


def select(
    records: list[dict], benchmark: str, series: str | tuple[str, ...] | None = None, **params
) -> list:
    series = (series,) if isinstance(series, str) else series
    return [
        r
        for r in records
        if r["benchmark"] == benchmark
        and (series is None or r.get("series") in series)
        and all(r["params"].get(k) == v for k, v in params.items())
    ]


def metric(rec: dict, *names: str, default=None):
    for n in names:
        if rec["metrics"].get(n) is not None:
            return rec["metrics"][n]
    return default


def gold_cell(rec: dict) -> str:
    """The held-out gold before and after RL (``-`` where a record lacks either)."""
    before, after = metric(rec, "gold_before"), metric(rec, "gold_after")
    return "-" if before is None or after is None else f"{before:.3f} → {after:.3f}"


def sets_label(sets: list[str], drop: tuple[str, ...] = ()) -> str:
    """``--set`` values for a table cell: a key set twice shows its last value, ``drop`` prefixes (settings
    equal to the plan's, named in the table's footer) are left out, and so is ``ppo.``."""
    last = {s.split("=", 1)[0]: s for s in sets}
    keep = [s.removeprefix("ppo.") for s in last.values() if not s.startswith(drop)]
    return " ".join(f"`{s}`" for s in keep) or "defaults"


def by_key(recs: list[dict], key: Callable[[dict], tuple]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        out[key(r)].append(r)
    return out


def time_cell(recs: list[dict]) -> str:
    cpu = [metric(r, "cpu_seconds_total") for r in recs]
    if all(c is not None for c in cpu):
        return f"{min(cpu):.0f}-{max(cpu):.0f} CPU s" if len(cpu) > 1 else f"{cpu[0]:.0f} CPU s"
    wall = [metric(r, "seconds_total") for r in recs]
    if any(w is None for w in wall):
        return "-"
    return f"{min(wall):.0f}-{max(wall):.0f} s wall" if len(wall) > 1 else f"{wall[0]:.0f} s wall"


METHOD = {
    "ppo": "PPO",
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "rloo": "RLOO",
    "reinforce_pp": "REINFORCE++",
    "reinforce_pp_baseline": "REINFORCE++ baseline",
    "gspo": "GSPO",
    "reinforce": "REINFORCE",
    "dpo": "DPO",
    "bon": "best-of-G",
}

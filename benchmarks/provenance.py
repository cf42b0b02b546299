"""One record format for benchmark results, and the one function that writes it.

Every benchmark script takes ``--record`` (and ``--series NAME``); with it, each measurement it prints is
also appended as one JSON line to ``benchmarks/results/<benchmark>.jsonl``:

    {"benchmark": "ppo_iteration", "series": "vs-trl", "date": "2026-12-04T10:00:00+00:00",
     "commit": "<git HEAD, 40 hex>", "dirty": true,            # "dirty" only when the tree has changes
     "command": "python benchmarks/ppo_iteration.py --vs-trl --record",
     "config_digest": "<sha256 of the resolved config/plan>" | null,
     "cpu": {"model": "AMD EPYC", "flags": ["avx2", "fma", "avx512f", ...], "cores": 2},
     "threads": 1, "torch": "2.13.0+cpu", "load_average": [1-, 5-, 15-minute],
     "params": {...what identifies the run: shape, method, seed, settings...},
     "metrics": {...what was measured...}}

Paths in ``command`` and ``params`` are relative to the repository root; a path outside it keeps only its
last component (``.../name``), so no record names a machine's directories. ``cpu`` may be null only with a
``cpu_note`` saying why (records migrated from before this format). ``benchmarks/tables.py`` turns the
records into the tables of ``docs/benchmarks/``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REQUIRED = ("benchmark", "date", "commit", "command", "config_digest", "cpu", "threads", "torch", "metrics")
# the ISA flags that decide GEMM speed on x86 (fp32 AVX2/AVX-512, native bf16, AMX) and on Arm
CPU_FLAGS = {
    "flags": ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"),
    "Features": ("asimd", "sve", "sve2", "bf16", "i8mm", "sme"),
}
MACHINE_DIRS = ("root", "work", "home", "tmp", "Users")  # no record may name a path under these
ENV_IN_COMMAND = ("SHIFU_THREADS", "SHIFU_MALLOC")  # settings that change a measurement, shown before it


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--record`` and ``--series`` on a benchmark script's parser."""
    ap.add_argument(
        "--record",
        action="store_true",
        help="also append each result to benchmarks/results/<benchmark>.jsonl with its provenance",
    )
    ap.add_argument("--series", default=None, help="with --record: the name of the set of runs it belongs to")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """``model`` (the first processor's ``model name``), the :data:`CPU_FLAGS` it has, ``cores`` (logical
    processors the OS reports)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    model, flags = "", None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in CPU_FLAGS and flags is None:
            flags = [f for f in CPU_FLAGS[key] if f in value.split()]
    return {
        "model": model or platform.processor() or platform.machine(),
        "flags": flags or [],
        "cores": os.cpu_count(),
    }


def git_state(root: Path = ROOT) -> tuple[str | None, bool]:
    """(HEAD's full hash, whether the tree differs from it); (None, False) outside a git checkout. Files under
    ``benchmarks/results/`` do not count: a run appends its own records there."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return head.stdout.strip(), bool(status.stdout.strip())


def relative(value: str, root: Path = ROOT) -> str:
    """``value`` with an absolute path made relative to ``root``; one outside it becomes ``.../<name>``."""
    if not value.startswith("/"):
        if "=" in value:  # KEY=/abs/path (a --set value)
            key, _, rest = value.partition("=")
            return f"{key}={relative(rest, root)}" if rest.startswith("/") else value
        return value
    path = Path(value)
    try:
        return str(path.resolve().relative_to(root.resolve())) or "."
    except ValueError:
        return f".../{path.name}"


def command_line(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> str:
    """The command as typed from the repository root: ``python benchmarks/x.py ...`` (or ``shifu ...``),
    every path relative, led by the :data:`ENV_IN_COMMAND` settings that were set."""
    argv = list(sys.argv if argv is None else argv)
    environ = os.environ if environ is None else environ
    first = Path(argv[0]) if argv else Path("python")
    if first.suffix == ".py":
        head = ["python", relative(str(first.resolve()))]
    elif first.name in ("shifu", "__main__.py"):
        head = ["shifu"]
    else:
        head = [first.name]
    env = [f"{k}={environ[k]}" for k in ENV_IN_COMMAND if k in environ]
    return shlex.join([*env, *head, *(relative(a) for a in argv[1:])])


def config_digest(config: Any) -> str | None:
    """sha256 of a resolved config: a dict/list (as canonical JSON), or files (their relative names and
    bytes, in name order); None for None."""
    if config is None:
        return None
    h = hashlib.sha256()
    if isinstance(config, (str, Path)) or (
        isinstance(config, (list, tuple)) and config and all(isinstance(c, Path) for c in config)
    ):
        paths = [Path(config)] if isinstance(config, (str, Path)) else list(config)
        for p in sorted(paths, key=str):
            h.update(relative(str(p.resolve())).encode() + b"\0" + p.read_bytes() + b"\0")
    else:
        h.update(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode())
    return h.hexdigest()


def make_record(
    benchmark: str,
    metrics: dict,
    *,
    params: dict | None = None,
    config: Any = None,
    series: str | None = None,
    threads: int | None = None,
    argv: list[str] | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """A record of this process's run (see the module docstring)."""
    import torch

    commit, dirty = git_state()
    if commit is None:
        raise ValueError(
            f"--record needs a git checkout of shifu (no commit found at {ROOT.name}/): a record "
            "names the commit that produced it"
        )
    rec: dict[str, Any] = {"benchmark": benchmark}
    if series:
        rec["series"] = series
    rec["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    rec["commit"] = commit
    if dirty:
        rec["dirty"] = True
    rec |= {
        "command": command_line(argv),
        "config_digest": config_digest(config),
        "cpu": cpu_info(),
        "threads": torch.get_num_threads() if threads is None else threads,
        "torch": torch.__version__,
        "load_average": [
            round(x, 2) for x in os.getloadavg()
        ],  # other processes on the cores inflate timings
        "params": scrub(params or {}),
        "metrics": scrub(metrics),
    }
    if note:
        rec["note"] = note
    check(rec)
    return rec


def append(rec: dict, path: Path | None = None) -> Path:
    """Append ``rec`` (checked) to ``path`` (default ``benchmarks/results/<benchmark>.jsonl``)."""
    check(rec)
    path = path or RESULTS / f"{rec['benchmark']}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    return path


def record(args: argparse.Namespace, benchmark: str, metrics: dict, **kw: Any) -> dict | None:
    """What a script calls after each measurement: appends a record when ``args.record`` is set."""
    if not getattr(args, "record", False):
        return None
    rec = make_record(benchmark, metrics, series=getattr(args, "series", None), **kw)
    append(rec)
    return rec


MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:root|home/[^/\s\"']+|Users/[^/\s\"']+)/")
OTHER_PATH = re.compile(r"(?<![\w.~])/(?:work|tmp)/[^\s\"',;)]*")


def scrub_text(text: str) -> str:
    """``text`` with paths under the repository made relative, a home directory written ``~/`` and any other
    machine path (under a :data:`MACHINE_DIRS` top directory) cut to ``.../<name>``."""
    text = text.replace(str(ROOT) + "/", "")
    text = MACHINE_PATH.sub("~/", text)
    return OTHER_PATH.sub(lambda m: ".../" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def scrub(value: Any) -> Any:
    """``value`` with every absolute path made :func:`relative` (whole strings) or :func:`scrub_text`-ed
    (paths inside longer strings), through nested dicts and lists."""
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    if isinstance(value, Path):
        return relative(str(value.resolve()))
    if isinstance(value, str):
        return relative(value) if value.startswith("/") and " " not in value else scrub_text(value)
    return value


def check(rec: dict, where: str = "record") -> None:
    """Raise ValueError naming ``where`` and the field when ``rec`` lacks a required key or is malformed."""
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    if not (isinstance(rec["commit"], str) and len(rec["commit"]) == 40):
        raise ValueError(f"{where}: commit must be a 40-hex git hash, got {rec['commit']!r}")
    if rec["cpu"] is None and not rec.get("cpu_note"):
        raise ValueError(f"{where}: cpu is null without a cpu_note")
    if rec["cpu"] is not None and not {"model", "flags", "cores"} <= rec["cpu"].keys():
        raise ValueError(f"{where}: cpu needs model, flags and cores")
    if not isinstance(rec["metrics"], dict):
        raise ValueError(f"{where}: metrics must be an object")
    _dt.datetime.fromisoformat(rec["date"])
    text = json.dumps(rec)
    for prefix in (f"/{d}/" for d in MACHINE_DIRS):
        if prefix in text:
            raise ValueError(f"{where}: holds an absolute machine path ({prefix}...)")


def load(paths: list[Path] | None = None) -> list[dict]:
    """Every record of ``benchmarks/results/*.jsonl`` (or ``paths``), each checked."""
    out = []
    for path in paths or sorted(RESULTS.glob("*.jsonl")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                rec = json.loads(line)
                check(rec, f"{path.name} line {i}")
                out.append(rec)
    return out

"""Where a quickstart's time goes: its stages (wall and CPU time), the PPO runs' own split (sampling, scoring,
update), and optionally a py-spy profile's samples by phase.

    python benchmarks/quickstart_profile.py --run runs/qs-profile                 # run `shifu quickstart`, then profile it
    python benchmarks/quickstart_profile.py --run runs/qs-profile --threads 1 --spy   # under py-spy (10 Hz)
    python benchmarks/quickstart_profile.py runs/qs-profile --record --series before  # profile a finished run

``--run`` starts ``shifu quickstart --out RUN`` (``--task``, ``--preset``, ``--seed``, ``--threads``, ``--set``
passed on) and measures its wall time and the CPU time of the whole process tree (``getrusage`` of the
children: on a shared machine the figure to compare; wall time counts the other processes' turns too). The
profile reads each stage's ``DONE`` marker (``seconds``, ``cpu_seconds``), sums the ``time/`` metrics of every
PPO run's ``metrics.jsonl`` (``generation_s``: sampling the responses; ``scoring_s``: the reward model, the
reference's and the critic's forward passes; ``update_s``: the PPO epochs) and prints the held-out gain with
its standard error from ``summary.json``. With ``--spy``, py-spy samples the run (``--spy-rate`` Hz, raw
folded stacks next to the run directory) and the samples are split by the innermost phase they fall in
(:data:`PHASES`). ``--record`` appends the profile to ``benchmarks/results/quickstart_profile.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)

# phase of a py-spy sample (a frame reads "function (path/file.py:line)"): (phase, function or None: any, a
# piece of the file's path); the last phase with a frame on the sample's stack, outermost first, is the
# sample's (the innermost wins: the PPO trainer's held-out evaluation is "ppo: eval", not "ppo")
PHASES = (
    ("import", "<module>", ""),
    ("prepare", "prepare", "shifu/tasks/imdb.py"),
    ("sft", None, "shifu/trainers/sft"),
    ("pairs: sampling", "make_preference_pairs", "shifu/tasks/imdb.py"),
    ("pairs: judge", "vader_compound", "shifu/tasks/judges.py"),
    ("rm", None, "shifu/trainers/reward"),
    ("ppo: sampling", "sample_batch", "shifu/trainers/ppo_rollout.py"),
    ("ppo: scoring", "score_rollout", "shifu/trainers/ppo_rollout.py"),
    ("ppo: update", "learn", "shifu/trainers/ppo.py"),
    ("ppo: eval", None, "shifu/trainers/ppo_eval.py"),
    ("ppo: checkpoints", None, "shifu/runs/checkpoint.py"),
    ("eval", "evaluate", "shifu/evaluation/final.py"),
    ("soup", "merge_policies", "shifu/models/merge.py"),
    ("report", "render_report", "shifu/reporting/report.py"),
)


def phase_of(stack: str) -> str:
    """The :data:`PHASES` phase of one py-spy stack (frames joined by ``;``), ``other`` if none."""
    phase = "other"
    for frame in stack.split(";"):
        function, _, where = frame.partition(" (")
        for name, fn, path in PHASES:
            if (fn is None or function.strip() == fn) and path in where:
                phase = name
    return phase


def stage_times(run: Path) -> dict[str, dict[str, float | None]]:
    """Stage -> {seconds, cpu_seconds} from the ``DONE`` markers, in the order the stages ran, then ``eval``
    and the total from ``summary.json``."""
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    wall, cpu = summary.get("seconds", {}), summary.get("cpu_seconds", {})
    return {name: {"seconds": wall[name], "cpu_seconds": cpu.get(name)} for name in wall}


def ppo_split(run: Path) -> dict[str, dict[str, float]]:
    """Each PPO run's ``time/`` metrics summed over its iterations (seconds)."""
    out = {}
    for metrics in sorted(run.glob("ppo*/metrics.jsonl")):
        sums: dict[str, float] = {}
        for line in metrics.read_text(encoding="utf-8").splitlines():
            row = json.loads(line) if line.strip() else {}
            for key, value in row.items():
                if key.startswith("time/") and isinstance(value, (int, float)):
                    sums[key] = sums.get(key, 0.0) + value
        out[metrics.parent.name] = {k: round(v, 2) for k, v in sorted(sums.items())}
    return out


def spy_phases(raw: Path) -> dict[str, float]:
    """Share of py-spy's samples (raw folded stacks: ``frame;frame;... count``) per :data:`PHASES` phase."""
    counts: dict[str, int] = {}
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            phase = phase_of(stack)
            counts[phase] = counts.get(phase, 0) + int(n)
    total = sum(counts.values()) or 1
    return {k: round(v / total, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def run_quickstart(args: argparse.Namespace) -> dict[str, float]:
    """``shifu quickstart`` into ``args.run`` (under py-spy with ``--spy``): its wall and CPU seconds."""
    cmd = [sys.executable, "-m", "shifu", "quickstart", "--out", str(args.run), "--task", args.task]
    cmd += ["--seed", str(args.seed)] + (["--preset", args.preset] if args.preset else [])
    cmd += ["--threads", str(args.threads)] if args.threads else []
    for item in args.sets:
        cmd += ["--set", item]
    if args.spy:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        raw = args.run.with_name(args.run.name + ".spy.txt")
        cmd = [spy, "record", "-r", str(args.spy_rate), "-f", "raw", "-o", str(raw), "--", *cmd]
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(provenance.ROOT)})
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"wall_s": round(time.perf_counter() - t0, 2), "process_cpu_s": round(cpu, 2)}


def profile(run: Path, spy: Path | None) -> dict:
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    out = {
        key: summary.get(key)
        for key in (
            "gold_before",
            "gold_after",
            "gold_gain",
            "gold_gain_se",
            "kl",
            "rm_accuracy",
            "eval_prompts",
        )
    }
    out |= {
        "seconds_total": summary.get("seconds_total"),
        "cpu_seconds_total": summary.get("cpu_seconds_total"),
    }
    out |= {"stages": stage_times(run), "ppo_time": ppo_split(run)}
    if spy is not None and spy.exists():
        out["spy_phases"] = spy_phases(spy)
    return out


def show(p: dict) -> None:
    print(f"{'stage':<10} {'wall s':>9} {'cpu s':>9}")
    for name, t in p["stages"].items():
        print(f"{name:<10} {t['seconds']:>9.1f} {t['cpu_seconds'] or float('nan'):>9.1f}")
    print(f"{'total':<10} {p['seconds_total']:>9.1f} {p['cpu_seconds_total']:>9.1f}")
    for name, split in p["ppo_time"].items():
        print(f"{name}: " + ", ".join(f"{k[5:]} {v:.1f}" for k, v in split.items()))
    for k, v in p.get("spy_phases", {}).items():
        print(f"  py-spy {k:<16} {100 * v:5.1f} %")
    print(
        f"gain {p['gold_gain']:+.4f} +- {p['gold_gain_se']:.4f} (before {p['gold_before']:.4f}, after "
        f"{p['gold_after']:.4f}), kl {p['kl']:.2f}, rm accuracy {p['rm_accuracy']}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", type=Path, help="a finished quickstart run to profile")
    ap.add_argument("--run", type=Path, default=None, help="run `shifu quickstart --out RUN` first")
    ap.add_argument("--task", default="imdb")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="--threads of the run (0: torch's default)")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--spy", action="store_true", help="with --run: sample it with py-spy")
    ap.add_argument("--spy-rate", type=int, default=10)
    ap.add_argument("--note", default=None, help="with --record: what a reader must know about the run")
    provenance.add_arguments(ap)
    args = ap.parse_args(argv)
    run = args.run or args.run_dir
    if run is None:
        ap.error("name a finished run directory, or --run RUN")
    measured = run_quickstart(args) if args.run else {}
    raw = run.with_name(run.name + ".spy.txt")
    p = profile(run, raw if raw.exists() else None) | measured
    show(p)
    if measured:
        print(f"wall {measured['wall_s']:.1f} s, CPU of the process tree {measured['process_cpu_s']:.1f} s")
    params = {"task": args.task, "preset": args.preset or "small", "seed": args.seed, "sets": args.sets}
    provenance.record(
        args, "quickstart_profile", p, params=params, threads=args.threads or os.cpu_count(), note=args.note
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

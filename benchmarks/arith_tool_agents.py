"""An agent run that learns from every seed: ``shifu quickstart --task arith_tool --preset smollm2`` over seeds, per
path, each run in its own process with one torch thread, recorded in ``benchmarks/results/arith_tool_agents.jsonl``.

The paths: ``env``, the task's own calculator environment (``env-lockstep``: the same, its turns sampled one
sampler call per turn, ``generation.kv_budget_mb=0``); ``example``, the developers' example agent
(``examples/agents/arith_tool_agent.py``, the task's tool and system message); ``independent``, an agent written
without the task (``examples/agents/math_agent.py``: its own tool name and argument schema, no system prompt).
The agent paths start from SFT on the agent's own calls answered by the task's teacher (the quickstart's default
with ``ppo.agent``). Per run: the held-out accuracy before and after RL, the paired gain and its standard error,
whether it learned (a gain above zero of at least 3 standard errors; a start with no room left for such a gain,
too few prompts wrong, is ``at_ceiling``), tool use, process CPU seconds and peak RSS; then the untrained base
model against the final policy through the same path (``shifu eval --run``, paired on the same held-out prompts:
``base_gold``, ``base_gain``, ``learned_from_base``), the whole start's worth; per path, the mean gain with its
standard error over the seeds and the smallest gain in standard errors::

    python benchmarks/arith_tool_agents.py --paths env,example,independent --seeds 0,1,2,3,4 --record
    python benchmarks/arith_tool_agents.py --paths independent --seeds 0,1,2,3,4 --critic-head zero --record

``--critic-head``: the critic's new value head, ``normal`` (random, the default) or ``zero``
(``ppo.critic.head_init``), to choose the default from the same seeds. A finished run in ``--root`` is not
repeated. About 2500 CPU seconds per agent run and 1400-2300 per environment run. Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)
from arith_tool_agents_tables import at_ceiling

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / "examples" / "agents"
# each path's --set options on top of the smollm2 plan (an agent renders its own tools block, so its first input
# is longer than the environment's: the prompt bound is raised as docs/how-to/agents.md says)
AGENT = ["ppo.env.factory=null", "ppo.generation.stop=[]", "ppo.data.max_prompt_len=256"]
PATHS = {
    "env": [],
    "env-lockstep": ["ppo.generation.kv_budget_mb=0"],  # the environment's turns a sampler call each
    "example": [*AGENT, "ppo.agent.factory=arith_tool_agent:solve"],
    "independent": [*AGENT, "ppo.agent.factory=math_agent:solve"],
}
KEYS = ("gold_before", "gold_after", "gold_gain", "gold_before_se", "gold_after_se", "gold_gain_se")
KEYS += ("tool_use_before", "tool_use_after", "kl", "turns_after", "eval_prompts", "cpu_seconds_total")


def run(path: str, seed: int, head: str, root: Path) -> tuple[dict, list[str]]:
    """One quickstart (skipped when its summary exists); its figures and the ``--set`` options it ran with."""
    sets = PATHS[path] + ([f"ppo.critic.head_init={head}"] if head != "normal" else [])
    out = (root / f"{path}-{head}-s{seed}").resolve()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(AGENTS)])}
    if not (out / "summary.json").exists():
        cmd = [sys.executable, "-m", "shifu", "quickstart", "--task", "arith_tool", "--preset", "smollm2"]
        cmd += [
            "--seed",
            str(seed),
            "--threads",
            "1",
            "--out",
            str(out),
            *(x for s in sets for x in ("--set", s)),
        ]
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".log"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=AGENTS, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{out.name} failed: see {out.with_suffix('.log')}")
        process = {
            "process_user_sys_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mb": usage.ru_maxrss // 1024,
        }
        (out / "process.json").write_text(json.dumps(process))
    s = json.loads((out / "summary.json").read_text())
    metrics = {k: s[k] for k in KEYS if k in s}
    metrics |= json.loads((out / "process.json").read_text()) if (out / "process.json").exists() else {}
    gain, se = metrics.get("gold_gain"), metrics.get("gold_gain_se")
    metrics["gain_in_se"] = gain / se if gain is not None and se else None
    metrics["learned"] = learned(gain, se)
    metrics["at_ceiling"] = at_ceiling(metrics.get("gold_before"), metrics.get("eval_prompts"))
    return metrics | from_base(out, s, env), sets


def learned(gain: float | None, se: float | None) -> bool:
    """A gain above zero of at least 3 standard errors (a gain of 0 with a standard error of 0 is not one)."""
    return bool(gain is not None and se is not None and gain > 0 and gain >= 3 * se)


def from_base(out: Path, summary: dict, env: dict) -> dict:
    """The whole start's worth: the untrained base model (``data/base``, what SFT starts from) against the final
    policy, through the same path (agent or environment), on the quickstart's held-out prompts (the first
    ``eval_prompts`` of ``data/prompts_eval.jsonl``) at its temperature, paired by ``shifu eval --run``; written to
    ``base_vs_final.json`` once."""
    rec = out / "base_vs_final.json"
    if not rec.exists():
        cmd = [sys.executable, "-m", "shifu", "eval", "--run", str(out / "ppo")]
        cmd += [
            "--prompts",
            str(out / "data" / "prompts_eval.jsonl"),
            "--num-prompts",
            str(summary["eval_prompts"]),
        ]
        cmd += ["--temperature", str(summary["eval_temperature"])]
        cmd += ["--threads", "1", "--no-progress", "--out", str(rec), str(out / "data" / "base")]
        cmd += [str(out / "ppo" / "final")]
        with open(out.with_suffix(".base.log"), "w") as log:
            done = subprocess.run(cmd, cwd=AGENTS, env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"{out.name}: the base evaluation failed: see {out.with_suffix('.base.log')}")
    r = json.loads(rec.read_text())
    base, paired = r["policies"]["A"], r["paired"]
    return {
        "base_gold": base["mean"],
        "base_gold_se": base["se"],
        "base_tool_use": base.get("tool_use"),
        "base_gain": paired["gain"],
        "base_gain_se": paired["gain_se"],
        "learned_from_base": learned(paired["gain"], paired["gain_se"]),
    }


def summary(path: str, head: str, runs: list[dict]) -> dict:
    """The mean gain over the seeds with its standard error (over seeds), the smallest gain in standard errors,
    the seeds that learned."""
    gains = [r["gold_gain"] for r in runs if r.get("gold_gain") is not None]
    n = len(gains)
    mean = sum(gains) / n if n else None
    se = math.sqrt(sum((g - mean) ** 2 for g in gains) / (n - 1) / n) if n > 1 else None
    worst = min((r["gain_in_se"] for r in runs if r.get("gain_in_se") is not None), default=None)
    return {
        "path": path,
        "critic_head": head,
        "seeds": n,
        "gain_mean": mean,
        "gain_mean_se": se,
        "min_gain_in_se": worst,
        "learned": sum(r["learned"] for r in runs),
        "at_ceiling": sum(r["at_ceiling"] for r in runs),
        "learned_from_base": sum(bool(r.get("learned_from_base")) for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="env,example,independent", help=f"comma-separated, of {sorted(PATHS)}")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--critic-head", choices=("normal", "zero"), default="normal")
    ap.add_argument("--root", default=".bench/arith_tool_agents", help="where the runs go")
    provenance.add_arguments(ap)
    args = ap.parse_args()
    for path in args.paths.split(","):
        if path not in PATHS:
            raise SystemExit(f"--paths: unknown path {path!r}; use {', '.join(PATHS)}")
        runs = []
        for seed in (int(x) for x in args.seeds.split(",")):
            metrics, sets = run(path, seed, args.critic_head, Path(args.root))
            runs.append(metrics)
            print(
                json.dumps({"path": path, "seed": seed, "critic_head": args.critic_head, **metrics}),
                flush=True,
            )
            params = {"task": "arith_tool", "preset": "smollm2", "seed": seed, "path": path, "sets": sets}
            provenance.record(args, "arith_tool_agents", metrics, params=params, threads=1)
        print(json.dumps(summary(path, args.critic_head, runs)), flush=True)


if __name__ == "__main__":
    main()

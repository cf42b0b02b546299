"""A long asynchronous run: does the plain clipped objective or the decoupled one with SAO's mask collapse, and where?

``shifu quickstart --task arith_tool`` (the tiny preset: PPO with its critic on calculator episodes) trained for
``--iterations`` (120: four times the preset's 30) at ``max_staleness=S`` with the deterministic ``fixed``
schedule (batch k sampled by version k - S), once per objective, each run in its own process with one torch
thread:

- ``synchronous``: S = 0, the reference;
- ``plain``: S > 0, the clipped objective around the trainer's policy, the stale batch's ratios as they come;
- ``decoupled_mask``: S > 0, ``decoupled=true`` (the clip around the proximal policy, each token weighted by
  pi_prox / pi_behav) and ``is_mask=C`` (tokens whose ratio falls outside [1/C, C] dropped).

Per run: the held-out accuracy before and after (paired gain, standard error), the KL to the SFT policy, and the
training curve read from ``metrics.jsonl``: the best and the last mean return over ``--window`` iterations,
where the best was, and ``collapsed`` when the last window's return fell more than ``--drop`` below the best (the
iteration where the return first fell that far is ``collapse_at``); also the mean and largest of
``policy/clipfrac``, ``policy/approx_kl`` and ``rollout/is_maskfrac`` over the run. Records in
``benchmarks/results/async_objective.jsonl``::

    SHIFU_THREADS=1 python benchmarks/async_objective.py --seeds 0 --record

A finished run in ``--root`` is not repeated. About 20 CPU minutes per run at 120 iterations. Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("synchronous", "plain", "decoupled_mask")


def variant_sets(variant: str, iterations: int, staleness: int, mask: float) -> list[str]:
    sets = [f"ppo.iterations={iterations}"]
    if variant == "synchronous":
        return sets
    sets += [f"ppo.max_staleness={staleness}", "ppo.async_schedule=fixed"]
    if variant == "decoupled_mask":
        sets += ["ppo.decoupled=true", f"ppo.is_mask={mask}"]
    return sets


def run(out: Path, seed: int, sets: list[str]) -> float | None:
    """The quickstart into ``out`` unless finished there; its CPU seconds (None: finished before)."""
    if (out / "summary.json").exists():
        return None
    cmd = [sys.executable, "-m", "shifu", "quickstart", "--task", "arith_tool", "--preset", "tiny"]
    cmd += ["--seed", str(seed), "--threads", "1", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1)


def curve(metrics: Path, window: int, drop: float) -> dict:
    """The training return's best and last ``window``-iteration means, and where it fell ``drop`` below the best."""
    rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    train = [r for r in rows if "env/return" in r]
    returns = [r["env/return"] for r in train]
    means = [sum(returns[i : i + window]) / window for i in range(len(returns) - window + 1)]
    best_at = max(range(len(means)), key=means.__getitem__)
    fell = [i for i in range(best_at, len(means)) if means[i] < means[best_at] - drop]
    out = {
        "return_first": round(means[0], 4),
        "return_best": round(means[best_at], 4),
        "return_best_at": best_at + window,  # the window's last iteration
        "return_last": round(means[-1], 4),
        "collapsed": bool(means[-1] < means[best_at] - drop),
        "collapse_at": fell[0] + window if fell else None,
    }
    for key in ("policy/clipfrac", "policy/approx_kl", "rollout/is_maskfrac", "objective/kl"):
        xs = [r[key] for r in train if key in r]
        if xs:
            name = key.split("/")[1]
            out[f"{name}_mean"], out[f"{name}_max"] = round(sum(xs) / len(xs), 5), round(max(xs), 5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--is-mask", type=float, default=5.0, help="the mask's band [1/C, C]")
    ap.add_argument("--window", type=int, default=10, help="iterations per mean of the training return")
    ap.add_argument("--drop", type=float, default=0.2, help="a fall from the best that counts as a collapse")
    ap.add_argument("--root", default=None, help="where the runs go (default .bench/async_objective)")
    provenance.add_arguments(ap)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; use {', '.join(VARIANTS)}")
    root = Path(args.root or ROOT / ".bench" / "async_objective")
    for seed in (int(s) for s in args.seeds.split(",")):
        for variant in variants:
            sets = variant_sets(variant, args.iterations, args.staleness, args.is_mask)
            out = root / f"{variant}-s{seed}"
            cpu = run(out, seed, sets)
            summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
            metrics = {
                k: summary.get(k) for k in ("gold_before", "gold_after", "gold_gain", "gold_gain_se", "kl")
            }
            metrics |= curve(out / "ppo" / "metrics.jsonl", args.window, args.drop)
            metrics["cpu_s"] = cpu
            params = {"task": "arith_tool", "preset": "tiny", "seed": seed, "variant": variant, "sets": sets}
            params |= {"window": args.window, "drop": args.drop}
            print(json.dumps({"variant": variant, "seed": seed} | metrics), flush=True)
            provenance.record(args, "async_objective", metrics, params=params, threads=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

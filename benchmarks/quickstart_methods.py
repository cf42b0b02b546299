"""The critic-free methods on the built-in quickstart tasks: gold gain over the SFT policy, KL and
time per method and seed, as ``shifu quickstart`` runs them.

    python benchmarks/quickstart_methods.py --task arith --seeds 0,1,2 --out runs/qs-methods
    python benchmarks/quickstart_methods.py --task imdb --methods grpo --seeds 0,1,2 \\
        --set ppo.kl.init_coef=0.3 --out runs/qs-imdb-grpo

Each seed's first run does the whole pipeline (prepare, SFT, and for imdb the pairs and the reward model);
every other method of that seed starts from a copy of those finished stages (a quickstart directory skips
finished stages), so the methods of one seed share the same SFT policy, reward model and held-out prompts,
and each summary still counts the copied stages' recorded seconds. One JSON line per run (the quickstart's
``summary.json`` plus ``method`` and ``sets``), then one per method: mean gain, its standard error over the
seeds, the seeds meeting ``--bar``, the worst seed, the RL stage's CPU seconds and the gain per CPU-minute of
it. ``--set`` applies to every method (after its own); ``--plot PNG`` draws gain against KL and against the
RL stage's CPU seconds (a rerun with the same ``--out`` reuses the finished runs, so it can add the plot).

Methods (their ``ppo.*`` settings on top of the quickstart plan, which stays PPO's for ``ppo``):
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)

from shifu.core.stats import mean_se
from shifu.pipelines.quickstart import DEFAULT_PRESET, PLANS, _plan

G = 4  # responses per prompt of the group methods
GROUP = [f"ppo.group_size={G}"]
METHODS: dict[str, list[str]] = {
    "ppo": [],  # the quickstart plan as it is: GAE with a critic
    "grpo": ["ppo.advantage_estimator=grpo", *GROUP, "ppo.kl.penalty=loss"],
    "dr_grpo": [
        "ppo.advantage_estimator=dr_grpo",
        *GROUP,
        "ppo.kl.penalty=loss",
        "ppo.loss_aggregation=token_sum_norm",
    ],
    "rloo": ["ppo.advantage_estimator=rloo", *GROUP],
    "reinforce_pp": ["ppo.advantage_estimator=reinforce_pp"],
    "reinforce_pp_baseline": ["ppo.advantage_estimator=reinforce_pp_baseline", *GROUP],
    "gspo": [
        "ppo.algo=gspo",
        "ppo.advantage_estimator=grpo",
        *GROUP,
        "ppo.kl.penalty=loss",
        "ppo.clip_low=3e-4",
        "ppo.clip_high=4e-4",
    ],
}
__doc__ += "\n".join(f"    {k:22s} {' '.join(v) or '(none)'}" for k, v in METHODS.items()) + "\n"
SHARED = {"arith": ("data", "sft"), "imdb": ("data", "sft", "pairs", "rm")}


def method_sets(task: str, method: str, same_prompts: bool) -> list[str]:
    """``method``'s settings; with ``same_prompts`` a group method (G = 4) also samples G x the plan's
    ``batch_size`` and ``minibatch_size`` responses, i.e. as many prompts per iteration and optimiser steps
    per iteration as the plan's PPO (measured on arith: at the plan's batch, 32 prompts x 4, GRPO gained
    +0.05-0.10 where 128 x 4 gained +0.27)."""
    sets = list(METHODS[method])
    if same_prompts and GROUP[0] in sets:
        ppo = PLANS[(task, DEFAULT_PRESET[task])]["ppo"]
        sets += [f"ppo.batch_size={G * ppo['batch_size']}", f"ppo.minibatch_size={G * ppo['minibatch_size']}"]
    return sets


def run_one(task: str, method: str, seed: int, out: Path, sets: list[str], threads: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "shifu.cli.main",
        "quickstart",
        "--task",
        task,
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--threads",
        str(threads),
    ]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{method} seed {seed} failed (exit {done.returncode}); its directory: {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(SHARED), default="arith")
    ap.add_argument("--methods", default=",".join(m for m in METHODS if m != "ppo"))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE", help="for every method")
    ap.add_argument(
        "--same-prompts",
        action="store_true",
        help="group methods: G x the plan's batch and minibatch (the plan's prompts per iteration)",
    )
    ap.add_argument("--bar", type=float, default=0.15, help="gold gain a seed must reach (default 0.15)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--plot", metavar="PNG", help="also draw gain against KL and against the RL stage's CPU s"
    )
    provenance.add_arguments(ap)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    root = Path(args.out)
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in (int(s) for s in args.seeds.split(",")):
        first: Path | None = None
        for method in methods:
            out = root / f"{method}-s{seed}"
            sets = method_sets(args.task, method, args.same_prompts) + args.set
            if not (out / "summary.json").exists():
                if first is not None and not out.exists():  # the seed's finished shared stages
                    for stage in SHARED[args.task]:
                        shutil.copytree(first / stage, out / stage)
                run_one(args.task, method, seed, out, sets, args.threads)  # (a rerun keeps finished runs)
            row = {
                "method": method,
                "sets": sets,
                **json.loads((out / "summary.json").read_text(encoding="utf-8")),
            }
            first = first or out
            rows[method].append(row)
            keep = ("gold_before", "gold_after", "gold_gain", "gold_gain_se", "kl", "seconds_total")
            print(json.dumps({"method": method, "seed": seed, **{k: row[k] for k in keep}}), flush=True)
            preset = DEFAULT_PRESET[args.task]
            params = {
                "task": args.task,
                "preset": preset,
                "seed": seed,
                "method": method,
                "sets": sets,
                "same_prompts": args.same_prompts,
                **({"plan": "default"} if not sets else {}),
            }
            metrics = {k: v for k, v in row.items() if k not in ("method", "sets", "task", "preset", "seed")}
            provenance.record(
                args,
                "quickstart",
                metrics,
                params=params,
                config=_plan(args.task, preset, sets),
                threads=args.threads,
            )
    for method, rs in rows.items():
        gains = [r["gold_gain"] for r in rs]
        se = mean_se(gains)[1] if len(gains) > 1 else float("nan")  # (one seed: no spread to report)
        rl = [rl_cpu_seconds(r) for r in rs]
        per_minute = [g / (c / 60) for g, c in zip(gains, rl)]
        summary = {
            "seeds": len(rs),
            "gain_mean": statistics.mean(gains),
            "gain_se_over_seeds": se,
            "seeds_meeting_bar": sum(g >= args.bar for g in gains),
            "bar": args.bar,
            "worst_gain": min(gains),
            "kl_mean": statistics.mean(r["kl"] for r in rs),
            "kl_max": max(r["kl"] for r in rs),
            "seconds_max": max(r["seconds_total"] for r in rs),
            "gains": gains,
            "rl_cpu_seconds_mean": statistics.mean(rl),
            "gain_per_rl_cpu_minute": statistics.mean(per_minute),
        }
        print(json.dumps({"method": method, **summary}), flush=True)
        params = {
            "task": args.task,
            "preset": DEFAULT_PRESET[args.task],
            "method": method,
            "sets": method_sets(args.task, method, args.same_prompts) + args.set,
            "same_prompts": args.same_prompts,
        }
        provenance.record(args, "quickstart_methods", summary, params=params, threads=args.threads)
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


def rl_cpu_seconds(row: dict) -> float:
    """CPU seconds of the RL stage(s) of a quickstart summary (``ppo``, and ``ppo-2``... of a soup)."""
    return sum(v for k, v in row["cpu_seconds"].items() if k == "ppo" or k.startswith("ppo-"))


def plot(rows: dict[str, list[dict]], path: Path) -> None:
    """Two views of the same runs: gold gain against KL, and against the RL stage's CPU seconds; one small
    marker per seed, the method's mean over seeds with its standard error as a large one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for i, (method, rs) in enumerate(rows.items()):
        colour = f"C{i}"
        gains = [r["gold_gain"] for r in rs]
        se = mean_se(gains)[1] if len(gains) > 1 else 0.0
        for ax, xs in zip(axes, ([r["kl"] for r in rs], [rl_cpu_seconds(r) for r in rs])):
            ax.scatter(xs, gains, color=colour, s=14, alpha=0.5)
            ax.errorbar(
                [statistics.mean(xs)],
                [statistics.mean(gains)],
                yerr=[se],
                xerr=[mean_se(xs)[1] if len(xs) > 1 else 0.0],
                color=colour,
                marker="o",
                markersize=7,
                capsize=3,
                label=f"{method} ({len(rs)} seeds)",
            )
    axes[0].set_xlabel("KL to the reference, nats per response (held-out prompts)")
    axes[1].set_xlabel("CPU seconds of the RL stage (one thread)")
    axes[0].set_ylabel("gold gain over the SFT policy (held-out)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("quickstart: each method's seeds (small) and mean ± s.e. over seeds (large)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

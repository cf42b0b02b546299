"""A verifiers taskset trained on SmolLM2-135M-Instruct with ``shifu ppo``, per seed, each run in its own process
with one torch thread, recorded in ``benchmarks/results/verifiers_smollm2.jsonl``.

The taskset is ``examples/envs/verifiers_acronyms.py`` (write the acronym of a phrase; the fraction of its letters
in place): not arithmetic, and offline (its phrases come from a word list, nothing is downloaded), played by
verifiers' plain chat harness through the policy gateway. Each run trains on its ``train`` split and is measured
by the trainer's final evaluation on ``test`` (disjoint phrases): the start against the final policy on the same
held-out tasks and sampling seed, the paired gain and its standard error. Also recorded: the run's CPU time (the
shifu process and every process it waited for: the verifiers worker, its harness programs) and its peak memory
(the largest resident set of one process in that tree).

    python benchmarks/verifiers_smollm2.py --python ~/venvs/verifiers/bin/python --seeds 0,1,2 --record
    python benchmarks/verifiers_smollm2.py --python ... --seeds 0 --smoke   # a few minutes: 1 iteration, 8 tasks

``--python``: a Python with verifiers 0.4 and uv (``pip install 'verifiers==0.4.*' uv``); SmolLM2 comes from
``shifu install smollm2``. A finished run in ``--root`` is not repeated. Not run by CI.
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
# RLOO with LoRA, as the SmolLM2 quickstart plans train: 8 tasks x 4 episodes per rollout, one call of up to 12
# tokens per episode
SETTINGS = [
    "verifiers.taskset=verifiers_acronyms",
    "advantage_estimator=rloo",
    "group_size=4",
    "batch_size=32",
    "minibatch_size=16",
    "grad_accum=4",
    "micro_batch_size=8",
    "ppo_epochs=1",
    "lora.enabled=true",
    "optim.lr=5e-4",
    "optim.schedule=constant",
    "kl.controller=fixed",
    "kl.init_coef=0.01",
    "generation.max_new_tokens=12",
    "generation.max_total_tokens=12",
    "generation.max_turns=1",
    "eval.every=0",
    "eval.temperature=1.0",
    "data.max_prompt_len=96",
    "verifiers.concurrency=16",
    "progress=false",
    "tensorboard=false",
]
FULL = {"iterations": 20, "train_tasks": 640, "test_tasks": 128}
SMOKE = {"iterations": 1, "train_tasks": 8, "test_tasks": 8}


def smollm2() -> Path:
    from shifu.tasks.assets import converted_smollm2

    return converted_smollm2()


def run(seed: int, size: dict, python: str, root: Path) -> tuple[dict, list[str]]:
    """One ``shifu ppo`` run (skipped when its summary exists); its figures and the settings it ran with."""
    out = (root / f"s{seed}").resolve()
    sets = [
        *SETTINGS,
        f"seed={seed}",
        f"iterations={size['iterations']}",
        f"verifiers.kwargs={{num_tasks: {size['train_tasks']}}}",
        f"verifiers.eval_kwargs={{split: test, num_tasks: {size['test_tasks']}}}",
        f"eval.final_prompts={size['test_tasks']}",
        f"eval.num_prompts={size['test_tasks']}",
    ]
    if not (out / "summary.json").exists():
        cmd = [sys.executable, "-m", "shifu", "ppo", "--out", str(out), f"model.path={smollm2()}"]
        cmd += [*sets, f"verifiers.python={python}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SHIFU_THREADS": "1", "PYTHONPATH": str(ROOT)}
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".log"), "w") as log:
            # from examples/envs: the taskset module is imported from the working directory
            proc = subprocess.Popen(
                cmd, cwd=ROOT / "examples" / "envs", env=env, stdout=log, stderr=subprocess.STDOUT
            )
            _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"seed {seed} failed: see {out.with_suffix('.log')}")
        # the tree's CPU: the shifu process (its own rusage) and what it waited for (the verifiers worker and
        # its harness programs end with the run); ru_maxrss of a waited child covers its waited descendants
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        figures = {
            "process_user_sys_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mib": round(max(usage.ru_maxrss, children.ru_maxrss) / 1024, 1),
        }
        (out / "process.json").write_text(json.dumps(figures))
    s = json.loads((out / "summary.json").read_text())
    keys = ("gold_before", "gold_after", "gold_gain", "gold_before_se", "gold_after_se", "gold_gain_se")
    metrics = {k: s[k] for k in (*keys, "eval_prompts") if k in s}  # (the final evaluation's)
    metrics |= json.loads((out / "process.json").read_text())
    return metrics, sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="a Python with verifiers 0.4 and uv")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--smoke", action="store_true", help="1 iteration on 8 tasks: checks the pipeline, measures nothing"
    )
    ap.add_argument("--root", default=".bench/verifiers_smollm2", help="where the runs go")
    provenance.add_arguments(ap)
    args = ap.parse_args()
    size = SMOKE if args.smoke else FULL
    root = Path(args.root) / ("smoke" if args.smoke else "full")
    for seed in (int(x) for x in args.seeds.split(",")):
        metrics, sets = run(seed, size, args.python, root)
        print(json.dumps({"seed": seed, **metrics}), flush=True)
        params = {
            "model": "smollm2-135m-instruct",
            "taskset": "verifiers_acronyms",
            "seed": seed,
            "sets": sets,
        }
        provenance.record(args, "verifiers_smollm2", metrics, params=params | size, threads=1)


if __name__ == "__main__":
    main()

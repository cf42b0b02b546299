"""Time full PPO iterations of shifu (``shifu bench``), and, with --vs-trl, of TRL's PPO on the identical models.

The setup, the shapes and shifu's timed run are ``shifu bench``'s (:mod:`shifu.bench.timing`, which works
from an installed wheel); this script adds what needs a source checkout: TRL in its own virtualenv
(``.bench/trl-venv``, TRL 1.12.0) building bit-identical models from the same seeds, the token-budget A/B, and
records with provenance. Prints one JSON line per system.

    python benchmarks/ppo_iteration.py              # shifu only (= shifu bench)
    python benchmarks/ppo_iteration.py --vs-trl     # alternate shifu and TRL runs, print the ratio
    python benchmarks/ppo_iteration.py --short      # 1 iteration, no warm-up (CI: keeps it from rotting)

Every option of ``shifu bench`` (``--shape``, ``--response-len``, ``--eos-scale``, ``--micro-batch-tokens``,
...), and ``--budget-ab N``: alternate shifu runs without and with ``micro_batch_tokens=N`` instead of the
TRL comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import provenance  # noqa: E402  (benchmarks/provenance.py: this script's own folder is on sys.path)
import torch  # noqa: E402

from shifu.bench import timing as bench  # noqa: E402
from shifu.bench.workload import (  # noqa: E402
    SEED,
    Setup,
    build_policy,
    build_prompts,
    build_scalar_parts,
    build_tokenizer,
    matmul_peak_gflops,
    model_config,
    summarise,
)

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".bench" / "trl-venv"
TRL_SPEC = ["trl==1.12.0"]
TORCH_WHEEL_GLOB = "/opt/wheels/torch-2.13.0*.whl"


# ----------------------------------------------------------------------------------------- TRL
def run_trl(s: Setup, n_iters: int, warmup: int) -> dict:
    """TRL 1.12.0 PPO (trl.experimental.ppo) on the same models; runs inside the TRL virtualenv."""
    import warnings

    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tmp = Path(tempfile.mkdtemp(prefix="trl-bench-"))
    tok = build_tokenizer(s, tmp)

    def scalar(seed):
        trunk, head = build_scalar_parts(s, seed)
        cfg = model_config(s)
        cfg.num_labels = 1
        m = AutoModelForSequenceClassification.from_config(cfg)
        getattr(m, m.base_model_prefix).load_state_dict(trunk.state_dict())
        with torch.no_grad():
            m.score.weight.copy_(head)
        return m.eval()

    n = warmup + n_iters
    data = Dataset.from_dict({"input_ids": build_prompts(s, n).tolist()})
    # TRL: rollout batch = per_device_train_batch_size * gradient_accumulation_steps = 32, split into
    # num_mini_batches = 4 minibatches of 8 (at the default setup). Accelerate would step the optimiser
    # only every 4th minibatch (each minibatch is one micro-batch); gradient_accumulation_steps is reset
    # to 1 on the accelerator below so that TRL, like shifu, takes 16 optimiser steps of 8 sequences per
    # iteration. With --eos-scale TRL truncates responses after EOS (stop_token="eos").
    n_mini = s.batch // s.minibatch
    args = PPOConfig(
        output_dir=str(tmp / "out"),
        per_device_train_batch_size=s.minibatch,
        gradient_accumulation_steps=n_mini,
        num_mini_batches=n_mini,
        num_ppo_epochs=s.epochs,
        total_episodes=s.batch * n,
        response_length=s.new_tokens,
        stop_token="eos" if s.eos_scale else None,
        temperature=1.0,
        local_rollout_forward_batch_size=s.batch,
        learning_rate=1e-5,
        kl_coef=0.05,
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        num_sample_generations=0,
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=SEED,
        dataloader_num_workers=0,
        missing_eos_penalty=None,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_policy(s),
        ref_model=build_policy(s),
        reward_model=scalar(1),
        value_model=scalar(2),
        train_dataset=data,
    )
    trainer.accelerator.gradient_accumulation_steps = 1
    steps = [0]
    trainer.optimizer.optimizer.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    trainer.add_callback(Clock())
    peak_before = matmul_peak_gflops()
    trainer.train()
    totals = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    # TRL times no phases; only the iteration total is comparable
    iters = [
        {"total": t, "generation": float("nan"), "scoring": float("nan"), "train": float("nan")}
        for t in totals
    ]
    out = summarise(
        s, "trl", iters, (peak_before, matmul_peak_gflops()), {"optimizer_steps_per_iter": steps[0] // n}
    )
    for k in ("median_generation_s", "median_scoring_s", "median_train_s", "generated_tokens_per_s"):
        out[k] = None
    for k in ("mfu_generation", "mfu_scoring", "mfu_train"):
        out[k] = None
    import trl

    out["trl_version"] = trl.__version__
    return out


def ensure_trl_venv() -> Path:
    """The TRL virtualenv (created on first use: CPU torch from the local wheel if present, then TRL)."""
    py = TRL_VENV / "bin" / "python"
    if py.exists():
        return py
    import glob

    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    wheels = glob.glob(TORCH_WHEEL_GLOB)
    torch_spec = wheels[0] if wheels else "torch==2.13.0"
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(
        [*pip, torch_spec, "--index-url", "https://download.pytorch.org/whl/cpu"]
        if not wheels
        else [*pip, torch_spec],
        check=True,
    )
    subprocess.run([*pip, *TRL_SPEC], check=True)
    return py


def setup_args(s: Setup) -> list[str]:
    """``s`` as command-line arguments (the subprocesses rebuild the same setup)."""
    out = [
        "--shape",
        s.shape,
        "--response-len",
        str(s.new_tokens),
        "--batch",
        str(s.batch),
        "--minibatch",
        str(s.minibatch),
        "--eos-scale",
        str(s.eos_scale),
    ]
    return out + (["--micro-batch-tokens", str(s.micro_batch_tokens)] if s.micro_batch_tokens else [])


# glibc's malloc set as shifu sets it (shifu.parallel.threads.keep_freed_memory), for a peer run given the same allocator
KEPT_MALLOC_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"}


def subprocess_run(
    s: Setup, python: str, system: str, n_iters: int, warmup: int, fast: bool = False, env_extra=None
) -> dict:
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--system",
        system,
        "--iters",
        str(n_iters),
        "--warmup",
        str(warmup),
        *setup_args(s),
    ] + (["--fast"] if fast else [])
    env = dict(
        os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {})
    )
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"{system} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    s = bench.setup_from(args)
    torch.set_num_threads(1)
    if args.short:
        args.iters, args.warmup, args.rounds = 1, 0, 1
    if args.system == "trl":
        print(json.dumps(run_trl(s, args.iters, args.warmup)), flush=True)
        return 0
    if args.budget_ab:
        _budget_ab(s, args)
        return 0
    if not args.vs_trl:
        out = bench.single(s, args)
        record(
            s,
            args,
            "single",
            {k: v for k, v in out.items() if k != "setup"},
            fast=args.fast,
            malloc=out.get("malloc"),
        )
        return 0
    _vs_trl(s, args)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = bench.parser(__doc__)
    ap.prog = None  # this script's own name in --help
    ap.add_argument("--vs-trl", action="store_true", help="alternate shifu and TRL runs; print the ratio")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of shifu/TRL runs with --vs-trl")
    ap.add_argument(
        "--budget-ab",
        type=int,
        default=None,
        help="alternate shifu fp32 runs without / with micro_batch_tokens=N (no TRL)",
    )
    ap.add_argument(
        "--peer-malloc",
        action="store_true",
        help="with --vs-trl: also run TRL with glibc malloc set as shifu sets it",
    )
    ap.add_argument("--system", choices=["shifu", "trl"], default="shifu", help=argparse.SUPPRESS)
    provenance.add_arguments(ap)
    return ap


def _budget_ab(s: Setup, args: argparse.Namespace) -> None:
    """``--budget-ab N``: alternating shifu fp32 runs without / with ``micro_batch_tokens=N``."""
    runs = {"fixed": [], "budget": []}
    for _ in range(args.rounds):
        for name, budget in (("fixed", None), ("budget", args.budget_ab)):
            s = dataclasses.replace(s, micro_batch_tokens=budget)
            runs[name].append(subprocess_run(s, sys.executable, "shifu", args.iters, args.warmup))
            print(json.dumps({"run": name, **runs[name][-1]}), flush=True)
    med = {k: statistics.median(r["median_train_s"] for r in v) for k, v in runs.items()}
    summary = {
        "update_s_fixed": med["fixed"],
        "update_s_budget": med["budget"],
        "update_ratio_budget_over_fixed": med["budget"] / med["fixed"],
        "per_round_update_ratio": [
            b["median_train_s"] / a["median_train_s"] for a, b in zip(runs["fixed"], runs["budget"])
        ],
    }
    print(json.dumps(summary), flush=True)
    runs = {k: [{x: y for x, y in r.items() if x != "setup"} for r in v] for k, v in runs.items()}
    record(
        s,
        args,
        "budget-ab",
        {"summary": summary, "runs": runs},
        budget=args.budget_ab,
        micro_batch_tokens=None,
    )


def _vs_trl(s: Setup, args: argparse.Namespace) -> None:
    """``--vs-trl``: alternating shifu, TRL and shifu-fast runs (and TRL with shifu's malloc), their ratios."""
    trl_py = str(ensure_trl_venv())
    runs: dict[str, list[dict]] = {"shifu": [], "trl": [], "shifu_fast": []}
    for _ in range(args.rounds):
        runs["shifu"].append(subprocess_run(s, sys.executable, "shifu", args.iters, args.warmup))
        print(json.dumps({"run": "shifu", **runs["shifu"][-1]}), flush=True)
        runs["trl"].append(subprocess_run(s, trl_py, "trl", args.iters, args.warmup))
        print(json.dumps({"run": "trl", **runs["trl"][-1]}), flush=True)
        runs["shifu_fast"].append(
            subprocess_run(s, sys.executable, "shifu", args.iters, args.warmup, fast=True)
        )
        print(json.dumps({"run": "shifu_fast", **runs["shifu_fast"][-1]}), flush=True)
        if args.peer_malloc:  # TRL given shifu's malloc setting too: how much of the ratio is the allocator
            runs.setdefault("trl_kept_malloc", []).append(
                subprocess_run(s, trl_py, "trl", args.iters, args.warmup, env_extra=KEPT_MALLOC_ENV)
            )
            print(json.dumps({"run": "trl_kept_malloc", **runs["trl_kept_malloc"][-1]}), flush=True)

    def med(name):
        return statistics.median(r["median_s_per_iter"] for r in runs[name])

    summary = {
        "setup": dataclasses.asdict(s),
        "shifu_median_s_per_iter": med("shifu"),
        "trl_median_s_per_iter": med("trl"),
        "shifu_fast_median_s_per_iter": med("shifu_fast"),
        "ratio_shifu_over_trl": med("shifu") / med("trl"),
        "throughput_fast_over_trl": med("trl") / med("shifu_fast"),
        "throughput_fast_over_fp32": med("shifu") / med("shifu_fast"),
        "peak_rss_mib": {k: max(r["peak_rss_mib"] for r in v) for k, v in runs.items()},
    }
    if args.peer_malloc:
        summary["trl_kept_malloc_median_s_per_iter"] = med("trl_kept_malloc")
        summary["ratio_shifu_over_trl_kept_malloc"] = med("shifu") / med("trl_kept_malloc")
    if not args.no_gen_check:
        summary.update(bench.generation_vs_hf(s, args.gen_rounds))
    print(json.dumps(summary), flush=True)
    runs_only = {k: [{x: y for x, y in r.items() if x != "setup"} for r in v] for k, v in runs.items()}
    summary = {k: v for k, v in summary.items() if k != "setup"}
    record(s, args, "vs-trl", {"summary": summary, "runs": runs_only}, peer_malloc=args.peer_malloc)


def record(s: Setup, args: argparse.Namespace, mode: str, metrics: dict, **extra) -> None:
    """With ``--record``: the run as a provenance record (params: the setup, the mode and its options)."""
    params = {
        **dataclasses.asdict(s),
        "mode": mode,
        "rounds": args.rounds,
        "iters": args.iters,
        "warmup": args.warmup,
        **extra,
    }
    provenance.record(args, "ppo_iteration", metrics, params=params, config=params, threads=1)


if __name__ == "__main__":
    sys.exit(main())

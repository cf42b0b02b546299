"""What asynchronous PPO costs in memory: the peak resident memory of a ``shifu ppo`` run at ``max_staleness`` 0
and 1 (in the fixed and the bounded schedule), and the bytes of the samplers' copies of the policy's weights,
for the tiny character model of the tests and for SmolLM2-135M-Instruct (``shifu install smollm2``).

Each setting runs in its own process (so that each peak is its own): a short PPO run with its critic, one
rollout per prompt and a two-turn environment that answers at once (the long-tail benchmark's, without latency).
The child counts the sampler copies the producers make (``shifu.trainers.ppo_async.weights_copy``: a copy is
made once per sampler and refreshed in place afterwards) and their parameter and buffer bytes, beside the
policy's own.

    python benchmarks/async_memory.py [--record]                 # tiny and smollm2, S = 0 and 1
    python benchmarks/async_memory.py --models tiny              # seconds
    python benchmarks/async_memory.py --schedules bounded --samplers 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import provenance  # noqa: E402  (benchmarks/provenance.py: this script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def module_bytes(m) -> int:
    """Bytes of a module's parameters and buffers (each storage once)."""
    import itertools

    seen, total = set(), 0
    for t in itertools.chain(m.parameters(), m.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def child(
    model: str,
    prompts: str,
    staleness: int,
    schedule: str,
    samplers: int,
    iterations: int,
    batch: int,
    out: str,
) -> dict:
    """One run in this process: its peak RSS, the policy's bytes, the sampler copies made and their bytes."""
    import torch

    from shifu.config.loader import load_config
    from shifu.trainers import ppo, ppo_async, ppo_bounded_producer

    torch.set_num_threads(int(os.environ.get("SHIFU_THREADS", "1")))
    copies: list[int] = []
    policy: list[int] = []
    weights_copy = ppo_async.weights_copy

    def counted(held, live):
        sampler = weights_copy(held, live)
        if sampler is not held:  # a new copy (not a refresh in place)
            copies.append(module_bytes(sampler))
            policy.append(module_bytes(live))
        return sampler

    # both schedules' producers make and refresh their copies with it
    ppo_async.weights_copy = ppo_bounded_producer.weights_copy = counted
    overrides = [
        f"out_dir={out}",
        f"model.path={model}",
        f"data.train={prompts}",
        "env.factory=async_longtail:LongTail",
        "env.kwargs={slow_s: 0, turns: 2}",
        "generation.max_turns=2",
        "generation.max_new_tokens=4",
        "generation.max_total_tokens=16",
        "critic.init=sft",
        f"iterations={iterations}",
        f"batch_size={batch}",
        f"minibatch_size={batch}",
        "eval.every=0",
        "eval.num_prompts=2",
        "eval.final_prompts=0",
        "save_every=0",
        "progress=false",
        "tensorboard=false",
        f"max_staleness={staleness}",
        f"async_schedule={schedule}",
        f"async_samplers={samplers}",
        *(["decoupled=true"] if staleness else []),
    ]
    ppo.train(load_config(ppo.Config, None, overrides), overwrite=True)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "sampler_copies": len(copies),
        "sampler_copy_mb": round(sum(copies) / 2**20, 1),
        "policy_mb": round(policy[0] / 2**20, 1) if policy else None,
    }


def model_path(name: str, work: Path) -> str:
    if name == "smollm2":
        from shifu.tasks.assets import converted_smollm2

        return str(converted_smollm2())
    sys.path.insert(0, str(ROOT / "tests"))
    from ppo_task import build_char_model

    return str(build_char_model(work / "model"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="episodes per iteration")
    ap.add_argument("--schedules", nargs="+", default=["fixed", "bounded"], choices=["fixed", "bounded"])
    ap.add_argument("--samplers", type=int, default=4, help="a bounded run's async_samplers (its default: 4)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON arguments of one run
    provenance.add_arguments(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from ppo_task import write_prompts

    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    }
    print("model | max_staleness | schedule | peak RSS (MB) | sampler copies | copy (MB) | policy (MB)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = str(write_prompts(work / "prompts.jsonl"))
        for name in args.models:
            model = model_path(name, work)
            # S = 0 once (synchronous in either schedule), then S = 1 in each schedule
            for S, schedule in [(0, "fixed"), *((1, s) for s in args.schedules)]:
                spec = {
                    "model": model,
                    "prompts": prompts,
                    "staleness": S,
                    "schedule": schedule,
                    "samplers": args.samplers,
                    "iterations": args.iterations,
                    "batch": args.batch,
                    "out": str(work / f"{name}-s{S}-{schedule}"),
                }
                done = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(spec)],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if done.returncode:
                    sys.exit(f"{name} at max_staleness={S} failed:\n{done.stderr[-3000:]}")
                m = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"{name} | {S} | {schedule} | {m['peak_rss_mb']} | {m['sampler_copies']} | "
                    f"{m['sampler_copy_mb']} | "
                    f"{m['policy_mb']}",
                    flush=True,
                )
                provenance.record(
                    args,
                    "async_memory",
                    m,
                    params={
                        "model": name,
                        "max_staleness": S,
                        "async_schedule": schedule,
                        **({"async_samplers": args.samplers} if schedule == "bounded" and S else {}),
                        "iterations": args.iterations,
                        "episodes": args.batch,
                        "claim": "at most one extra copy of the policy's weights per sampler",
                    },
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

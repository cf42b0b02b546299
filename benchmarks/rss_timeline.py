"""Peak resident memory of a SmolLM2 run per stage and per PPO iteration, from the kernel's high-water mark.

Two workloads, each ``python -m shifu ...`` in a child process (one torch thread):

- ``episodes``: ``shifu ppo`` on SmolLM2-135M-Instruct (converted once by ``shifu install smollm2``) with a
  scripted game (:mod:`guess_env`: guess a number from higher/lower hints, a ~150-token first input), GRPO
  with LoRA and bf16, 16 episodes of up to 320 tokens (at most 8 turns, each as long as the budget
  allows) per rollout;
- ``quickstart``: ``shifu quickstart --task arith_tool --preset smollm2`` (every stage: sft, ppo, the
  final evaluation).

The parent reads the child's ``VmHWM`` (``/proc/PID/status``) whenever the run moves on, a quickstart stage
(its ``[quickstart] stage`` lines) or a PPO iteration (a line of the PPO run's ``metrics.jsonl``), and
resets it (``/proc/PID/clear_refs``; it polls every 50 ms, so a segment's first 50 ms may count in the
one before), so each segment's peak is the kernel's; ``VmRSS`` at each boundary shows growth across
iterations. The whole run's peak is the largest segment's (the reset also resets ``ru_maxrss``). One JSON
line:

    python benchmarks/rss_timeline.py episodes --record
    python benchmarks/rss_timeline.py quickstart --record
    PYTHONPATH=examples/agents python benchmarks/rss_timeline.py quickstart --set ppo.env.factory=null \
        --set 'ppo.generation.stop=[]' --set ppo.agent.factory=arith_tool_agent:solve \
        --set ppo.data.max_prompt_len=256 --record   # through an agent

Keys: ``peak_rss_mb`` (MiB), ``segments`` (``stage``, ``iterations_done``, ``peak_mb``, ``end_rss_mb`` with
its parts ``end_anon_mb`` and ``end_file_mb``, ``seconds``), ``iteration_peak_mb`` and ``iteration_end_rss_mb`` (PPO iterations in order),
``process_cpu_s`` (user + system, ``os.wait4``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
EPISODES = [
    "env.factory=guess_env:GuessNumber",
    "generation.max_turns=8",
    "generation.max_new_tokens=320",
    "generation.max_total_tokens=320",
    "batch_size=16",
    "group_size=4",
    "advantage_estimator=grpo",
    "minibatch_size=16",
    "grad_accum=4",
    "micro_batch_size=8",
    "ppo_epochs=1",
    "lora.enabled=true",
    "bf16=true",
    "generation.temperature=1.0",
    "data.max_prompt_len=256",
    "optim.lr=5e-4",
    "eval.every=0",
    "eval.num_prompts=16",
    "eval.final_prompts=0",
    "save_every=0",
    "progress=false",
    "tensorboard=false",
]


def status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS and its anonymous and file-backed parts (RssAnon, RssFile: the model's weights, read
    from a safetensors file, are file pages) of ``pid`` in bytes (none once it is exiting)."""
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def iterations_done(metrics: Path) -> int:
    """PPO iterations finished: lines of ``metrics.jsonl`` with a rollout time."""
    if not metrics.exists():
        return 0
    lines = metrics.read_text(encoding="utf-8").splitlines()
    return sum('"time/rollout_s"' in x for x in lines if x.endswith("}"))


def watch(cmd: list[str], metrics: Path, log: Path, env: dict[str, str], first: str) -> dict:
    """Run ``cmd``; the high-water mark of each (stage, PPO iterations done) segment, and the whole run's."""
    stage = {"name": first}
    with open(log, "w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.PIPE, text=True, bufsize=1
        )

        def read_stderr():
            for line in proc.stderr:
                log_file.write(line)
                if line.startswith("[quickstart] "):  # "stage sft", "final evaluation on ...", ...
                    words = line.split()[1:]
                    stage["name"] = words[1] if words[0] == "stage" else " ".join(words[:2])

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        segments, key, t0, last = [], (first, 0), time.perf_counter(), None
        while True:
            time.sleep(0.05)
            pid, code, usage = os.wait4(proc.pid, os.WNOHANG)  # (not Popen.poll: it would reap the usage)
            if pid:
                break
            st = status(proc.pid)
            if "VmHWM" not in st:  # exiting
                continue
            last, now = st, (stage["name"], iterations_done(metrics))
            if now == key:
                continue
            try:
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            except OSError:
                continue
            segments.append(segment(key, last, t0))
            key, t0 = now, time.perf_counter()
        reader.join(timeout=5)
    proc.returncode = rc = os.waitstatus_to_exitcode(code)
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[3:6])} failed (exit {rc}): see {log}")
    segments.append(segment(key, last, t0))  # its peak as last read (within 0.05 s of the exit)
    ppo = [s for s in segments if s["stage"] == "ppo"][:-1]  # the last: after the last iteration
    return {
        "peak_rss_mb": max(s["peak_mb"] for s in segments),
        "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "iteration_peak_mb": [s["peak_mb"] for s in ppo],
        "iteration_end_rss_mb": [s["end_rss_mb"] for s in ppo],
        "segments": segments,
    }


def segment(key: tuple[str, int], st: dict[str, int], t0: float) -> dict:
    """One segment's figures (MiB): its peak and the resident set at its end."""
    return {
        "stage": key[0],
        "iterations_done": key[1],
        "peak_mb": round(st["VmHWM"] / 2**20, 1),
        "end_rss_mb": round(st["VmRSS"] / 2**20, 1),
        "end_anon_mb": round(st["RssAnon"] / 2**20, 1),
        "end_file_mb": round(st["RssFile"] / 2**20, 1),
        "seconds": round(time.perf_counter() - t0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=("episodes", "quickstart"))
    ap.add_argument("--iterations", type=int, default=3, help="episodes: PPO iterations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--note", default=None, help="with --record: a note kept in the record")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        help="episodes: a shifu ppo override after the others; quickstart: a quickstart --set",
    )
    provenance.add_arguments(ap)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="shifu-rss-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SHIFU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    base = [sys.executable, "-m", "shifu"]
    if args.workload == "episodes":
        import guess_env

        from shifu.tasks.assets import converted_smollm2

        prompts = guess_env.write_prompts(work / "games.jsonl")
        out = work / "episodes"
        sets = [f"model.path={converted_smollm2()}", f"data.train={prompts}", f"iterations={args.iterations}"]
        sets += [f"seed={args.seed}", *EPISODES, *args.sets]
        cmd = [*base, "ppo", "--out", str(out), "--overwrite", *sets]
        params = {"workload": "episodes", "sets": [*EPISODES, *args.sets], "iterations": args.iterations}
        params["seed"] = args.seed
        metrics = out / "metrics.jsonl"
    else:
        out = work / "quickstart"
        cmd = [*base, "quickstart", "--task", "arith_tool", "--preset", "smollm2"]
        cmd += ["--seed", str(args.seed), "--threads", "1", "--out", str(out)]
        cmd += [x for s in args.sets for x in ("--set", s)]
        params = {"workload": "quickstart", "task": "arith_tool", "preset": "smollm2", "seed": args.seed}
        if args.sets:
            params["sets"] = args.sets
        metrics = out / "ppo" / "metrics.jsonl"
    first = "ppo" if args.workload == "episodes" else "load"
    row = watch(cmd, metrics, work / f"{args.workload}.log", env, first)
    finished = out / ("final" if args.workload == "episodes" else "summary.json")
    if not finished.exists():  # (a stopped run may exit 0 with a checkpoint)
        raise SystemExit(f"the run did not finish: no {finished}")
    print(json.dumps({**params, **row}), flush=True)
    if args.record:
        provenance.record(args, "rss_timeline", row, params=params, config=params, threads=1, note=args.note)


if __name__ == "__main__":
    main()

"""What a long tail of slow environment steps costs a PPO run, synchronous and asynchronous: one environment step
in 10 takes ``--slow-s`` seconds (3 by default: a tool that times out, a judge that queues), the rest answer at
once. Which steps are slow is fixed by the prompt and the turn (a hash), so every schedule meets the same ones.

Each setting runs ``shifu ppo`` twice on a tiny character model with its critic and one rollout per prompt
(episodes of ``--turns`` turns with the environment, every call of a turn at once): with the slow steps and
without them. ``--sources agent`` runs the same episodes through an agent instead (:func:`solve`: an ``openai``
client agent on the policy gateway, whose tool, awaited between two calls, is slow on the same steps). The figure is the extra wall time the slow steps add, for ``max_staleness`` 0 (synchronous: each
iteration waits for its slowest episode), then 1 and 2 in each schedule of ``--schedules``: ``fixed`` (the next
batches are sampled in the background while the trainer updates, so at most the update's time of each straggler
is hidden) and ``bounded`` (``--samplers`` threads sample at once, each advancing its episodes on their own, and
each iteration trains the first episodes done: a straggler holds its own episode, not the batch).

    python benchmarks/async_longtail.py [--record]            # 20 iterations of 16 episodes per setting
    python benchmarks/async_longtail.py --short               # seconds: keeps it from rotting
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import provenance  # noqa: E402  (benchmarks/provenance.py: this script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
SLOW_EVERY = 10  # one step in 10 is slow


class LongTail:
    """An environment whose step sleeps ``slow_s`` seconds when crc32(prompt, turn) % 10 == 0, else answers at
    once; reward: the fraction of 'a' in the action; done after ``turns`` turns."""

    def __init__(self, slow_s: float = 3.0, turns: int = 2):
        self.slow_s, self.turns, self.turn, self.prompt = slow_s, turns, 0, ""

    def reset(self, row: dict) -> str:
        self.prompt, self.turn = row["prompt"], 0
        return row["prompt"]

    def step(self, action: str):
        from shifu import Step

        if slow(self.prompt, self.turn):
            time.sleep(self.slow_s)
        self.turn += 1
        return Step(
            observation="k", reward=action.count("a") / max(1, len(action)), done=self.turn >= self.turns
        )


def slow(prompt: str, turn: int) -> bool:
    return zlib.crc32(f"{prompt}/{turn}".encode()) % SLOW_EVERY == 0


async def solve(client, row: dict, slow_s: float = 3.0, turns: int = 2) -> float:
    """:class:`LongTail`'s episode as an ``openai`` client agent: ``turns`` calls, each answer followed by a tool
    call (awaited: ``slow_s`` seconds on the steps :class:`LongTail` sleeps on, else at once) whose result is
    the next message; returns the last answer's fraction of 'a'."""
    import asyncio

    messages, said = [{"role": "user", "content": row["prompt"]}], ""
    for turn in range(turns):
        out = await client.chat.completions.create(model="policy", messages=messages)
        said = out.choices[0].message.content or ""
        if slow(row["prompt"], turn):
            await asyncio.sleep(slow_s)
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "k"}]
    return said.count("a") / max(1, len(said))


def run_seconds(
    work: Path,
    inputs: dict,
    staleness: int,
    slow_s: float,
    args,
    schedule: str = "fixed",
    source: str = "env",
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one ``shifu ppo`` run."""
    from shifu.config.loader import load_config
    from shifu.trainers import ppo

    out = work / f"{source}-s{staleness}-{schedule}-{slow_s:g}"
    kwargs = f"{{slow_s: {slow_s}, turns: {args.turns}}}"
    by_source = {
        "env": ["env.factory=async_longtail:LongTail", f"env.kwargs={kwargs}"],
        "agent": ["agent.factory=async_longtail:solve", f"agent.kwargs={kwargs}"],
    }
    overrides = [
        f"out_dir={out}",
        f"model.path={inputs['agent_model' if source == 'agent' else 'model']}",
        f"data.train={inputs['prompts']}",
        *by_source[source],
        f"generation.max_turns={args.turns}",
        "generation.max_new_tokens=6",
        f"generation.max_total_tokens={8 * args.turns}",
        "critic.init=sft",
        f"iterations={args.iterations}",
        f"batch_size={args.batch}",
        f"minibatch_size={args.batch // 2}",
        "optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "eval.every=0",
        "eval.num_prompts=4",
        "eval.final_prompts=0",
        "save_every=0",
        "progress=false",
        "tensorboard=false",
        f"max_staleness={staleness}",
        f"async_schedule={schedule}",
        f"async_samplers={args.samplers}",
        *(["decoupled=true"] if staleness else []),
        # (the agent's calls carry the whole conversation, the template's separators included)
        *([f"generation.max_total_tokens={16 * args.turns}"] if source == "agent" else []),
    ]
    cfg = load_config(ppo.Config, None, overrides)
    t0, c0 = time.perf_counter(), time.process_time()
    ppo.train(cfg, overwrite=True)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="episodes per iteration")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--slow-s", type=float, default=3.0)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--schedules", nargs="+", default=["fixed", "bounded"], choices=["fixed", "bounded"])
    ap.add_argument("--samplers", type=int, default=4, help="async_samplers of the bounded runs")
    ap.add_argument("--sources", nargs="+", default=["env", "agent"], choices=["env", "agent"])
    ap.add_argument("--short", action="store_true", help="3 iterations of 4 episodes, 0.2 s slow steps")
    provenance.add_arguments(ap)
    args = ap.parse_args()
    if args.short:
        args.iterations, args.batch, args.slow_s = 3, 4, 0.2
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from ppo_task import build_char_model, write_prompts
    from test_agent import build_echo_task

    torch.set_num_threads(int(os.environ.get("SHIFU_THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs = {"model": build_char_model(work / "model"), "prompts": write_prompts(work / "prompts.jsonl")}
        # the agent's model: the same character model with a chat template (tests/test_agent.py)
        inputs["agent_model"] = build_echo_task(work / "agent")["char"] if "agent" in args.sources else None
        print(
            "source | max_staleness | schedule | wall, no latency (s) | wall, long tail (s) | extra (s) | "
            "extra / S=0's"
        )
        settings = [(0, "fixed")] if 0 in args.staleness else []  # (S = 0 is synchronous in either schedule)
        settings += [(S, sch) for sch in args.schedules for S in args.staleness if S > 0]
        for source in args.sources:
            base = None
            for S, schedule in settings:
                fast, _ = run_seconds(work, inputs, S, 0.0, args, schedule, source)
                slow_, cpu = run_seconds(work, inputs, S, args.slow_s, args, schedule, source)
                extra = slow_ - fast
                base = extra if S == 0 else base
                ratio = f"{extra / base:.2f}" if base else "-"
                print(
                    f"{source} | {S} | {schedule} | {fast:.1f} | {slow_:.1f} | {extra:.1f} | {ratio}",
                    flush=True,
                )
                provenance.record(
                    args,
                    "async_longtail",
                    {"wall_fast_s": fast, "wall_slow_s": slow_, "extra_s": extra, "cpu_slow_s": cpu},
                    params={
                        "source": source,
                        "max_staleness": S,
                        "async_schedule": schedule,
                        **({"async_samplers": args.samplers} if schedule == "bounded" else {}),
                        "iterations": args.iterations,
                        "episodes": args.batch,
                        "turns": args.turns,
                        "slow_s": args.slow_s,
                        "slow_every": SLOW_EVERY,
                    },
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

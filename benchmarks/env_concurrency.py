"""How much of a rollout a slow environment costs: 64 episodes of 3 turns whose every step sleeps 200 ms (a
search, a code runner, a remote judge), on a tiny model, with the environment's calls one at a time
(``env.concurrency=1``) and at once (the default).

The environment's share of a rollout is the rollout's time with the sleeping steps minus its time with the
same episodes whose steps return at once; three steps' latency (0.6 s) is the least any schedule can take.

    python benchmarks/env_concurrency.py [--record]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import provenance  # benchmarks/provenance.py (this script's own folder is on sys.path)
import torch

ROOT = Path(__file__).resolve().parents[1]
EPISODES, TURNS, SLEEP_S = 64, 3, 0.2


class Sleepy:
    """Every step sleeps ``sleep_s`` seconds, then answers ``k``; the episode is done after 3 turns."""

    def __init__(self, sleep_s: float = SLEEP_S):
        self.sleep_s, self.turn = sleep_s, 0

    def reset(self, row: dict) -> str:
        return row["prompt"]

    def step(self, action: str):
        from shifu import Step

        time.sleep(self.sleep_s)
        self.turn += 1
        return Step(observation="k", reward=0.0, done=self.turn >= TURNS)


def rollout_seconds(model_dir: Path, concurrency: int, sleep_s: float) -> tuple[float, int]:
    """Seconds of one rollout of the 64 episodes, and the turns they took."""
    from shifu.config.loader import from_dict
    from shifu.config.sources import EnvConfig
    from shifu.envs.base import Environment
    from shifu.generation.rollout import SamplingParams
    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.rollout.batch import PromptBatch
    from shifu.rollout.episodes import EpisodeLimits, Episodes
    from shifu.rollout.sources import Policy

    tok, model = load_tokenizer(model_dir), load_causal_lm(model_dir, dropout=False).eval()
    env_cfg = {
        "factory": "env_concurrency:Sleepy",
        "kwargs": {"sleep_s": sleep_s},
        "concurrency": concurrency,
    }
    source = Episodes(
        Environment(from_dict(EnvConfig, env_cfg)),
        EpisodeLimits(TURNS, 4, 32, tuple("abcdefghijkl")),
        chat=False,
    )
    rows = [{"prompt": "abc"[i % 3] + "def"[i % 3]} for i in range(EPISODES)]
    batch = PromptBatch(
        torch.zeros(EPISODES, 1, dtype=torch.long), torch.ones(EPISODES, 1, dtype=torch.long), rows
    )
    params = SamplingParams(4, temperature=1.0)
    t0 = time.perf_counter()
    made = source.collect(Policy(model, tok), batch, params, torch.Generator().manual_seed(0))
    return time.perf_counter() - t0, sum(made.counts["turns"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    provenance.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    from ppo_task import build_char_model

    out = ROOT / ".bench" / "env_concurrency"
    model_dir = build_char_model(out / "char")
    from shifu.config.sources import EnvConfig

    default = EnvConfig().concurrency
    rollout_seconds(model_dir, default, 0.0)  # warm-up: the first rollout pays for allocations and imports
    for concurrency in (1, default):
        fast, turns = rollout_seconds(model_dir, concurrency, 0.0)
        slow, turns_slow = rollout_seconds(model_dir, concurrency, SLEEP_S)
        share = slow - fast
        floor = TURNS * SLEEP_S
        print(
            f"env.concurrency={concurrency}: rollout {slow:.2f} s with 200 ms steps, {fast:.2f} s without; the "
            f"environment's share {share:.2f} s = {share / floor:.2f} x three steps' latency ({floor:.1f} s); "
            f"{turns_slow} turns"
        )
        provenance.record(
            args,
            "env_concurrency",
            params={
                "episodes": EPISODES,
                "turns": TURNS,
                "step_sleep_s": SLEEP_S,
                "concurrency": concurrency,
            },
            metrics={
                "rollout_s": round(slow, 3),
                "rollout_s_without_sleep": round(fast, 3),
                "env_share_s": round(share, 3),
                "env_share_over_three_steps": round(share / floor, 3),
                "turns": turns_slow,
            },
        )


if __name__ == "__main__":
    main()

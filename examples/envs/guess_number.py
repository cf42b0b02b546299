"""A number-guessing game with a final score for an episode the budget cut (``truncate()``), written only against
shifu's public interface (``from shifu import Step``).

The policy guesses a secret number; after a wrong guess the game answers ``higher:`` or ``lower:``. A right guess
ends the game (terminated, reward 1.0). When a budget ends it first (``generation.max_turns`` turns, or a token
budget), the episode is *truncated* and shifu calls ``truncate()``: the game scores the last guess by how close
it came, ``1 - |guess - secret| / (high - low)`` (0.0 without a guess), so that a game cut short still
tells a near miss from a wild one. A turn without a number gets ``a number:`` and no reward.

Prompt rows carry the range and the secret: ``{"prompt": "Guess my number from 1 to 9:", "low": 1, "high": 9,
"secret": 7}``. Write a file of them and train (from this folder)::

    cd examples/envs && python guess_number.py prompts.jsonl --rows 256
    shifu ppo --out runs/guess model.path=PATH/TO/POLICY data.train=prompts.jsonl critic.init=sft \\
        env.factory=guess_number:GuessNumber generation.max_turns=3 'generation.stop=[" "]'
"""

from __future__ import annotations

import argparse
import json
import random
import re

from shifu import Step


class GuessNumber:
    def reset(self, row: dict) -> str:
        self.low, self.high, self.secret = int(row["low"]), int(row["high"]), int(row["secret"])
        self.last: int | None = None  # the last number guessed
        return row["prompt"]

    def step(self, action: str) -> Step:
        number = re.search(r"\d+", action)
        if number is None:
            return Step(observation=" a number:")
        self.last = int(number[0])
        if self.last == self.secret:
            return Step(reward=1.0, done=True)
        return Step(observation=" higher:" if self.last < self.secret else " lower:")

    def truncate(self) -> float:
        """The budget ended the game before a right guess: the last guess's closeness to the secret."""
        if self.last is None:
            return 0.0
        return max(0.0, 1.0 - abs(self.last - self.secret) / (self.high - self.low))


def prompt_rows(n: int, low: int = 1, high: int = 9, seed: int = 0) -> list[dict]:
    """``n`` games over ``low..high``, their secrets drawn uniformly (seeded)."""
    rng = random.Random(seed)
    text = f"Guess my number from {low} to {high}:"
    return [{"prompt": text, "low": low, "high": high, "secret": rng.randint(low, high)} for _ in range(n)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a prompt file of number-guessing games.")
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for row in prompt_rows(args.rows, args.low, args.high, args.seed):
            f.write(json.dumps(row) + "\n")

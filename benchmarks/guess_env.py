"""A scripted game for the episode memory benchmark (``benchmarks/rss_timeline.py episodes``): guess a secret
number between 1 and 100 from "higher" / "lower" hints, in chat turns.

The first input is a system message with the rules (about 150 tokens with SmolLM2's chat template, as a
game's instructions are) and the row's prompt; each step reads the first number of the action. A right
guess ends the episode with reward 1; every other turn gets a hint and reward 0, so episodes run to the
turn or token budget unless the policy finds the number: long episodes, the case the benchmark measures.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from shifu import Step

RULES = (
    "You are playing Guess The Number. The game master has chosen a secret whole number between 1 and 100, "
    "both included, and will not tell you what it is. Each of your turns is one guess: write the number you "
    "guess, and nothing else, for example 50. After each guess the game master says whether the secret "
    "number is higher or lower than your guess, or that you found it. You win when you name the secret "
    "number; you have a limited number of turns, so use the hints: a guess in the middle of the range that "
    "is still possible halves it. Numbers outside 1 to 100 and answers without a number waste a turn. Think "
    "about which numbers the hints you were given still allow before you guess again."
)


class GuessNumber:
    """One game per episode: ``row["secret"]`` is the number."""

    def reset(self, row: dict) -> list[dict]:
        self.secret = int(row["secret"])
        return [{"role": "system", "content": RULES}, {"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> Step:
        found = re.search(r"-?\d+", action)
        if found is None:
            hint = "That is not a number. Guess a whole number between 1 and 100."
        elif int(found.group()) == self.secret:
            return Step(reward=1.0, done=True)
        else:
            hint = "Higher." if int(found.group()) < self.secret else "Lower."
        return Step(observation=[{"role": "user", "content": hint}])


def write_prompts(path: Path, n: int = 64, seed: int = 0) -> Path:
    """``n`` game rows (prompt and secret) as JSONL."""
    rng = random.Random(seed)
    prompt = "I have chosen my number. Make your first guess."
    rows = [{"prompt": prompt, "secret": rng.randint(1, 100)} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path

"""An OpenEnv environment (https://github.com/meta-pytorch/OpenEnv) written against OpenEnv's own server interface
and trained with shifu: guess a number from 1 to 20; the environment answers higher or lower.

The file is what an OpenEnv environment package holds (its action, observation and environment, and the server
app ``create_app`` builds); shifu runs the app as a local server process and plays one WebSocket connection per
episode through ``shifu.envs.openenv`` (docs/how-to/multi-turn.md, "OpenEnv environments"). The policy's turn is
the action's ``guess``; it reads the observation's ``text``; the reward is the environment's: 1.0 for the right
number, and at the environment's own limit of 5 guesses how close the last one came.

Needs the ``openenv`` extra (``pip install 'shifu-rlhf[openenv]'``). Prompt rows name the game's seed, its secret:
``{"prompt": "guess seed 3", "seed": 3}``. Write a file of them and train (from this folder)::

    cd examples/envs && python openenv_guess.py prompts.jsonl --rows 256
    shifu ppo --out runs/guess model.path=PATH/TO/POLICY data.train=prompts.jsonl advantage_estimator=grpo \\
        group_size=4 env.factory=shifu.envs.openenv:OpenEnvEnvironment 'env.kwargs={app: openenv_guess:app}' \\
        generation.max_turns=5 'generation.stop=["\\n"]'

An OpenEnv environment installed as a package is named by its package alone:
``env.factory=shifu.envs.openenv:echo_env``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

GUESSES = 5


class GuessAction(Action):
    guess: str = Field(..., description="the policy's turn: a number from 1 to 20")


class GuessObservation(Observation):
    text: str = Field(default="", description="the game's answer")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per connection: nothing shared

    def __init__(self):
        super().__init__()
        self._state, self.secret = State(step_count=0), 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = random.Random(seed).randint(1, 20)
        return GuessObservation(
            text=f"I am thinking of a number from 1 to 20. You have {GUESSES} guesses.\nGuess: "
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        found = re.search(r"\d+", action.guess)
        guess = int(found.group()) if found else None
        if guess == self.secret:
            return GuessObservation(text="Right!", reward=1.0, done=True)
        if self._state.step_count >= GUESSES:  # the game's own end: how close the last guess came
            close = 0.0 if guess is None else max(0.0, 1 - abs(guess - self.secret) / 20)
            return GuessObservation(text="Out of guesses.", reward=0.5 * close, done=True)
        hint = "not a number" if guess is None else ("higher" if guess < self.secret else "lower")
        return GuessObservation(text=f"{hint}.\nGuess: ", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


# the server shifu starts sets MAX_CONCURRENT_ENVS (env.kwargs.connections): a batch plays its episodes at once
app = create_app(
    GuessEnvironment,
    GuessAction,
    GuessObservation,
    env_name="guess",
    max_concurrent_envs=int(os.getenv("MAX_CONCURRENT_ENVS", "4")),
)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a prompt file of seeded guessing games.")
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for seed in range(args.first_seed, args.first_seed + args.rows):
            f.write(json.dumps({"prompt": f"guess seed {seed}", "seed": seed}) + "\n")

"""A single-player textarena game (https://github.com/LeonGuertler/TextArena) as a shifu environment: by default
``GuessTheNumber-v0`` (guess a number from 1 to 20 in 10 turns; the game answers higher or lower).

The policy reads the game's own first input, as textarena gives it to a language model (``[GAME] You are
Player 0. ...``), and after each turn the game's new messages (a hint, an invalid-move notice), without the
echo of the policy's own action, which is already in its context. The game rewards its end: 1.0 for the right
number; at its own turn limit, or after a second invalid move in a row, how close the last guess came. When a
shifu budget ends the episode first (``generation.max_turns``, a token budget), ``truncate()`` returns that same
end-of-game score, which the game computes for every state.

Needs ``pip install textarena`` (the ``examples`` extra). Prompt rows name the game's seed (its secret):
``{"prompt": "GuessTheNumber-v0 seed 3", "seed": 3}``; the row's ``prompt`` is what records and messages call
the episode, the policy reads the game's text. Write a file of them and train (from this folder)::

    cd examples/envs && python textarena_game.py prompts.jsonl --rows 256
    shifu ppo --out runs/game model.path=PATH/TO/POLICY data.train=prompts.jsonl advantage_estimator=grpo \\
        group_size=4 env.factory=textarena_game:TextArenaGame generation.max_turns=4 'generation.stop=["]"]'

``env.kwargs={game: Mastermind-v0}`` plays another single-player game; other keys are the game's own options
(``env.kwargs={max_turns: 5}``).
"""

from __future__ import annotations

import argparse
import json
import threading

import textarena as ta

from shifu import Step

_SEEDING = threading.Lock()  # a game's reset seeds Python's global random; shifu resets episodes on threads


class TextArenaGame:
    def __init__(self, game: str = "GuessTheNumber-v0", **options):
        self.game_id, self.options = game, options

    def reset(self, row: dict) -> str:
        self.game = ta.make(
            f"{self.game_id}-raw", **self.options
        )  # -raw: the game without textarena's wrappers
        with _SEEDING:
            self.game.reset(num_players=1, seed=int(row["seed"]))
        return self._read()

    def _read(self) -> str:
        """The game's messages since the last read, written as textarena's LLMObservationWrapper writes them."""
        _, messages = self.game.get_observation()
        names = self.game.state.role_mapping
        return "".join(
            f"\n[{names.get(sender, f'Player {sender}')}] {text}"
            for sender, text, kind in messages
            if kind != ta.ObservationType.PLAYER_ACTION
        )

    def step(self, action: str) -> Step:
        done, _ = self.game.step(action)
        if done:
            rewards, _ = self.game.close()
            return Step(reward=float(rewards[0]), done=True)
        return Step(observation=self._read() or None)

    def truncate(self) -> float | None:
        """The score the game gives at its own turn limit (None for a game that has no such score)."""
        score = getattr(self.game, "_get_percentage_completion", None)
        return None if score is None else float(score())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a prompt file of seeded textarena games.")
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--game", default="GuessTheNumber-v0")
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for seed in range(args.first_seed, args.first_seed + args.rows):
            f.write(json.dumps({"prompt": f"{args.game} seed {seed}", "seed": seed}) + "\n")

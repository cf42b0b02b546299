"""An environment written only against shifu's public interface (``from shifu import Step``; a class with
``reset(row)`` and ``step(action)``), as a third party would: ``ppo.env.factory=thirdparty_env:Echo``.

Task: the policy (a character model over ``a``..``l``) writes a short turn ending at a stop letter; the
environment echoes it back, and the episode's reward is the fraction of ``a`` in the policy's second turn.
"""

from __future__ import annotations

from shifu import Step


class Echo:
    def __init__(self, turns: int = 2):
        self.turns, self.taken, self.prompt = turns, 0, ""

    def reset(self, row: dict) -> str:
        self.prompt, self.taken = row["prompt"], 0
        return self.prompt

    def step(self, action: str) -> Step:
        self.taken += 1
        if self.taken < self.turns:
            return Step(observation="k" + action[:2], info={"tool_calls": 1})
        letters = [c for c in action if c.isalpha()]
        return Step(reward=letters.count("a") / max(1, len(letters)), done=True)

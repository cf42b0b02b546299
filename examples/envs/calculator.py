"""A calculator environment for the built-in task ``arith_tool``, written only against shifu's public interface
(``from shifu import Step``), as someone else would write it. RL learns to call it::

    cd examples/envs && shifu quickstart --task arith_tool --set ppo.env.factory=calculator:Calculator

It speaks the task's protocol without shifu's ToolEnv: the policy writes a call ``[347*29]`` and reads ``{10063}``,
then writes the answer (reward 1.0 when it is the product, else 0; ``{?}`` answers a call it cannot read). With
``--set 'ppo.env.kwargs={log: env.jsonl}'`` it appends one JSON line per reset and per step, so that the
episodes' rewards can be counted outside shifu, and whether an action ever contained the prompt or an earlier
observation (``leaked``) checked.
"""

from __future__ import annotations

import itertools
import json
import re

from shifu import Step

_IDS = itertools.count()


class Calculator:
    def __init__(self, log: str | None = None):
        self.log, self.id = log, next(_IDS)
        self.row: dict = {}
        self.observations: list[str] = []

    def _write(self, **record) -> None:
        if self.log:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"episode": self.id, **record}) + "\n")

    def reset(self, row: dict) -> str:
        self.row, self.observations = row, []
        self._write(event="reset", prompt=row["prompt"])
        return row["prompt"]

    def step(self, action: str) -> Step:
        leaked = self.row["prompt"] in action or any(o in action for o in self.observations)
        call = re.fullmatch(r"\s*\[(\d{1,6})\*(\d{1,6})\]\s*", action)
        if call is not None:
            obs = "{" + str(int(call[1]) * int(call[2])) + "}"
            self.observations.append(obs)
            self._write(event="call", action=action, observation=obs, leaked=leaked)
            return Step(observation=obs, info={"tool_calls": 1, "tool_errors": 0})
        if "[" in action:  # a call it cannot read
            self.observations.append("{?}")
            self._write(event="call", action=action, observation="{?}", leaked=leaked)
            return Step(observation="{?}", info={"tool_calls": 1, "tool_errors": 1})
        reward = float(action.strip() == self.row["answer"])
        self._write(event="answer", action=action, reward=reward, leaked=leaked)
        return Step(reward=reward, done=True)

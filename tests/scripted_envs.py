"""Scripted environments for the episode tests: behaviour set by keyword arguments (``ppo.env.kwargs``), not by
what the policy writes, so each test knows what must happen. Importable as ``scripted_envs:Scripted``."""

from __future__ import annotations

import math
import time

from shifu import Step

STEPS: list[str] = []  # every action any Scripted instance was given (tests clear it)


class Scripted:
    """Turn k (0-based) gets reward ``rewards[k]`` (0 past the list) and the observation ``observation`` (its
    turn number appended with ``numbered``); the episode is done after ``done_after`` turns (None: never).
    ``fault`` at turn ``fault_turn``: ``raise``, ``type`` (returns a dict), ``nan`` (reward NaN), ``sleep``
    (sleeps ``sleep_s``), ``long`` (an observation of 500 characters), ``reset`` (reset raises), ``truncate``
    (truncate raises) or ``messages`` (chat messages as the first input); ``truncate_reward``: what ``truncate()``
    returns for an episode a budget cut; ``report_tools``: whether ``Step.info`` counts a tool call; ``intro``: text the first input starts with; ``done_after_for``: prompt -> its own ``done_after``; only for the prompt ``fault_prompt`` (None: any) once more
    than ``fault_after`` steps were taken by any instance (:data:`STEPS`)."""

    def __init__(
        self,
        rewards=(),
        observation="kk",
        done_after=None,
        fault=None,
        fault_turn=0,
        sleep_s=2.0,
        numbered=False,
        fault_prompt=None,
        fault_after=0,
        truncate_reward=None,
        report_tools=True,
        intro="",
        done_after_for=None,
    ):
        self.rewards, self.observation, self.done_after = list(rewards), observation, done_after
        self.fault, self.fault_turn, self.sleep_s, self.numbered = fault, fault_turn, sleep_s, numbered
        self.fault_prompt, self.fault_after, self.turn, self.prompt = fault_prompt, fault_after, 0, ""
        self.truncate_reward, self.report_tools, self.intro = truncate_reward, report_tools, intro
        self.done_after_for = done_after_for or {}

    def _faulty(self) -> bool:
        return (self.fault_prompt is None or self.prompt == self.fault_prompt) and len(
            STEPS
        ) > self.fault_after

    def reset(self, row: dict):
        self.prompt, self.turn = row["prompt"], 0
        self.done_after = self.done_after_for.get(self.prompt, self.done_after)
        if self.fault == "reset" and self._faulty():
            raise RuntimeError("cannot start")
        if self.fault == "messages":
            return [{"role": "user", "content": row["prompt"]}]
        return self.intro + row["prompt"]

    def step(self, action: str):
        STEPS.append(action)
        k, self.turn = self.turn, self.turn + 1
        if self.fault is not None and k == self.fault_turn and self._faulty():
            if self.fault == "raise":
                raise ValueError("scripted failure")
            if self.fault == "type":
                return {"observation": "x"}
            if self.fault == "nan":
                return Step(reward=math.nan)
            if self.fault == "sleep":
                time.sleep(self.sleep_s)
            if self.fault == "long":
                return Step(observation="k" * 500)
        reward = self.rewards[k] if k < len(self.rewards) else 0.0
        done = self.done_after is not None and self.turn >= self.done_after
        obs = self.observation + (str(k) if self.numbered else "")
        info = {"tool_calls": 1} if self.report_tools else {}
        return Step(observation=None if done else obs, reward=reward, done=done, info=info)

    def truncate(self):
        """The final reward of an episode cut by a budget (``truncate_reward``; ``fault="truncate"`` raises)."""
        if self.fault == "truncate":
            raise RuntimeError("cannot score a cut game")
        return self.truncate_reward


class NoStep:
    """Not an environment: it has reset() but no step()."""

    def reset(self, row):
        return row["prompt"]


class AsyncEcho:
    """An environment written with ``async def``: it waits ``wait_s`` in each call (a remote service), then
    answers ``k``; done after ``turns`` turns, reward 1 on the last."""

    def __init__(self, wait_s: float = 0.05, turns: int = 2):
        self.wait_s, self.turns, self.taken = wait_s, turns, 0

    async def reset(self, row: dict) -> str:
        import asyncio

        await asyncio.sleep(self.wait_s)
        return row["prompt"]

    async def step(self, action: str):
        import asyncio

        await asyncio.sleep(self.wait_s)
        self.taken += 1
        done = self.taken >= self.turns
        return Step(observation=None if done else "k", reward=1.0 if done else 0.0, done=done)

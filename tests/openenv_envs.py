"""Two OpenEnv environments written against OpenEnv's own server interface (``openenv.core.env_server``), each
served by ``create_app`` as an OpenEnv environment package serves itself; tests/test_openenv.py runs them as
local server processes (``env.kwargs={app: openenv_envs:echo_app}``).

- ``EchoEnvironment`` (text): reset with a seed gives a word over ``a``..``l``; the first step's message comes
  back as ``k`` + its first two letters, the second is rewarded with the fraction of ``a`` in it and ends the
  episode (the task of tests/thirdparty_env.py, which a tiny character policy learns in a few iterations).
- ``SumEnvironment`` (MCP tools): reset with a seed gives two numbers to add; the tools ``add(a, b)`` and
  ``submit(answer)``; submitting the right sum is rewarded 1.0, any submission ends the episode.
"""

from __future__ import annotations

import os
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LETTERS = "abcdefghijkl"
SESSIONS = int(os.getenv("MAX_CONCURRENT_ENVS", "4"))


class EchoAction(Action):
    message: str = Field(..., description="the policy's turn")


class EchoObservation(Observation):
    text: str = Field(default="", description="what the policy reads next")
    turn: int = Field(default=0, description="steps taken")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        s = seed or 0
        return EchoObservation(text="".join(LETTERS[(s * 7 + j) % 12] for j in range(3 + s % 3)))

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        if self._state.step_count < 2:
            return EchoObservation(text="k" + action.message[:2], turn=1, reward=0.0)
        letters = [c for c in action.message if c.isalpha()]
        return EchoObservation(turn=2, reward=letters.count("a") / max(1, len(letters)), done=True)

    @property
    def state(self) -> State:
        return self._state


class SumEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("sum")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def submit(answer: str) -> str:
            """Submit the final answer."""
            return "submitted"

        super().__init__(mcp)
        self._state, self.numbers = State(step_count=0), (0, 0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.numbers = (seed or 0) * 3 + 4, (seed or 0) + 9
        return CallToolObservation(tool_name="", result=f"What is {self.numbers[0]} + {self.numbers[1]}?")

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            right = str(action.arguments.get("answer", "")).strip() == str(sum(self.numbers))
            obs.reward, obs.done = (1.0 if right else 0.0), True
        return obs

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError(f"SumEnvironment takes MCP tool actions, not {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state


echo_app = create_app(
    EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=SESSIONS
)
sum_app = create_app(
    SumEnvironment, CallToolAction, CallToolObservation, env_name="sum", max_concurrent_envs=SESSIONS
)

"""The rollout source of a verifiers taskset (``verifiers.taskset=ID``, :mod:`shifu.envs.verifiers`): its tasks are
the prompt rows, its harness plays each over the policy gateway, and the rewards of its tasks are the return.

It is the agent source (:class:`shifu.rollout.agent.AgentEpisodes`) with one agent, a call to the verifiers
worker: per row the gateway opens a session, the worker plays task ``verifiers_task`` of the row's split with the
session's key as its API key (verifiers' interception server relays the harness's calls to the gateway, streamed
or not), and the sum of the task's weighted rewards comes back as the episode's reward. So a verifiers episode is
recorded, cut to its budgets, rewarded and trained exactly as an agent's: token for token as the gateway sampled
it, the return on its last sampled token, GAE with the critic or any critic-free estimator over it. verifiers 0.4
scores a whole episode (its ``@vf.reward`` functions read the finished trace), so there is one reward per episode.

An episode the worker reports as failed (the harness's program or a reward function raised, a stage timed out) is
a fault: ``verifiers.on_error=raise`` stops the run naming the task, ``end_episode`` ends it with reward 0.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shifu.config.imports import typed_key
from shifu.envs import verifiers as V
from shifu.rollout.agent import AgentEpisodes
from shifu.rollout.episodes import EpisodeLimits
from shifu.rollout.sources import ENVIRONMENT, SourceDescription


class EpisodeFailed(Exception):
    """verifiers reported the episode as failed; the message is what it recorded."""


async def play(client: Any, row: dict, *, worker: V.Worker, model: str = "policy") -> float:
    """The agent of a verifiers source: the row's task played by the worker against ``client``'s base URL with
    its session key; the episode's reward (the sum of the task's weighted rewards)."""
    split, idx = row.get("verifiers_split"), row.get("verifiers_task")
    if split is None or idx is None:
        raise EpisodeFailed(
            f"the row has no verifiers task: with {typed_key('verifiers.taskset')} the prompts are the taskset's "
            "tasks (leave data.train empty)"
        )
    future = worker.submit(split, int(idx), str(client.base_url), client.api_key, model)
    result = await asyncio.wrap_future(future)
    if result.get("error"):
        raise EpisodeFailed(f"task {idx} ({split}): {result['error']}")
    return float(result["reward"])


class VerifiersEpisodes(AgentEpisodes):
    """Episodes of the verifiers taskset ``taskset`` (module docstring), played by ``worker``."""

    what, on_error_key = "verifiers taskset", "verifiers.on_error"
    # a bounded asynchronous run samples a taskset's episodes a share of a batch per call (the worker's episodes
    # are not cancelled with a stream's tasks)
    stream = None

    def __init__(self, worker: V.Worker, taskset: str, limits: EpisodeLimits, **kw: Any):
        super().__init__(play, taskset, limits, kwargs={"worker": worker}, **kw)
        self.worker = worker

    @classmethod
    def describe(cls, spec: str, available: bool = True) -> SourceDescription:
        """The description of the taskset ``spec``'s episodes: an environment ("environment verifiers:ID")
        whose return, the task's rewards, is its own measure of success."""
        counted = ("turns", "tool_calls", "observation_tokens")
        return SourceDescription(
            ENVIRONMENT, "environment reward", f"verifiers:{spec}", True, counted, available
        )

    @property
    def description(self) -> SourceDescription:
        return self.describe(self.spec)

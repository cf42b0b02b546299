"""An agent's episodes that run on their own, for a sampler that trains each as it finishes
(``async_schedule=bounded``): the counterpart of :class:`shifu.rollout.episode_stream.EpisodeStream` for the agent
source (:class:`shifu.rollout.agent.AgentEpisodes`).

One recording gateway serves the sampler's copy of the policy for the stream's whole life, and the agent's
episodes run as tasks of one event loop in a thread of their own, up to ``agent.concurrency`` at once: a prompt's
episodes are started when the sampler hands the prompt out, and its trajectories go out as soon as they have all
ended, whatever the other episodes are doing. A slow tool or a slow agent holds its own episode only.

New weights are copied into the policy's model in place, between two of the gateway's sampler calls
(:meth:`AgentStream.paused` holds the gateway's ``calling`` lock), and the gateway then records the new version
and empties its prefix cache. An episode may so be sampled by two versions, each token by the one that sampled it
(its recorded log-probs are that version's); a group goes out with the version it was started under, the oldest
that can have sampled any of its tokens. Which calls share a sampler call depends on when the agents send them:
a stream is not bit-reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Hashable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from shifu.generation.rollout import SamplingParams
from shifu.rollout.batch import Trajectories
from shifu.rollout.sources import Policy


class AgentStream:
    """The episodes of ``source`` (an :class:`~shifu.rollout.agent.AgentEpisodes`) on a gateway of their own,
    sampled from ``policy`` as ``params`` says (the module docstring). The interface of
    :class:`shifu.rollout.episode_stream.EpisodeStream`: :meth:`add`, :meth:`advance`, :meth:`paused`,
    :meth:`new_weights`, :meth:`close`."""

    def __init__(
        self, source: Any, policy: Policy, params: SamplingParams, generator: torch.Generator | None
    ):
        self.source, self.policy, self.params = source, policy, params
        self.gateway = source._gateway(policy, params, generator).start()
        self.loop = asyncio.new_event_loop()
        name = f"{threading.current_thread().name} agent stream"  # (the sampler's name, first)
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self.slots = asyncio.run_coroutine_threadsafe(self._slots(), self.loop).result()
        self.groups: dict[Hashable, tuple[list[Future], int]] = {}  # key -> (episodes, version when added)
        self.started = 0  # sessions started: each episode's row id

    async def _slots(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.source.concurrency)  # (made on the stream's loop)

    def add(self, key: Hashable, rows: list[dict], version: int) -> None:
        """A group of episodes, one per row, started under ``key`` (sampled by ``version`` or a newer one)."""
        futures = []
        for row in rows:
            futures.append(asyncio.run_coroutine_threadsafe(self._episode(self.started, row), self.loop))
            self.started += 1
        self.groups[key] = (futures, version)

    async def _episode(self, i: int, row: dict):
        async with self.slots:
            return await self.source._episode(self.gateway, i, row)

    def __len__(self) -> int:
        """The groups not yet out."""
        return len(self.groups)

    def advance(self, version: int, wait_s: float) -> list[tuple[Hashable, int, Trajectories]]:
        """The groups whose episodes have all ended: ``(key, version, trajectories)``; waits up to ``wait_s``
        seconds for an episode to end when none has (``version``: unused, the gateway records its own)."""
        futures = [f for fs, _ in self.groups.values() for f in fs]
        if futures and not any(all(f.done() for f in fs) for fs, _ in self.groups.values()):
            wait(futures, timeout=wait_s, return_when=FIRST_COMPLETED)
        out = []
        for key, (fs, added) in list(self.groups.items()):
            if all(f.done() for f in fs):
                del self.groups[key]
                episodes = [f.result() for f in fs]
                out.append((key, added, self.source._finished(episodes, self.policy, self.params)))
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No sampler call of the gateway runs meanwhile (one under way is waited for): the policy's weights may
        be changed in place."""
        with self.gateway.calling:
            yield

    def new_weights(self, version: int) -> None:
        """The policy's model holds ``version``'s weights (changed in place while :meth:`paused`)."""
        with self.gateway.calling:
            self.gateway.set_policy(self.policy.model, version)

    def close(self) -> None:
        """The episodes under way cancelled, the loop and the gateway stopped."""

        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            self.gateway.close()
            self.groups.clear()

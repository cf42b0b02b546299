"""Episodes with an environment that advance on their own, for a bounded asynchronous run
(``async_schedule=bounded``): :class:`EpisodeStream`, the counterpart of
:class:`shifu.rollout.agent_stream.AgentStream` for the episode source :class:`shifu.rollout.episodes.Episodes`,
whose turns, budgets, ends, faults and rewards it shares."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from shifu.generation.kv_cache import PrefixCache
from shifu.generation.rollout import Sample, SamplingParams
from shifu.models.positions import position_limit
from shifu.rollout.batch import Trajectories
from shifu.rollout.sources import Policy


class EpisodeStream:
    """Episodes of ``source`` (a :class:`~shifu.rollout.episodes.Episodes`) that advance on their own, for a
    sampler that trains each as it finishes (``async_schedule=bounded``). A round (:meth:`advance`) applies
    the environment steps that have answered, then samples one turn of every episode whose environment has
    answered, in one sampler call (or one per :meth:`~shifu.rollout.episodes.Episodes._batches` group), and
    hands those turns' actions to the environment without waiting for them: a slow step holds its own episode
    only, and the others go on to their next turns. Turns, budgets, ends, faults and rewards are as in
    :meth:`~shifu.rollout.episodes.Episodes.collect`; which episodes share a sampler call depends on when
    their environments answer, so a stream is not bit-reproducible.

    Episodes are added in groups (a prompt's ``group_size`` rows) under a key; a group is out when all its
    episodes have ended, with the oldest policy version that sampled any of its turns (each token's log-probs
    are those of the version that sampled it). :meth:`new_weights`: the policy's model was given new weights
    (the cached keys and values are of the old ones)."""

    def __init__(self, source, policy: Policy, params: SamplingParams, generator: torch.Generator | None):
        self.source, self.policy, self.params, self.generator = source, policy, params, generator
        self.positions = position_limit(policy.model)
        self.groups: dict[Hashable, tuple[list, int]] = {}  # key -> (episodes, version when added)
        self.stepping: dict[Future, tuple[Any, str, int]] = {}  # a step under way -> (episode, action, turn)
        self.pool = ThreadPoolExecutor(
            source.env.pool.size, thread_name_prefix=f"shifu-stream {source.env.name}"
        )
        self.new_weights()

    def paused(self) -> contextlib.AbstractContextManager:
        """While held, the policy's weights may change in place (nothing samples between two rounds)."""
        return contextlib.nullcontext()

    def new_weights(self, version: int | None = None) -> None:
        """The policy's model was given new weights: the prefix cache (keys and values of the old) emptied."""
        budget = int(self.source.limits.prefix_cache_mb * 2**20)
        self.source._prefix = PrefixCache(budget) if budget > 0 else None

    def add(self, key: Hashable, rows: list[dict], version: int) -> None:
        """A group of episodes, one per row, started (their environments reset) under ``key``."""
        self.groups[key] = (self.source._start(self.policy.tokenizer, rows), version)

    def __len__(self) -> int:
        """The groups not yet out."""
        return len(self.groups)

    @torch.no_grad()
    def advance(self, version: int, wait_s: float) -> list[tuple[Hashable, int, Trajectories]]:
        """One round, sampled by policy ``version``; waits up to ``wait_s`` seconds for an environment when no
        episode can take a turn. Returns the groups that ended: ``(key, version, trajectories)``."""
        ready = self._ready()
        if not ready and self.stepping:
            self._arrived(wait_s)
            ready = self._ready()
        for group in self.source._batches(ready, self.positions):
            for ep in group:
                ep.version = version if ep.version is None else ep.version
            self._sampled(
                group, self.source._sample(self.policy, group, self.positions, self.params, self.generator)
            )
        self._arrived(0)
        return self._out()

    def close(self) -> None:
        """No more rounds: the environment steps under way finish in their threads, unread."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.source._prefix = None

    def _waiting(self) -> set[int]:
        """The episodes (ids) whose environment step is under way."""
        return {id(ep) for ep, _, _ in self.stepping.values()}

    def _ready(self) -> list:
        waiting = self._waiting()
        return [ep for eps, _ in self.groups.values() for ep in eps if not ep.over and id(ep) not in waiting]

    def _sampled(self, group: list, out: Sample) -> None:
        """Each episode's sampled turn appended, and its action handed to the environment (not waited for)."""
        tok, env = self.policy.tokenizer, self.source.env
        for j, ep in enumerate(group):
            turn = ep.counts["turns"]
            action = self.source._append_row(tok, ep, out, j)
            if action is None:
                continue
            self.stepping[self.pool.submit(env.step, [(ep.env, action, ep.row, turn)])] = (ep, action, turn)

    def _arrived(self, wait_s: float) -> None:
        """The environment steps that have answered (within ``wait_s`` seconds, at least one when any is under
        way and ``wait_s > 0``), applied in the order their turns were handed out."""
        if not self.stepping:
            return
        done, _ = wait(list(self.stepping), timeout=wait_s, return_when=FIRST_COMPLETED)
        for fut in [f for f in self.stepping if f in done]:
            ep, action, turn = self.stepping.pop(fut)
            (step,) = fut.result()
            self.source._observe(self.policy.tokenizer, ep, turn, action, step)

    def _out(self) -> list[tuple[Hashable, int, Trajectories]]:
        waiting = self._waiting()
        out = []
        for key, (eps, added) in list(self.groups.items()):
            if all(ep.over and id(ep) not in waiting for ep in eps):
                del self.groups[key]
                self.source._truncated(eps)
                versions = [ep.version for ep in eps if ep.version is not None]
                out.append((key, min(versions, default=added), self.source._trajectories(eps, self.policy)))
        return out

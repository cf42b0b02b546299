"""The episode source: multi-turn episodes with an environment, token in and token out.

An episode's trajectory is the ids of its first input (``env.reset(row)``, :mod:`shifu.rollout.turns`), then per
turn the ids the policy sampled and the ids of the environment's observation, appended as they were made: every
turn's sampler input is a prefix of the final row, and nothing is ever re-tokenised. All episodes of a batch
advance together, one sampler call per turn over the episodes still running (left-padded contexts, positions from
the mask, as the trainer's forward sees the final row); the environment calls of a turn run at once
(:class:`shifu.envs.base.Environment`), their results applied in episode order.

A turn ends at EOS or at the first token whose decoded turn text contains a ``stop`` string (the token is kept).
The action given to ``env.step`` is that turn's tokens decoded with special tokens skipped. An episode ends:

- when a step says ``done``;
- truncated, when ``max_turns`` turns have been taken without ``done``, when a turn reaches its token budget
  (``max_new_tokens``, or what is left of ``max_total_tokens``, or of the model's positions) before EOS or a stop
  string (the cut turn is not given to the environment), or when an observation does not fit in what is left of
  ``max_total_tokens``; an environment with a ``truncate()`` method is then asked for a final reward;
- failed, on an environment fault with ``env.on_error=end_episode``: every reward of the episode is 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from shifu.config.imports import typed_key
from shifu.envs.base import EnvFault, Environment
from shifu.errors import ShifuError
from shifu.generation.kv_cache import CallPrefixes, PrefixCache
from shifu.generation.rollout import Sample, SamplingParams
from shifu.generation.stops import RowStops
from shifu.models.padding import pad_left
from shifu.models.positions import position_limit
from shifu.rollout.batch import COUNTS, Part, PromptBatch, Trajectories, Trajectory, episode_metrics, stack
from shifu.rollout.sources import ENVIRONMENT, Policy, SourceDescription
from shifu.rollout.turns import turn_encoder


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run (the sampler's settings, ``generation.*``): turns, tokens per turn, sampled
    plus observation tokens after the first input, and the strings that end a turn besides EOS; the MB of keys
    and values kept between turns (:mod:`shifu.generation.kv_cache`; 0: off)."""

    max_turns: int
    max_new_tokens: int
    max_total_tokens: int
    stop: tuple[str, ...] = ()
    prefix_cache_mb: float = 256


class _Episode:
    def __init__(self, row: dict):
        self.row, self.env, self.fmt = row, None, None
        self.prompt: list[int] = []
        self.parts: list[Part] = []
        self.length = 0  # ids after the first input
        self.rewards: dict[int, float] = {}  # part index of a turn -> its reward
        self.counts = dict.fromkeys(COUNTS, 0)
        self.spans: list[tuple[str, str]] = []
        self.over = self.truncated = self.failed = False
        self.version: int | None = None  # (a stream's) the policy version that sampled its first turn

    def add(self, part: Part) -> None:
        self.parts.append(part)
        self.length += len(part.ids)

    def end(self, truncated: bool = False, failed: bool = False) -> None:
        self.over, self.truncated, self.failed = True, truncated, failed
        if failed:
            self.rewards = {}


class Episodes:
    """The rollout source of ``env.factory``: one episode per row, a fresh environment instance each.

    ``chat``: render first inputs and observations through the chat template when the tokenizer has one
    (``data.chat_template``). ``max_prompt_len``: a first input longer than this is an error naming the row.
    Each episode's keys and values are kept between its turns for one rollout, up to ``limits.prefix_cache_mb``
    (:mod:`shifu.generation.kv_cache`: a turn prefills only what its cached context leaves)."""

    gold = True  # the environment's own count of success

    def __init__(
        self, env: Environment, limits: EpisodeLimits, chat: bool = True, max_prompt_len: int | None = None
    ):
        self.env, self.limits, self.chat, self.max_prompt_len = env, limits, chat, max_prompt_len
        self._prefix: PrefixCache | None = None  # this rollout's (collect)

    @classmethod
    def describe(cls, factory: str) -> SourceDescription:
        """The description of episodes with the environment ``factory`` (tool calls and errors counted where
        the environment's ``Step.info`` reports them)."""
        counted = ("turns", "tool_calls", "tool_errors", "observation_tokens")
        return SourceDescription(ENVIRONMENT, "environment reward", factory, cls.gold, counted)

    @property
    def description(self) -> SourceDescription:
        return self.describe(self.env.name)

    @property
    def name(self) -> str:
        return self.description.name

    @torch.no_grad()
    def collect(
        self, policy: Policy, batch: PromptBatch, params: SamplingParams, generator: torch.Generator | None
    ) -> Trajectories:
        """One episode per row of ``batch`` (its prompt ids are not read: the environment gives the first
        input); ``params``: how turns are sampled (its ``max_new_tokens`` is replaced by each turn's budget)."""
        eps = self._start(policy.tokenizer, batch.rows)
        budget = int(self.limits.prefix_cache_mb * 2**20)
        self._prefix = PrefixCache(budget) if budget > 0 else None
        model, L = policy.model, self.limits
        positions = position_limit(model)
        for turn in range(L.max_turns):
            groups = self._batches([ep for ep in eps if not ep.over], positions)
            for group in policy.in_step(groups):
                out = self._sample(policy, group, positions, params, generator)
                if group:
                    self._turn(policy.tokenizer, group, turn, out)
        for ep in eps:
            if not ep.over:  # still going after max_turns
                ep.end(truncated=True)
        self._truncated(eps)
        self._prefix = None  # (the next rollout samples from new weights)
        return _trajectories(eps, policy)

    def stream(
        self, policy: Policy, params: SamplingParams, generator: torch.Generator | None
    ) -> EpisodeStream:
        """Episodes that advance on their own, each finished as its last step answers
        (:class:`EpisodeStream`); ``policy``'s model may be given new weights between two of its rounds."""
        return EpisodeStream(self, policy, params, generator)

    def _truncated(self, eps: list[_Episode]) -> None:
        """The final rewards of the episodes a budget cut (``truncate()``, at once), on their last sampled token."""
        cut = [ep for ep in eps if ep.truncated and ep.env is not None and ep.parts]
        calls = [(ep.env, ep.row, ep.counts["turns"] - 1) for ep in cut]
        for ep, final in zip(cut, self.env.truncate(calls)):
            if isinstance(final, EnvFault):
                self.env.fault(final)
                ep.end(failed=True)
                continue
            last = max(k for k, part in enumerate(ep.parts) if part.sampled)
            if final:
                ep.rewards[last] = ep.rewards.get(last, 0.0) + final

    def _start(self, tok, rows: list[dict]) -> list[_Episode]:
        """A started episode per row: its environment instance reset, its first input's ids."""
        eps = [_Episode(row) for row in rows]
        for ep, started in zip(eps, self.env.start(rows)):
            if isinstance(started, EnvFault):
                self.env.fault(started)
                ep.end(failed=True)
                ep.prompt = [tok.eos_token_id]  # (a placeholder: the row has no turn and leaves the rollout)
                continue
            ep.env, first = started
            ep.fmt = turn_encoder(tok, self.chat, ep.env)
            ep.prompt = self._located(ep, None, ep.fmt.first, first)
            if not ep.prompt or (self.max_prompt_len and len(ep.prompt) > self.max_prompt_len):
                raise ShifuError(
                    f"{self.env.where(ep.row, None)}: the first input is {len(ep.prompt)} tokens; it must be "
                    f"1 to {typed_key('data.max_prompt_len')}={self.max_prompt_len}"
                )
            ep.spans.append(("input", tok.decode(ep.prompt)))
        return eps

    def _budget(self, ep: _Episode, positions: int | None) -> int:
        """The tokens ``ep`` may sample this turn: the turn's budget, what is left of the episode's, and of the
        model's positions (:func:`shifu.models.positions.position_limit`), if it states them."""
        L = self.limits
        left = min(L.max_new_tokens, L.max_total_tokens - ep.length)
        return left if positions is None else min(left, positions - len(ep.prompt) - ep.length)

    def _batches(self, running: list[_Episode], positions: int | None) -> list[list[_Episode]]:
        """The running episodes as sampler batches: all of them, unless the longest context plus the largest
        turn budget passes a model's learned positions; then by context length, longest first, each batch as
        large as its longest context allows. An episode with no position left ends here, truncated."""
        for ep in running:
            if self._budget(ep, positions) < 1:
                ep.end(truncated=True)
        running = [ep for ep in running if not ep.over]
        if positions is None or not running:
            return [running] if running else []

        def size(ep: _Episode) -> int:
            return len(ep.prompt) + ep.length

        if max(map(size, running)) + max(self._budget(ep, positions) for ep in running) <= positions:
            return [running]
        batches: list[list[_Episode]] = []
        for ep in sorted(running, key=size, reverse=True):
            if batches and size(batches[-1][0]) + max(self._budget(ep, positions), 0) <= positions:
                batches[-1].append(ep)
            else:
                batches.append([ep])
        return batches

    def _sample(self, policy: Policy, group: list[_Episode], positions, params, generator) -> Sample:
        """One sampler call over ``group``'s contexts (an empty group, under torchrun, steps a stand-in row so
        that every rank's forwards stay in step)."""
        tok = policy.tokenizer
        contexts = [ep.prompt + [p for part in ep.parts for p in part.ids] for ep in group] or [
            [tok.eos_token_id]
        ]
        limits = [self._budget(ep, positions) for ep in group] or [1]
        b = pad_left(contexts, tok.pad_token_id)
        params = dataclasses.replace(params, max_new_tokens=policy.largest(max(limits)))
        stop = RowStops(tok, limits, [self.limits.stop] * len(limits))
        device = next(policy.model.parameters()).device
        return policy.sample(
            b["input_ids"].to(device),
            b["attention_mask"].to(device),
            params,
            generator,
            stop,
            None if self._prefix is None else CallPrefixes(self._prefix, contexts),
        )

    def _turn(self, tok, group: list[_Episode], turn: int, out: Sample) -> None:
        """Append each episode's sampled turn; step the environments whose turn ended (at once), then append
        their observations in episode order."""
        stepping = []
        for j, ep in enumerate(group):
            action = self._append_turn(tok, ep, out, j)
            if action is not None:
                stepping.append((ep, action))
        calls = [(ep.env, action, ep.row, turn) for ep, action in stepping]
        for (ep, action), step in zip(stepping, self.env.step(calls)):
            self._observe(tok, ep, turn, action, step)

    def _append_turn(self, tok, ep: _Episode, out: Sample, j: int) -> str | None:
        """Row ``j`` of the turn's sample appended to ``ep``: the action's text when the turn ended (at EOS or a
        stop string), for the environment; None when a token budget cut it (the episode ends, truncated)."""
        mask = out.response_mask[j]
        ids = out.response_ids[j][mask].tolist()
        stats = [
            s[j][mask].tolist() if s is not None else [0.0] * len(ids)
            for s in (out.log_probs, out.entropy, out.values)
        ]
        ep.add(Part(ids, True, list(zip(*stats))))
        ep.counts["turns"] += 1
        action = tok.decode(ids, skip_special_tokens=True)
        ep.spans.append(("policy", tok.decode(ids)))
        if ids[-1] == tok.eos_token_id or any(s in action for s in self.limits.stop):
            return action
        ep.end(truncated=True)  # cut by a token budget: the turn never ends
        return None

    def _observe(self, tok, ep: _Episode, turn: int, action: str, step) -> None:
        """``step``'s reward on the turn just taken, its counts, then its observation appended (or the end); a
        faulted step (:class:`EnvFault`) is reported and ends the episode, failed."""
        if isinstance(step, EnvFault):
            self.env.fault(step)
            ep.end(failed=True)
            return
        ep.rewards[len(ep.parts) - 1] = float(step.reward)
        for k in ("tool_calls", "tool_errors"):
            value = step.info.get(k, 0)
            ep.counts[k] += int(value) if isinstance(value, (int, float)) else 0
        ep.counts["tool_reports"] += "tool_calls" in step.info
        if step.done:
            ep.end()
            return
        if turn + 1 == self.limits.max_turns:
            ep.end(truncated=True)
            return
        eos = ep.parts[-1].ids[-1] == tok.eos_token_id
        obs = self._located(ep, turn, ep.fmt.observation, action, eos, step.observation)
        budget = self.limits.max_total_tokens
        if len(obs) > budget:
            self.env.fault(
                EnvFault(
                    f"{self.env.where(ep.row, turn)}: the observation is {len(obs)} tokens, over "
                    f"{typed_key('generation.max_total_tokens')}={budget} on its own"
                )
            )
            ep.end(failed=True)
            return
        if ep.length + len(obs) >= budget:  # no room left for another turn
            ep.end(truncated=True)
            return
        ep.add(Part(obs, False))
        ep.counts["observation_tokens"] += len(obs)
        ep.spans.append(("observation", tok.decode(obs)))

    def _located(self, ep: _Episode, turn: int | None, fn, *args: Any):
        """``fn(*args)`` with a template or format error located at the environment, row and turn."""
        try:
            return fn(*args)
        except ShifuError as e:
            raise type(e)(f"{self.env.where(ep.row, turn)}: {e}") from None


class EpisodeStream:
    """Episodes of :class:`Episodes` that advance on their own, for a sampler that trains each as it finishes
    (``async_schedule=bounded``). A round (:meth:`advance`) applies the environment steps that have answered, then
    samples one turn of every episode whose environment has answered, in one sampler call (or one per
    :meth:`Episodes._batches` group), and hands those turns' actions to the environment without waiting for
    them: a slow step holds its own episode only, and the others go on to their next turns. Turns, budgets, ends,
    faults and rewards are as in :meth:`Episodes.collect`; which episodes share a sampler call depends on when
    their environments answer, so a stream is not bit-reproducible.

    Episodes are added in groups (a prompt's ``group_size`` rows) under a key; a group is out when all its
    episodes have ended, with the oldest policy version that sampled any of its turns (each token's log-probs
    are those of the version that sampled it). :meth:`new_weights`: the policy's model was given new weights
    (the cached keys and values are of the old ones)."""

    def __init__(
        self, source: Episodes, policy: Policy, params: SamplingParams, generator: torch.Generator | None
    ):
        self.source, self.policy, self.params, self.generator = source, policy, params, generator
        self.positions = position_limit(policy.model)
        self.groups: dict[Hashable, tuple[list[_Episode], int]] = {}  # key -> (episodes, version when added)
        self.stepping: dict[
            Future, tuple[_Episode, str, int]
        ] = {}  # an environment step -> (episode, action, turn)
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

    def _ready(self) -> list[_Episode]:
        waiting = self._waiting()
        return [ep for eps, _ in self.groups.values() for ep in eps if not ep.over and id(ep) not in waiting]

    def _sampled(self, group: list[_Episode], out: Sample) -> None:
        """Each episode's sampled turn appended, and its action handed to the environment (not waited for)."""
        tok, env = self.policy.tokenizer, self.source.env
        for j, ep in enumerate(group):
            turn = ep.counts["turns"]
            action = self.source._append_turn(tok, ep, out, j)
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
                out.append((key, min(versions, default=added), _trajectories(eps, self.policy)))
        return out


def _trajectories(eps: list[_Episode], policy: Policy) -> Trajectories:
    """The episodes as one batch (:func:`shifu.rollout.batch.stack`), each turn's reward on its last token."""
    trajs = [
        Trajectory(
            ep.row,
            ep.prompt,
            [
                dataclasses.replace(p, reward=ep.rewards.get(k, 0.0)) if p.sampled else p
                for k, p in enumerate(ep.parts)
            ],
            ep.truncated,
            ep.failed,
            ep.counts,
            ep.spans,
        )
        for ep in eps
    ]
    t = stack(trajs, policy.tokenizer.pad_token_id, policy.with_log_probs, policy.value_head is not None)
    return dataclasses.replace(t, metrics=episode_metrics(t.counts, t.truncated, t.failed, t.returns, "env/"))

"""The episode source: multi-turn episodes with an environment, token in and token out.

An episode's trajectory is the ids of its first input (``env.reset(row)``, :mod:`shifu.rollout.turns`), then per
turn the ids the policy sampled and the ids of the environment's observation, appended as they were made: every
turn's sampler input is a prefix of the final row, and nothing is ever re-tokenised.

**One running decode** (``generation.kv_budget_mb`` > 0, the default). A rollout's turns decode in one
:class:`shifu.generation.continuous.Running` loop: every episode's first turn is admitted, and after each decode
step the turns that ended there are appended, their environments stepped (at once,
:class:`shifu.envs.base.Environment`, results applied in episode order), and the next turns of the episodes that
go on admitted before the next step, their contexts prefilled through the rollout's prefix cache. An episode no
longer waits for the longest turn of the batch, and the decoder forwards only the rows still sampling. Each
turn's keys and values (its context and whole budget) are reserved in a pool of ``kv_budget_mb``; a turn that
does not fit waits, first come first admitted, until rows end. What joins when depends only on the tokens
sampled and the environments' answers, never on timing, so a seeded rollout repeats bit for bit; the rows
draw from the rollout's generator, one number per held row per step. The log-probs are those of a call of the
row's own up to the float rounding of forwards over other rows (~1e-6; the trainer's recomputation within
1e-5). Under torchrun (ranks step in step), with a shared-trunk critic (values read off the decode) or a decoder
that does not keep its own cache (HF forwards), and with ``kv_budget_mb=0``, turns run in lockstep instead.

**Lockstep.** All episodes advance together, one sampler call per turn over the episodes still running
(left-padded contexts, positions from the mask, as the trainer's forward sees the final row), each call
decoding until its longest turn ends.

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

import collections
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shifu.config.imports import typed_key
from shifu.envs.base import EnvFault, Environment
from shifu.errors import ShifuError
from shifu.generation.continuous import Row, Running
from shifu.generation.decode import keeps_kv
from shifu.generation.kv_cache import CallPrefixes, PrefixCache
from shifu.generation.rollout import Sample, SamplingParams, sample
from shifu.generation.stops import RowStops, one_row
from shifu.models.padding import pad_left
from shifu.models.positions import position_limit
from shifu.rollout.batch import COUNTS, Part, PromptBatch, Trajectories, Trajectory, episode_metrics, stack
from shifu.rollout.sources import ENVIRONMENT, Policy, SourceDescription
from shifu.rollout.turns import turn_encoder

# decode steps between a turn's end and the step before which its environment's answer is applied (module
# docstring): the steps a slow environment's call runs beside the decode
STEP_LAG = 2


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run (the sampler's settings, ``generation.*``): turns, tokens per turn, sampled
    plus observation tokens after the first input, and the strings that end a turn besides EOS; the MB of keys
    and values kept between turns (:mod:`shifu.generation.kv_cache`; 0: off); the MB of keys and values of the
    turns decoding at once (the admitting loop's pool, module docstring; 0: turns in lockstep)."""

    max_turns: int
    max_new_tokens: int
    max_total_tokens: int
    stop: tuple[str, ...] = ()
    prefix_cache_mb: float = 256
    kv_budget_mb: float = 1024


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
    step_lag = STEP_LAG  # (module docstring)

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
        if self._admits(policy):
            self._admitting(policy, eps, params, generator)
        else:
            self._lockstep(policy, eps, params, generator)
        for ep in eps:
            if not ep.over:  # still going after max_turns
                ep.end(truncated=True)
        self._truncated(eps)
        self._prefix = None  # (the next rollout samples from new weights)
        return self._trajectories(eps, policy)

    @staticmethod
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
        return dataclasses.replace(
            t, metrics=episode_metrics(t.counts, t.truncated, t.failed, t.returns, "env/")
        )

    def _admits(self, policy: Policy) -> bool:
        """Whether this rollout's turns decode in one admitting loop (module docstring): a pool budget, one
        process (not ranks stepping in step), no shared-trunk values to read, shifu's own decoder and sampler."""
        return (
            self.limits.kv_budget_mb > 0
            and "all_done" not in policy.sample_kwargs
            and policy.value_head is None
            and policy.sampler is sample
            and keeps_kv(policy.model)
        )

    def _lockstep(self, policy: Policy, eps: list[_Episode], params, generator) -> None:
        """Every running episode's turn in one sampler call (or one per :meth:`_batches` group), turn by turn."""
        positions = position_limit(policy.model)
        for turn in range(self.limits.max_turns):
            groups = self._batches([ep for ep in eps if not ep.over], positions)
            for group in policy.in_step(groups):
                out = self._sample(policy, group, positions, params, generator)
                if group:
                    self._turn(policy.tokenizer, group, turn, out)

    def _admitting(self, policy: Policy, eps: list[_Episode], params, generator) -> None:
        """The episodes' turns in one :class:`~shifu.generation.continuous.Running` loop (module docstring): a
        turn joins as soon as its episode's environment has answered and its keys and values fit in the pool."""
        tok, positions = policy.tokenizer, position_limit(policy.model)
        order = {id(ep): k for k, ep in enumerate(eps)}
        ended: list[Row] = []
        budget = int(self.limits.kv_budget_mb * 2**20)
        try:
            loop = Running(
                policy.model,
                params,
                tok.eos_token_id,
                tok.pad_token_id,
                ended.append,
                generator,
                self._prefix,
                len(eps),
                budget,
            )
        except ValueError as e:  # (the pool holds no block)
            key = typed_key("generation.kv_budget_mb")
            raise ShifuError(f"{key}={self.limits.kv_budget_mb:g}: {e} (or 0: turns in lockstep)") from None
        waiting = collections.deque(ep for ep in eps if not ep.over)
        lag, steps = self.step_lag, 0
        # the environment calls under way: (the step their answers are due at, the answers, what was stepped)
        pending: collections.deque[tuple[int, Any, list]] = collections.deque()
        with ThreadPoolExecutor(lag + 1, thread_name_prefix=f"shifu-episodes {self.env.name}") as stepper:
            while waiting or loop.rows or pending:
                # the environments' answers due by this step (or the oldest, when nothing else can run)
                while pending and (pending[0][0] <= steps or not (loop.rows or waiting)):
                    _, answers, stepping = pending.popleft()
                    waiting.extend(self._observed(tok, stepping, answers.result() if lag else answers))
                rows = []
                while waiting:
                    row = self._turn_row(tok, waiting[0], positions)
                    if row is not None and not loop.room(*(r.need for r in rows), row.need):
                        if loop.rows or rows:
                            break  # it waits for rows to end (first come, first admitted)
                        raise ShifuError(
                            f"{self.env.where(waiting[0].row, waiting[0].counts['turns'])}: a turn of "
                            f"{len(row.prompt)} context tokens and a budget of {row.budget} does not fit in "
                            f"{typed_key('generation.kv_budget_mb')}={self.limits.kv_budget_mb:g}: raise it"
                        )
                    waiting.popleft()
                    if row is not None:
                        rows.append(row)
                if rows:
                    loop.admit(rows)
                if not loop.rows:
                    continue
                loop.step()
                steps += 1
                if not ended:
                    continue
                stepping = self._ended_turns(policy, sorted(ended, key=lambda r: order[id(r.tag)]))
                ended.clear()
                if stepping:
                    calls = _calls(stepping)
                    answers = stepper.submit(self.env.step, calls) if lag else self.env.step(calls)
                    pending.append((steps + lag, answers, stepping))

    def _turn_row(self, tok, ep: _Episode, positions: int | None) -> Row | None:
        """``ep``'s next turn as a row of the admitting loop; None when no token is left to it (it ends here,
        truncated)."""
        budget = self._budget(ep, positions)
        if budget < 1:
            ep.end(truncated=True)
            return None
        context = ep.prompt + [p for part in ep.parts for p in part.ids]
        return Row(context, budget, stop=one_row(RowStops(tok, [budget], [self.limits.stop])), tag=ep)

    def _ended_turns(self, policy: Policy, rows: list[Row]) -> list[tuple[_Episode, str, int]]:
        """The turns of ``rows`` (ended at one step, in episode order) appended: ``(episode, action, turn)`` of
        those whose environment is to be stepped."""
        tok, stepping = policy.tokenizer, []
        for r in rows:
            ep, turn = r.tag, r.tag.counts["turns"]
            zeros = [0.0] * len(r.ids)
            stats = [r.log_probs, r.entropy, zeros] if policy.with_log_probs else [zeros, zeros, zeros]
            action = self._append_turn(tok, ep, r.ids, stats)
            if action is not None:
                stepping.append((ep, action, turn))
        return stepping

    def _observed(self, tok, stepping: list[tuple[_Episode, str, int]], answers: list) -> list[_Episode]:
        """The environments' ``answers`` to ``stepping`` applied in episode order: the episodes that go on."""
        for (ep, action, turn), step in zip(stepping, answers):
            self._observe(tok, ep, turn, action, step)
        return [ep for ep, _, _ in stepping if not ep.over]

    def stream(self, policy: Policy, params: SamplingParams, generator: torch.Generator | None):
        """Episodes that advance on their own, each finished as its last step answers
        (:class:`shifu.rollout.episode_stream.EpisodeStream`); ``policy``'s model may be given new weights
        between two of its rounds."""
        from shifu.rollout.episode_stream import EpisodeStream

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
            action = self._append_row(tok, ep, out, j)
            if action is not None:
                stepping.append((ep, action, turn))
        self._observed(tok, stepping, self.env.step(_calls(stepping)))

    def _append_turn(self, tok, ep: _Episode, ids: list[int], stats: list[list[float]]) -> str | None:
        """The turn sampled for ``ep`` appended (its ids, and per id the log-prob, entropy and value read off
        the decode steps): the action's text when the turn ended (at EOS or a stop string), for the environment;
        None when a token budget cut it (the episode ends, truncated)."""
        ep.add(Part(ids, True, list(zip(*stats))))
        ep.counts["turns"] += 1
        action = tok.decode(ids, skip_special_tokens=True)
        ep.spans.append(("policy", tok.decode(ids)))
        if ids[-1] == tok.eos_token_id or any(s in action for s in self.limits.stop):
            return action
        ep.end(truncated=True)  # cut by a token budget: the turn never ends
        return None

    def _append_row(self, tok, ep: _Episode, out: Sample, j: int) -> str | None:
        """Row ``j`` of a sampler call appended to ``ep`` as its turn (:meth:`_append_turn`; 0 for the log-probs,
        entropies and values the call read none of)."""
        mask = out.response_mask[j]
        ids = out.response_ids[j][mask].tolist()
        stats = [
            s[j][mask].tolist() if s is not None else [0.0] * len(ids)
            for s in (out.log_probs, out.entropy, out.values)
        ]
        return self._append_turn(tok, ep, ids, stats)

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


def _calls(stepping: list[tuple[_Episode, str, int]]) -> list[tuple]:
    """``Environment.step``'s calls for ``(episode, action, turn)`` triples."""
    return [(ep.env, action, ep.row, turn) for ep, action, turn in stepping]

"""The rollout interface: what a source samples from (:class:`Policy`), what it must do (:class:`RolloutSource`),
what it says it is (:class:`SourceDescription`), and the single-turn source (:class:`SingleTurn`: one response per
prompt, scored by a reward model, an ensemble, a function or the reward service).

A source turns a batch of prompt rows into :class:`~shifu.rollout.batch.Trajectories`; the trainer, validation and
the held-out evaluation call ``collect`` and read only the batch. The other sources are
:class:`shifu.rollout.episodes.Episodes` (an environment) and the agent source (outside agents over the policy
gateway). Whoever needs to know what made a batch (the evaluations' judge, the run's ``summary.json``, the reports
that read it) asks the source's ``description``, never the settings that built it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from shifu.core import last_true, place_step_rewards
from shifu.generation.rollout import Sample, SamplingParams, sample
from shifu.generation.stops import RowStops
from shifu.rollout.batch import PromptBatch, Trajectories, Transcript


def _same(x: Any) -> Any:
    return x


SINGLE_TURN, ENVIRONMENT, AGENT = "single-turn", "environment", "agent"  # SourceDescription.kind


@dataclasses.dataclass(frozen=True)
class SourceDescription:
    """What a rollout source is, in its own words: ``kind`` (``single-turn``, ``environment`` or ``agent``);
    ``scored_by``, how its trajectories earn their return (``reward model``, ``reward-model ensemble``,
    ``reward function``, ``reward service``, ``environment reward``, ``agent's reward``; ``reward`` when not
    said); ``spec``, what scores them as the user named it (a factory, a function, a model path, a URL);
    ``gold``, whether the return is the task's own measure of success, so a gold judge exists without
    ``eval.gold_function`` (an environment's or an agent's count, reported as ``gold/score``); ``records``, what
    it counts per trajectory besides the return (an episode's turns, tool calls, ...); ``available``, whether
    it can run here (an agent needs the ``agents`` and ``serve`` extras).

    A run records it in ``summary.json`` (:meth:`record`) and the reports read it back (:meth:`from_record`)."""

    kind: str
    scored_by: str = "reward"
    spec: str = ""
    gold: bool = False
    records: tuple[str, ...] = ()
    available: bool = True

    @property
    def name(self) -> str:
        """The source as messages and records name it: "environment games:Guess", "agent pkg.mod:solve",
        "reward function pkg.mod:score", "reward model runs/rm/final"."""
        what = {ENVIRONMENT: "environment", AGENT: "agent"}.get(self.kind, self.scored_by)
        return f"{what} {self.spec}".strip()

    @property
    def episodes(self) -> bool:
        """Whether a trajectory is an episode (turns with an environment or through an agent)."""
        return self.kind != SINGLE_TURN

    @property
    def unit(self) -> str:
        """What one trajectory is, in the plural: "episodes" or "responses"."""
        return "episodes" if self.episodes else "responses"

    @property
    def reward_model(self) -> str | None:
        """The path of the reward model (or ensemble) that scores the trajectories; None for another reward."""
        return self.spec if self.scored_by in ("reward model", "reward-model ensemble") else None

    @property
    def judge(self) -> str | None:
        """The gold judge the source is its own (``gold``): "episode return of games:Guess"; else None."""
        return f"episode return of {self.spec}" if self.gold else None

    def record(self) -> dict[str, Any]:
        """The description as ``summary.json`` keeps it (its ``name`` too, for a reader)."""
        return {"name": self.name, **dataclasses.asdict(self), "records": list(self.records)}

    @classmethod
    def from_record(cls, record: Any) -> SourceDescription | None:
        """A description read back from :meth:`record`; None when ``record`` is not one (a run recorded before
        sources described themselves)."""
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        values["records"] = tuple(values.get("records") or ())
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a source samples from: the model that generates (the actor, or its bf16 decode copy) and its
    tokenizer; ``with_log_probs`` / ``value_head``: read the log-probs, entropies (and shared-trunk values) off
    the decode steps, as :func:`shifu.generation.rollout.sample` does; ``sample_kwargs``: the strategy's
    (``strategy.generation_kwargs()``: under torchrun every rank steps until all are done); ``largest``: the
    largest of every rank's value of an int (``strategy.largest``; one process: the value itself);
    ``sampler``: the sampling function (a test may wrap it); ``whole``: ``model`` with whole weights, to sample
    from off-step (``strategy.whole``: a sharded actor's gathered copy; one process: the model itself)."""

    model: nn.Module
    tokenizer: Any
    with_log_probs: bool = False
    value_head: nn.Module | None = None
    sample_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    largest: Callable[[int], int] = _same
    sampler: Callable[..., Sample] = sample
    whole: Callable[[nn.Module], nn.Module] = _same

    def sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop: Callable[[Tensor, Tensor], Tensor] | None = None,
        prefix=None,
    ) -> Sample:
        """One sampler call over left-padded prompts ``(B, P)`` (where the model reads its inputs), as every
        source samples: the log-probs, entropies and values it reads, the strategy's keywords, the ``stop`` rule
        (a :class:`shifu.generation.stops.RowStops`; None: EOS and ``max_new_tokens`` only), the cached prefixes
        the call may reuse (a :class:`shifu.generation.kv_cache.CallPrefixes`; None: every prompt prefilled whole)."""
        return self.sampler(
            self.model,
            prompt_ids,
            prompt_mask,
            params,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
            generator=generator,
            with_log_probs=self.with_log_probs,
            value_head=self.value_head,
            stop=stop,
            **({} if prefix is None else {"prefix": prefix}),
            **self.sample_kwargs,
        )

    def in_step(self, calls: list) -> Iterator:
        """``calls`` (the sampler calls a rank makes now), and under torchrun empty stand-ins until every rank
        has made as many: ranks sampling in step make the same number of forwards."""
        all_done = self.sample_kwargs.get("all_done")
        if all_done is None:
            yield from calls
            return
        k = 0
        while not all_done(k >= len(calls)):
            yield calls[k] if k < len(calls) else []
            k += 1


class RolloutSource(Protocol):
    """Makes trajectories from prompt rows: ``collect(policy, batch, params, generator) -> Trajectories``.
    ``params``: how the policy samples (temperature, top-k/p, tokens per turn); ``generator``: the sampling
    random stream. ``description``: what the source is (:class:`SourceDescription`); ``name``: what judges the
    trajectories, as the user named it (records and messages); ``gold``: whether a trajectory's return is the
    task's own measure of success (an environment's count, reported as ``gold/score``) rather than a learned
    proxy (a reward model)."""

    description: SourceDescription
    name: str
    gold: bool

    def collect(
        self, policy: Policy, batch: PromptBatch, params: SamplingParams, generator: torch.Generator | None
    ) -> Trajectories: ...


class SingleTurn:
    """One response per prompt, sampled to EOS, a ``stop`` string or ``max_new_tokens``, scored by ``reward``
    (a :class:`shifu.rewards.sources.RewardSource` or :class:`shifu.rewards.remote.RemoteReward`; None: not
    scored, every reward NaN, for an evaluation whose judge reads the responses): its score on the response's
    last token, and a reward function's process rewards or a reward model's dense rewards
    (``reward.dense``) as step rewards. ``offload``: a context around the reward's forwards (the strategy's
    placement of a frozen reward model); ``scored_by`` / ``spec``: the reward's kind and its name as the user
    gave it (:class:`SourceDescription`)."""

    gold = False  # a reward model is a proxy; a gold judge is the evaluation's own (eval.gold_function)

    def __init__(
        self,
        reward: Any,
        stop: tuple[str, ...] = (),
        offload: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        scored_by: str = "reward",
        spec: str = "",
    ):
        self.reward, self.stop, self.offload = reward, tuple(stop), offload
        self.description = SourceDescription(SINGLE_TURN, scored_by, spec)

    @property
    def name(self) -> str:
        return self.description.name

    @torch.no_grad()
    def collect(
        self, policy: Policy, batch: PromptBatch, params: SamplingParams, generator: torch.Generator | None
    ) -> Trajectories:
        tok, rows = policy.tokenizer, batch.rows
        stop = (
            RowStops(tok, [params.max_new_tokens] * len(rows), [self.stop] * len(rows)) if self.stop else None
        )
        out = policy.sample(batch.prompt_ids, batch.prompt_mask, params, generator, stop)
        ids, mask = out.response_ids, out.response_mask
        prompts = [r["prompt"] for r in rows]
        responses = [tok.decode(ids[i][mask[i]], skip_special_tokens=True) for i in range(len(rows))]
        input_ids = torch.cat([batch.prompt_ids, ids], dim=1)
        attention_mask = torch.cat([batch.prompt_mask.long(), mask.long()], dim=1)
        scores, step_rewards, step_ends = self._score(
            tok, prompts, responses, rows, input_ids, attention_mask, batch.prompt_ids.shape[1], ids, mask
        )
        last = last_true(mask)
        ended = (ids == tok.eos_token_id).logical_and(last).any(1)
        if self.stop:  # a response that ended at a stop string ended as it should
            ended |= torch.tensor([any(s in r for s in self.stop) for r in responses], device=ended.device)
        rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
        rewards[last.to(scores.device)] = scores
        return Trajectories(
            prompt_ids=batch.prompt_ids,
            prompt_mask=batch.prompt_mask,
            ids=ids,
            trainable=mask,
            attention=mask,
            rewards=rewards,
            truncated=~ended,
            failed=torch.zeros(len(rows), dtype=torch.bool),
            rows=rows,
            transcripts=[Transcript((("input", p), ("policy", r)), r) for p, r in zip(prompts, responses)],
            log_probs=out.log_probs,
            entropy=out.entropy,
            values=out.values,
            step_rewards=step_rewards,
            step_ends=step_ends,
        )

    def _score(
        self, tok, prompts, responses, rows, input_ids, attention_mask, P, response_ids, response_mask
    ):
        """``(scores (B,), step rewards (B, R) or None, step ends (B, R) or None)``: process rewards from the
        steps a function returns, dense rewards (reward.dense) per token."""
        if self.reward is None:
            return torch.full((len(rows),), float("nan")), None, None
        dense = getattr(self.reward, "dense", False)  # reward.dense: each token's change of the prefix score
        with self.offload():
            scores, steps = self.reward.score_with_steps(prompts, responses, rows, input_ids, attention_mask)
            step_rewards = self.reward.dense_rewards(input_ids, attention_mask, P) if dense else None
        step_ends = response_mask if dense else None  # dense: every token is a step of its own
        if steps is not None:
            step_rewards, step_ends = place_steps(tok, response_ids, response_mask, steps)
        return scores, step_rewards, step_ends


def place_steps(tok, response_ids: Tensor, response_mask: Tensor, steps: list) -> tuple[Tensor, Tensor]:
    """Process rewards (B, R) and the step ends (B, R) bool: response i's step ``(end, reward)`` (``end`` a
    character offset into its decoded text, :mod:`shifu.rewards.sources`) lands on the first token whose decoded
    prefix reaches ``end`` characters, the token that completes the step (:func:`shifu.core.place_step_rewards`);
    a step of reward 0 still ends there (the group estimators count it)."""
    S = max(1, max(len(x) for x in steps))
    ends = torch.full((len(steps), S), -1, dtype=torch.long)
    values = torch.zeros(len(steps), S)
    for i, row in enumerate(steps):
        ids, j = response_ids[i][response_mask[i]].tolist(), -1
        for end, reward in row:
            lo, hi = 0, len(ids) - 1  # binary search on the prefix length (decoding is monotone in tokens)
            while lo < hi:
                mid = (lo + hi) // 2
                if len(tok.decode(ids[: mid + 1], skip_special_tokens=True)) >= end:
                    hi = mid
                else:
                    lo = mid + 1
            if j < 0 or ends[i, j] != lo:  # two steps completed by one token share it: their rewards add
                j += 1
            ends[i, j], values[i, j] = lo, values[i, j] + reward
    dev = response_mask.device
    ends = ends.to(dev)
    used = ends >= 0
    hits = torch.zeros(response_mask.shape, dtype=torch.long, device=dev)
    step_mask = hits.scatter_add(1, torch.where(used, ends, 0), used.long()) > 0
    return place_step_rewards(values.to(dev), ends, response_mask), step_mask

"""The one trajectory batch every rollout source makes (:class:`Trajectories`), and the prompts it starts from.

A trajectory is the ids the policy read before its first sampled token (its *first input*: a prompt, or what an
environment's ``reset`` or an agent's first call rendered), then every id after it in the order it was made: the
tokens the policy sampled and the tokens it only read (an environment's observations, a tool's result, what a chat
template wrote between two calls). Ids are kept as made, never re-tokenised from text.

Layout: first inputs left-padded ``(B, P)``; the rest right-padded ``(B, R)``, position ``t`` of the rest read at
sequence position ``P + t`` of ``cat(prompt, rest)`` (positions from the attention mask). Three masks over the rest:

- ``trainable``: the tokens the policy sampled, the only ones in a policy loss, a KL, an entropy, a value loss or a
  token count. A single-turn response is sampled from its first token to its EOS (included when sampled);
- ``attention``: every token the model reads, sampled or not; False only on padding;
- ``turn_ends``: the last sampled token of each turn, where that turn's reward sits (``rewards``). None when every
  trajectory is one turn, whose end is its last trainable token.

Row ``i < len(batch.rows)`` is the trajectory of prompt row ``i``. A source may append more trajectories of the same
rows after those (an agent's forks, :mod:`shifu.rollout.agent`): the trainer trains every row, an evaluation reads
each prompt row's own.

Rewards are data; what they mean to an estimator (a turn's reward as a process reward, or the return as one score)
is the trainer's business (:mod:`shifu.trainers.ppo_rollout`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import Tensor

from shifu.models.padding import pad_left

MARKS = ("\u27e6", "\u27e7")  # around a policy turn in a multi-turn transcript (the report highlights it)
# per trajectory, where the source counts them (episodes): turns, tool calls and errors, observation tokens, and
# the steps whose Step.info reported tool calls at all (none: tool use is not measured, rather than 0)
COUNTS = ("turns", "tool_calls", "tool_errors", "observation_tokens", "tool_reports")


class PromptBatch(NamedTuple):
    """What a rollout starts from: the data rows, and their prompts encoded as a single-turn source samples them
    (left-padded ``(B, P)``; sources that render their own first input, from an environment or an agent, read the
    rows only)."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    rows: list[dict]


@dataclasses.dataclass(frozen=True)
class Transcript:
    """One trajectory as text: ``spans`` of ``(kind, text)`` in order, kind ``input`` (the first input as the
    policy read it), ``policy`` (a sampled turn) or ``observation`` (what it read between turns); ``response``:
    what a reader is shown as the trajectory's answer (a single-turn response's text; a multi-turn episode's
    turns and observations with the policy's turns between :data:`MARKS`)."""

    spans: tuple[tuple[str, str], ...]
    response: str

    @property
    def first_input(self) -> str:
        return next((text for kind, text in self.spans if kind == "input"), "")


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """``B`` trajectories as a source made them (module docstring for the layout and the masks)."""

    prompt_ids: Tensor  # (B, P) left-padded first inputs
    prompt_mask: Tensor  # (B, P)
    ids: Tensor  # (B, R) sampled and read ids after the first input, right-padded with pad ids
    trainable: Tensor  # (B, R) bool, sampled by the policy
    attention: Tensor  # (B, R) bool, read by the model (sampled or not); False on padding
    rewards: Tensor  # (B, R) each turn's reward on its last sampled token, 0 elsewhere (NaN: no valid reward)
    truncated: Tensor  # (B,) bool, ended by a budget (tokens, turns) instead of EOS, a stop string or done
    failed: Tensor  # (B,) bool, ended by a fault of the environment or agent (its rewards are 0)
    rows: list[dict]  # B data rows
    transcripts: list[Transcript]  # B transcripts
    # per sampled token, read off the sampler's own decode steps (with_log_probs), 0 elsewhere; else None
    log_probs: Tensor | None = None  # (B, R) log pi(a_t | s_t) under logits / T
    entropy: Tensor | None = None  # (B, R)
    values: Tensor | None = None  # (B, R) a shared-trunk value head's values
    turn_ends: Tensor | None = None  # (B, R) bool, the last sampled token of each turn; None: one turn each
    step_rewards: Tensor | None = None  # (B, R) rewards inside a turn (process steps, dense), else None
    step_ends: Tensor | None = None  # (B, R) bool, the tokens that end such a step (with step_rewards)
    counts: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # COUNTS per trajectory, if kept
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the source's own, e.g. env/turns

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def returns(self) -> Tensor:
        """(B,) each trajectory's return: the sum of its turn rewards and of its step rewards (a process reward's
        steps, a dense reward model's per-token changes)."""
        if self.step_rewards is None:
            return self.rewards.sum(1)
        return self.rewards.sum(1) + self.step_rewards.to(self.rewards.dtype).sum(1)

    @property
    def input_ids(self) -> Tensor:
        """(B, P + R) what a forward over the whole trajectories reads."""
        return torch.cat([self.prompt_ids, self.ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(B, P + R) long, 1 on every real token."""
        return torch.cat([self.prompt_mask.long(), self.attention.long()], dim=1)

    def select(self, idx: list[int]) -> Trajectories:
        """The trajectories ``idx``, in that order (``metrics`` kept as they are)."""
        index = torch.tensor(idx, dtype=torch.long)
        return dataclasses.replace(
            self,
            **{
                f.name: v[index.to(v.device)]
                for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), Tensor)
            },
            rows=[self.rows[i] for i in idx],
            transcripts=[self.transcripts[i] for i in idx],
            counts={k: [v[i] for i in idx] for k, v in self.counts.items()},
        )

    def to(self, device: Any) -> Trajectories:
        """The batch with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            **{
                f.name: v.to(device)
                for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), Tensor)
            },
        )


@dataclasses.dataclass
class Part:
    """A run of ids in a trajectory after its first input: sampled by the policy (``stats``: per id the decode's
    ``(log-prob, entropy)`` or ``(log-prob, entropy, value)``; ``reward``: the turn's, on its last id) or read
    (an observation, a tool's result, what a template wrote between two calls)."""

    ids: list[int]
    sampled: bool
    stats: list[tuple[float, ...]] | None = None
    reward: float = 0.0


@dataclasses.dataclass
class Trajectory:
    """One trajectory as a multi-turn source makes it, before it is a row of :class:`Trajectories`: its data
    row, its first input's ids, its parts in order, how it ended, what it counted (per key of its source) and its
    ``(kind, text)`` spans (:class:`Transcript`)."""

    row: dict
    prompt: list[int]
    parts: list[Part] = dataclasses.field(default_factory=list)
    truncated: bool = False
    failed: bool = False
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    spans: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        """Ids after the first input."""
        return sum(len(p.ids) for p in self.parts)


def stack(trajs: list[Trajectory], pad_token_id: int, log_probs: bool, values: bool) -> Trajectories:
    """Multi-turn trajectories as one batch (module docstring): left-padded first inputs, right-padded parts,
    ``turn_ends`` and the turn's reward on each sampled part's last id; ``log_probs``: keep the parts' log-probs
    and entropies, ``values``: their shared-trunk values (0 where a part has none). The counts keyed as the
    first trajectory's."""
    B, R = len(trajs), max(1, max(t.length for t in trajs))
    prompts = pad_left([t.prompt for t in trajs], pad_token_id)
    ids = torch.full((B, R), pad_token_id, dtype=torch.long)
    sampled, attention, turn_ends = (torch.zeros(B, R, dtype=torch.bool) for _ in range(3))
    stats, rewards = torch.zeros(3, B, R), torch.zeros(B, R)
    for i, t in enumerate(trajs):
        at = 0
        for part in t.parts:
            n = len(part.ids)
            if not n:
                continue
            ids[i, at : at + n] = torch.tensor(part.ids, dtype=torch.long)
            attention[i, at : at + n] = True
            if part.sampled:
                sampled[i, at : at + n] = True
                kept = torch.tensor(part.stats).T
                stats[: kept.shape[0], i, at : at + n] = kept
                turn_ends[i, at + n - 1] = True
                rewards[i, at + n - 1] = part.reward
            at += n
    return Trajectories(
        prompt_ids=prompts["input_ids"],
        prompt_mask=prompts["attention_mask"],
        ids=ids,
        trainable=sampled,
        attention=attention,
        rewards=rewards,
        truncated=torch.tensor([t.truncated for t in trajs]),
        failed=torch.tensor([t.failed for t in trajs]),
        rows=[t.row for t in trajs],
        transcripts=[transcript(t.spans) for t in trajs],
        log_probs=stats[0] if log_probs else None,
        entropy=stats[1] if log_probs else None,
        values=stats[2] if values else None,
        turn_ends=turn_ends,
        counts={k: [t.counts[k] for t in trajs] for k in trajs[0].counts},
    )


def transcript(spans: list[tuple[str, str]]) -> Transcript:
    """A multi-turn trajectory after its first input as text, the policy's turns (what trains) between
    :data:`MARKS`."""
    shown = "".join(MARKS[0] + t + MARKS[1] if k == "policy" else t for k, t in spans if k != "input")
    return Transcript(tuple(spans), shown)


def episode_metrics(
    counts: dict[str, list[int]],
    truncated: Tensor,
    failed: Tensor,
    returns: Tensor,
    prefix: str,
    dtype: torch.dtype = torch.float32,
    tools: bool | None = None,
) -> dict[str, float]:
    """Means over episodes, keyed ``prefix + name``: what the source counts (turns, observation tokens; tool
    calls, tool errors and the fraction with a tool call, ``tool_use``, where tool calls are reported), the
    fractions terminated (neither truncated nor failed), truncated and failed (``errors``), and the mean of
    ``returns``. ``truncated``/``failed``: ``(B,)`` bool, their fractions taken in ``dtype`` (a rollout's
    float32, an evaluation's lists float64); ``tools``: whether tool calls are reported (None: where any
    trajectory's ``tool_reports`` count says so)."""
    n = max(1, len(truncated))
    reported = tools if tools is not None else sum(counts.get("tool_reports", ())) > 0
    kept = ("turns", *(("tool_calls", "tool_errors") if reported else ()), "observation_tokens")
    out = {f"{prefix}{k}": sum(counts[k]) / n for k in kept if k in counts}
    if reported:
        out[f"{prefix}tool_use"] = sum(c > 0 for c in counts["tool_calls"]) / n
    return out | {
        f"{prefix}terminated": float((~(truncated | failed)).to(dtype).mean()),
        f"{prefix}truncated": float(truncated.to(dtype).mean()),
        f"{prefix}errors": float(failed.to(dtype).mean()),
        f"{prefix}return": float(returns.mean()),
    }

"""The one evaluation of a policy: trajectories from a rollout source on held-out prompts, each trajectory's
return, and its KL to a reference over the tokens the policy sampled.

:func:`evaluate` serves PPO's validation (the actor in memory, :mod:`shifu.trainers.ppo_eval`), the quickstart's
before/after comparison, ``shifu eval`` and the study: whatever the source (single-turn responses, episodes with
an environment, outside agents), it reads only the :class:`~shifu.rollout.batch.Trajectories` batch. Gold judges
that are not the source's own reward score the transcripts afterwards (:meth:`Evaluated.responses`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shifu.core import kl_estimate, masked_sum
from shifu.generation.rollout import SamplingParams, policy_forward
from shifu.models.padding import pad_left
from shifu.rollout.batch import COUNTS, PromptBatch, Transcript, episode_metrics
from shifu.rollout.sources import Policy, RolloutSource


@dataclasses.dataclass
class Evaluated:
    """Per trajectory, in the order of the prompt rows: what it was, what it earned, its KL to the reference
    (k1 and k3, nats over its sampled tokens; empty without a reference), its sampled tokens, and how it
    ended; ``counts``: per trajectory turns, tool calls, tool errors and observation tokens where the source
    counts them (episodes)."""

    rows: list[dict] = dataclasses.field(default_factory=list)
    transcripts: list[Transcript] = dataclasses.field(default_factory=list)
    returns: list[float] = dataclasses.field(default_factory=list)
    kl: list[float] = dataclasses.field(default_factory=list)
    kl_k3: list[float] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    truncated: list[bool] = dataclasses.field(default_factory=list)
    failed: list[bool] = dataclasses.field(default_factory=list)
    counts: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def episodes(self) -> bool:
        """Whether the trajectories are episodes: their source counts turns (an environment, an agent;
        ``SourceDescription.records``)."""
        return "turns" in self.counts

    @property
    def responses(self) -> list[str]:
        return [t.response for t in self.transcripts]

    def extend(self, other: Evaluated) -> Evaluated:
        """``other``'s trajectories appended to these (returns self)."""
        for f in dataclasses.fields(self):
            if f.name != "counts":
                getattr(self, f.name).extend(getattr(other, f.name))
        for k, v in other.counts.items():
            self.counts.setdefault(k, []).extend(v)
        return self

    def select(self, idx: list[int]) -> Evaluated:
        """The trajectories ``idx``, in that order (the KL lists stay empty without a reference)."""
        pick = {
            f.name: [v[i] for i in idx] if (v := getattr(self, f.name)) else []
            for f in dataclasses.fields(self)
            if f.name != "counts"
        }
        counts = {k: [v[i] for i in idx] for k, v in self.counts.items()}
        return Evaluated(**pick, counts=counts)

    def mean_return(self) -> float:
        """The mean return over the trajectories with a finite one (a reward that failed is left out), float32."""
        returns = torch.tensor(self.returns)
        return float(returns[torch.isfinite(returns)].mean())

    def tool_use(self) -> list[int] | None:
        """Per trajectory 1 when it called a tool, 0 when not; None when the source does not report tool calls."""
        if not sum(self.counts.get("tool_reports", [])):
            return None
        return [int(n > 0) for n in self.counts["tool_calls"]]

    def metrics(self, prefix: str) -> dict[str, float]:
        """Where the source counts turns (episodes): :func:`shifu.rollout.batch.episode_metrics` of the
        trajectories (the return's mean over the finite ones), keyed ``prefix + "env/" + name`` as the rollout's
        ``env/*``; else nothing."""
        if not self.counts:
            return {}
        returns = torch.tensor(self.returns)
        return episode_metrics(
            self.counts,
            torch.tensor(self.truncated, dtype=torch.bool),
            torch.tensor(self.failed, dtype=torch.bool),
            returns[torch.isfinite(returns)],
            prefix + "env/",
            dtype=torch.float64,
        )

    def records(self, golds: list[float] | None) -> list[dict[str, Any]]:
        """One sample record per trajectory (``samples.jsonl``): the prompt row's prompt, the response as a
        reader sees it, the return as ``score``, the gold (None without a judge); with counted turns (episodes)
        also ``input`` (the first input as the policy read it: what the environment's ``reset`` gave, rendered),
        ``turns`` and ``truncated``."""
        golds = golds if golds is not None else [None] * len(self)
        out = [
            {"prompt": r["prompt"], "response": t.response, "score": s, "gold": g}
            for r, t, s, g in zip(self.rows, self.transcripts, self.returns, golds)
        ]
        if self.episodes:
            out = [
                {"prompt": x["prompt"], "input": t.first_input, **x} | {"turns": n, "truncated": c}
                for x, t, n, c in zip(out, self.transcripts, self.counts["turns"], self.truncated)
            ]
        return out


def plain_reference(model: nn.Module | None) -> Callable[[], contextlib.AbstractContextManager] | None:
    """A reference model held as it is (the ``reference`` argument of :func:`evaluate`)."""
    return None if model is None else lambda: contextlib.nullcontext(model)


@torch.no_grad()
def evaluate(
    policy: Policy,
    source: RolloutSource,
    batches: Iterable[PromptBatch],
    params: SamplingParams,
    generator: torch.Generator | None,
    reference: Callable[[], contextlib.AbstractContextManager] | None = None,
    on_batch: Callable[[int], Any] | None = None,
) -> Evaluated:
    """Trajectories from ``source`` for every batch, sampled from ``policy`` with ``params`` and ``generator``;
    with ``reference`` (a context manager factory yielding the frozen reference, :func:`plain_reference`) each
    trajectory's KL, both models at ``params.temperature``: the policy's log-probs are the decode's own when
    ``policy.with_log_probs``, else one forward. ``on_batch(n)`` (a progress bar's ``update``) after each batch."""
    out = Evaluated()
    T = params.temperature
    for batch in batches:
        t = source.collect(policy, batch, params, generator)
        if len(t) > len(batch.rows):  # each prompt row's own trajectory (an agent's forks train, not score)
            t = t.select(list(range(len(batch.rows))))
        mask = t.trainable
        part = Evaluated(
            rows=list(t.rows),
            transcripts=list(t.transcripts),
            returns=t.returns.tolist(),
            lengths=mask.sum(1).tolist(),
            truncated=t.truncated.tolist(),
            failed=t.failed.tolist(),
            counts={k: list(v) for k, v in t.counts.items() if k in COUNTS},
        )
        if reference is not None:
            device = next(policy.model.parameters()).device
            ids, am, P = t.input_ids.to(device), t.attention_mask.to(device), t.prompt_ids.shape[1]
            mask = mask.to(device)
            lp = (
                t.log_probs.to(device)
                if t.log_probs is not None
                else policy_forward(policy.model, ids, am, P, T)[0]
            )
            with reference() as ref:
                ref_lp = policy_forward(ref, ids, am, P, T)[0]
            part.kl = masked_sum(kl_estimate(lp, ref_lp, "k1"), mask, dim=1).float().tolist()
            part.kl_k3 = masked_sum(kl_estimate(lp, ref_lp, "k3"), mask, dim=1).float().tolist()
        out.extend(part)
        if on_batch is not None:
            on_batch(len(t))
    return out


def prompt_batches(tok, rows: list[dict], ids: list[list[int]], batch_size: int) -> Iterable[PromptBatch]:
    """``rows`` and their encoded prompts ``ids`` as left-padded batches of ``batch_size``."""
    for i in range(0, len(rows), batch_size):
        b = pad_left(ids[i : i + batch_size], tok.pad_token_id)
        yield PromptBatch(b["input_ids"], b["attention_mask"], rows[i : i + batch_size])


def encode_prompts(tok, rows: list[dict], max_prompt_len: int | None, chat_template: bool) -> list[list[int]]:
    """Each row's prompt ids as PPO sampled them: its text (a user message through the chat template when the
    tokenizer has one and ``chat_template``), without special tokens added, its last ``max_prompt_len`` tokens
    (a model with learned positions also needs room for the response: pass the smaller length)."""
    from shifu.data.rows import prompt_text

    out = [tok(prompt_text(tok, r, chat_template), add_special_tokens=False)["input_ids"] for r in rows]
    return [x[-max_prompt_len:] for x in out] if max_prompt_len else out

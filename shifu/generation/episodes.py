"""The episode rollout: multi-turn episodes with an environment, token in and token out.

An episode's trajectory is the ids of its first input (``env.reset(row)``, :mod:`shifu.generation.observations`),
then per turn the ids the policy sampled and the ids of the environment's observation, appended as they were
made: every turn's sampler input is a prefix of the final row, and nothing is ever re-tokenised. All episodes of
a batch advance together, one sampler call per turn over the episodes still running (left-padded contexts,
positions from the mask, as the trainer's forward sees the final row).

A turn ends at EOS or at the first token whose decoded turn text contains a ``stop`` string (the token is kept).
The action given to ``env.step`` is that turn's tokens decoded with special tokens skipped. An episode ends:

- when a step says ``done``;
- truncated, when ``max_turns`` turns have been taken without ``done``, when a turn reaches its token budget
  (``max_tokens_per_turn``, or what is left of ``max_total_tokens``, or of the model's positions) before
  EOS or a stop string (the cut turn is not given to the environment), or when an observation does not fit
  in what is left of ``max_total_tokens``;
- failed, on an environment fault with ``on_error=end_episode``: every reward of the episode is 0.

The rows (:class:`Episodes`): the first inputs left-padded ``(B, P)``; the rest right-padded ``(B, R)``, with
``response_mask`` True on sampled tokens only (the tokens that train) and ``attention`` True on sampled and
observation tokens (what the model reads). Each step's reward sits on the last sampled token of its turn.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from shifu.envs.base import EnvFault, Environment
from shifu.errors import ShifuError
from shifu.generation.observations import turn_encoder
from shifu.generation.rollout import Sample, SamplingParams, sample
from shifu.models.padding import pad_left

COUNTS = ("turns", "tool_calls", "tool_errors", "observation_tokens")
MARKS = ("\u27e6", "\u27e7")  # around a policy turn in a transcript (the report highlights it)


@dataclasses.dataclass
class Episodes:
    """``B`` finished episodes as rollout rows (module docstring for the layout)."""

    prompt_ids: Tensor  # (B, P) left-padded first inputs
    prompt_mask: Tensor  # (B, P)
    sample: Sample  # response_ids (B, R) sampled and observation ids; response_mask (B, R) sampled only;
    # log_probs / entropy / values (B, R) of the decode steps at sampled positions (with_log_probs), else None
    attention: Tensor  # (B, R) bool, sampled and observation tokens
    rewards: Tensor  # (B, R) each step's reward on the last sampled token of its turn
    turn_ends: Tensor  # (B, R) bool, the last sampled token of every turn
    returns: Tensor  # (B,) the sum of each episode's rewards
    truncated: Tensor  # (B,) bool, ended by a budget or max_turns instead of done
    failed: Tensor  # (B,) bool, ended by an environment fault (on_error=end_episode)
    started: Tensor  # (B,) bool, at least one sampled token (False: the fault came before the first turn)
    counts: dict[str, list[int]]  # COUNTS per episode
    spans: list[list[tuple[str, str]]]  # per episode: (kind, text), kind "input", "policy" or "observation"

    def metrics(self, prefix: str = "env/") -> dict[str, float]:
        """Means over the episodes: turns, tool calls and errors, observation tokens, the fractions truncated,
        failed and with a tool call (``tool_use``), the return."""
        n = max(1, len(self.spans))
        out = {f"{prefix}{k}": sum(v) / n for k, v in self.counts.items()}
        out[f"{prefix}tool_use"] = sum(c > 0 for c in self.counts["tool_calls"]) / n
        return out | {
            f"{prefix}truncated": float(self.truncated.float().mean()),
            f"{prefix}errors": float(self.failed.float().mean()),
            f"{prefix}return": float(self.returns.mean()),
        }

    def scores(self, per_turn: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(scores (B,), token_rewards (B, R) or None, step ends (B, R) or None)`` as a trainer's estimator
        reads rewards. ``per_turn``: the last turn's reward is the score (on the last sampled token, where a
        response's score goes) and the earlier turns' rewards are process rewards on their own last tokens;
        else the episode's return is the one score. An episode with no sampled token (a fault before its first
        turn) scores NaN: the trainer drops it as it drops a non-finite score."""
        nan = torch.full_like(self.returns, float("nan"))
        if not per_turn:
            return torch.where(self.started, self.returns, nan), None, None
        mask = self.sample.response_mask
        last = (mask.long().cumsum(1) == mask.sum(1, keepdim=True)) & mask
        final = (self.rewards * last).sum(1)
        return torch.where(self.started, final, nan), self.rewards * ~last, self.turn_ends

    def transcripts(self) -> list[str]:
        """Each episode after its first input as text, the policy's turns (what trains) between ``MARKS``."""
        return [
            "".join(MARKS[0] + t + MARKS[1] if k == "policy" else t for k, t in s if k != "input")
            for s in self.spans
        ]


class _Episode:
    def __init__(self, row: dict):
        self.row, self.env, self.fmt = row, None, None
        self.prompt: list[int] = []
        self.ids: list[int] = []  # after the first input
        self.sampled: list[bool] = []
        self.stats: list[list[float]] = []  # (log-prob, entropy, value) per token (0 on observations)
        self.rewards: dict[int, float] = {}  # position in ids -> reward
        self.ends: list[int] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.spans: list[tuple[str, str]] = []
        self.over = self.truncated = self.failed = False

    def end(self, truncated: bool = False, failed: bool = False) -> None:
        self.over, self.truncated, self.failed = True, truncated, failed
        if failed:
            self.rewards = {}


class _Stops:
    """``sample``'s ``stop``: a row ends at its token budget, or when its turn's text contains a stop string."""

    def __init__(self, tok, strings: tuple[str, ...], limits: list[int]):
        self.tok, self.strings, self.limits = tok, strings, torch.tensor(limits)

    def __call__(self, tokens: Tensor, running: Tensor) -> Tensor:
        out = tokens.shape[1] >= self.limits  # (B,) on the host
        if self.strings:
            rows = tokens.tolist()
            for j in running.nonzero().flatten().tolist():
                text = self.tok.decode(rows[j], skip_special_tokens=True)
                out[j] |= any(s in text for s in self.strings)
        return out


@torch.no_grad()
def run_episodes(
    model,
    tok,
    env: Environment,
    rows: list[dict],
    params: SamplingParams,
    generator: torch.Generator | None = None,
    chat: bool = True,
    max_prompt_len: int | None = None,
    with_log_probs: bool = False,
    value_head=None,
    sampler=sample,
    **sample_kwargs: Any,
) -> Episodes:
    """One episode per row (a fresh environment each), all advancing together; see the module docstring.

    ``params``: how turns are sampled (its ``max_new_tokens`` is replaced by each turn's budget). ``chat``:
    render through the chat template when the tokenizer has one (``data.chat_template``). ``max_prompt_len``:
    a first input longer than this is an error naming the row. ``with_log_probs`` / ``value_head`` /
    ``sample_kwargs``: as :func:`shifu.generation.rollout.sample`, which ``sampler`` is (a test may wrap it)."""
    eps = [_Episode(row) for row in rows]
    for ep in eps:
        try:
            ep.env = env.make(ep.row)
            first = env.reset(ep.env, ep.row)
        except EnvFault as e:
            _fault(env, ep, e)
            ep.prompt = [tok.eos_token_id]  # (a placeholder: the row has no turn and leaves the rollout)
            continue
        ep.fmt = turn_encoder(tok, chat)
        ep.prompt = _located(env, ep, None, ep.fmt.first, first)
        if not ep.prompt or (max_prompt_len and len(ep.prompt) > max_prompt_len):
            raise ShifuError(
                f"{env.where(ep.row, None)}: the first input is {len(ep.prompt)} tokens; it must be "
                f"1 to data.max_prompt_len={max_prompt_len}"
            )
        ep.spans.append(("input", tok.decode(ep.prompt)))
    positions = getattr(getattr(model, "config", None), "n_positions", None)  # GPT-2's learned positions
    positions = positions if isinstance(positions, int) else None
    device = next(model.parameters()).device
    for turn in range(env.max_turns):
        for group in _batches([ep for ep in eps if not ep.over], env, positions):
            contexts = [ep.prompt + ep.ids for ep in group]
            limits = [_budget(env, ep, positions) for ep in group]
            b = pad_left(contexts, tok.pad_token_id)
            out = sampler(
                model,
                b["input_ids"].to(device),
                b["attention_mask"].to(device),
                dataclasses.replace(params, max_new_tokens=max(limits)),
                tok.eos_token_id,
                tok.pad_token_id,
                generator=generator,
                with_log_probs=with_log_probs,
                value_head=value_head,
                stop=_Stops(tok, env.stop, limits),
                **sample_kwargs,
            )
            for j, ep in enumerate(group):
                _take_turn(env, tok, ep, turn, out, j)
    for ep in eps:
        if not ep.over:  # still going after max_turns
            ep.end(truncated=True)
    return _rows(eps, tok, with_log_probs, value_head is not None)


def _budget(env: Environment, ep: _Episode, positions: int | None) -> int:
    """The tokens ``ep`` may sample this turn: the turn's budget, what is left of the episode's, and of the
    model's learned positions (GPT-2's ``n_positions``), if it has them."""
    left = min(env.max_tokens_per_turn, env.max_total_tokens - len(ep.ids))
    return left if positions is None else min(left, positions - len(ep.prompt) - len(ep.ids))


def _batches(running: list[_Episode], env: Environment, positions: int | None) -> list[list[_Episode]]:
    """The running episodes as sampler batches: all of them, unless the longest context plus the largest turn
    budget passes a model's learned positions; then by context length, longest first, each batch as large as
    its longest context allows. An episode with no position left ends here, truncated."""
    for ep in running:
        if _budget(env, ep, positions) < 1:
            ep.end(truncated=True)
    running = [ep for ep in running if not ep.over]
    if positions is None or not running:
        return [running] if running else []

    def size(ep: _Episode) -> int:
        return len(ep.prompt) + len(ep.ids)

    if max(map(size, running)) + max(_budget(env, ep, positions) for ep in running) <= positions:
        return [running]
    batches: list[list[_Episode]] = []
    for ep in sorted(running, key=size, reverse=True):
        if batches and size(batches[-1][0]) + max(_budget(env, ep, positions), 0) <= positions:
            batches[-1].append(ep)
        else:
            batches.append([ep])
    return batches


def _fault(env: Environment, ep: _Episode, e: EnvFault) -> None:
    if env.on_error == "raise":
        raise env.fault(e) from None
    ep.end(failed=True)


def _located(env: Environment, ep: _Episode, turn: int | None, fn, *args):
    """``fn(*args)`` with a template or format error located at the environment, row and turn."""
    try:
        return fn(*args)
    except ShifuError as e:
        raise type(e)(f"{env.where(ep.row, turn)}: {e}") from None


def _take_turn(env: Environment, tok, ep: _Episode, turn: int, out: Sample, j: int) -> None:
    """Append row ``j`` of the turn's sample to ``ep``, then step the environment and append the observation."""
    mask = out.response_mask[j]
    ids = out.response_ids[j][mask].tolist()
    n = len(ids)
    stats = [out.log_probs, out.entropy, out.values]
    cols = [s[j][mask].tolist() if s is not None else [0.0] * n for s in stats]
    ep.ids += ids
    ep.sampled += [True] * n
    ep.stats += [list(x) for x in zip(*cols)]
    ep.ends.append(len(ep.ids) - 1)
    ep.counts["turns"] += 1
    action = tok.decode(ids, skip_special_tokens=True)
    ep.spans.append(("policy", tok.decode(ids)))
    eos = ids[-1] == tok.eos_token_id
    if not eos and not any(s in action for s in env.stop):  # cut by a token budget: the turn never ends
        ep.end(truncated=True)
        return
    try:
        step = env.step(ep.env, action, ep.row, turn)
    except EnvFault as e:
        _fault(env, ep, e)
        return
    ep.rewards[len(ep.ids) - 1] = float(step.reward)
    for k in ("tool_calls", "tool_errors"):
        value = step.info.get(k, 0)
        ep.counts[k] += int(value) if isinstance(value, (int, float)) else 0
    if step.done:
        ep.end()
        return
    if turn + 1 == env.max_turns:
        ep.end(truncated=True)
        return
    obs = _located(env, ep, turn, ep.fmt.observation, action, eos, step.observation)
    if len(obs) > env.max_total_tokens:
        _fault(
            env,
            ep,
            EnvFault(
                f"{env.where(ep.row, turn)}: the observation is {len(obs)} tokens, over "
                f"ppo.env.max_total_tokens={env.max_total_tokens} on its own"
            ),
        )
        return
    if len(ep.ids) + len(obs) >= env.max_total_tokens:  # no room left for another turn
        ep.end(truncated=True)
        return
    ep.ids += obs
    ep.sampled += [False] * len(obs)
    ep.stats += [[0.0, 0.0, 0.0]] * len(obs)
    ep.counts["observation_tokens"] += len(obs)
    ep.spans.append(("observation", tok.decode(obs)))


def _rows(eps: list[_Episode], tok, with_log_probs: bool, with_values: bool) -> Episodes:
    """The episodes as left-padded first inputs and right-padded trajectories (module docstring)."""
    B, R = len(eps), max(1, max(len(ep.ids) for ep in eps))
    prompts = pad_left([ep.prompt for ep in eps], tok.pad_token_id)
    ids = torch.full((B, R), tok.pad_token_id, dtype=torch.long)
    sampled, attention, turn_ends = (torch.zeros(B, R, dtype=torch.bool) for _ in range(3))
    stats, rewards = torch.zeros(3, B, R), torch.zeros(B, R)
    for i, ep in enumerate(eps):
        n = len(ep.ids)
        ids[i, :n] = torch.tensor(ep.ids, dtype=torch.long)
        sampled[i, :n] = torch.tensor(ep.sampled, dtype=torch.bool)
        attention[i, :n] = True
        if n:
            stats[:, i, :n] = torch.tensor(ep.stats).T
        turn_ends[i, ep.ends] = True
        for pos, r in ep.rewards.items():
            rewards[i, pos] = r
    sample_ = Sample(
        ids,
        sampled,
        stats[0] if with_log_probs else None,
        stats[1] if with_log_probs else None,
        stats[2] if with_values else None,
    )
    return Episodes(
        prompt_ids=prompts["input_ids"],
        prompt_mask=prompts["attention_mask"],
        sample=sample_,
        attention=attention,
        rewards=rewards,
        turn_ends=turn_ends,
        returns=rewards.sum(1),
        truncated=torch.tensor([ep.truncated for ep in eps]),
        failed=torch.tensor([ep.failed for ep in eps]),
        started=sampled.any(1),
        counts={k: [ep.counts[k] for ep in eps] for k in COUNTS},
        spans=[ep.spans for ep in eps],
    )

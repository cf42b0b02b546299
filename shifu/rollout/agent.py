"""The agent source: episodes of an outside agent written against the ``openai`` client, sampled from the policy
through an in-process recording gateway (:mod:`shifu.gateway`) and made into trajectories.

The agent is one async function (``agent.factory``)::

    async def solve(client: openai.AsyncOpenAI, row: dict, **agent.kwargs) -> float | None

Per :meth:`AgentEpisodes.collect` a gateway serves the policy on 127.0.0.1 (real HTTP, uvicorn) with the
trainer's sampling (temperature, top-k, top-p; ``max_new_tokens`` caps every call). Per row a session is opened,
``solve`` runs with a client whose API key is the session's key (``agent.concurrency`` episodes at once,
``agent.timeout_s`` each), then the session is ended and its recorded calls become trajectories
(:mod:`shifu.gateway.sessions`: joined on the server where a call's prompt extends an earlier call token for
token, never re-tokenised).

**A trajectory** is its first call's prompt as the first input, then per call the ids read since the previous
call (tool results, the template's headers, an end-of-turn the policy did not sample: attended, not trained) and
the ids sampled (trained, with the log-probs and entropies the sampler read off its own decode steps). A
trajectory keeps at most ``max_turns`` calls and ``max_total_tokens`` ids after its first input; a longer one is
cut before the call that does not fit, and truncated (so is one whose last kept call ended at its token cap). A
first input longer than ``max_prompt_len`` (``data.max_prompt_len``) is an error naming the agent and the row, as
an environment's is: the batch's rows are at most that plus ``max_total_tokens`` ids.

**Rewards.** A call's reward (``POST /rl/set_reward`` with ``call``, or :func:`set_reward`) sits on that call's
last sampled token; ``turn_ends`` marks every call's last sampled token. The episode's reward, what ``solve``
returns (or, when it returns None, the session's reward set without ``call``; giving both is a fault), is added
on the trajectory's last sampled token. So GAE, the critic and every critic-free estimator read an agent's
episodes as they read an environment's.

**Forks.** A call that extends no earlier call starts another trajectory of the episode (``agent/forks``). Row
``i`` of the batch is always row ``i``'s *main* trajectory, the one holding the episode's last call of the agent's
own (a side call's trajectory is never the main one). With ``train_forks`` (one process, ``group_size`` 1: GAE,
REINFORCE, REINFORCE++) each other trajectory is appended after the batch's rows as a row of its own, trained
with the episode's reward: the batch then has more rows than prompts (``agent/fork_rows`` per episode; the
minibatches grow with it). Without it (group estimators, which need exactly ``G`` rows per prompt to compare;
torchrun, whose ranks must train the same number of rows) only the main trajectory trains and the others are
counted. An evaluation reads the main trajectories.

**Side calls.** A call sent with another system prompt than the agent's (a title, a summary, a classifier:
:mod:`shifu.gateway.sessions` says which system prompt is the agent's) starts a side trajectory
(``agent/side_calls`` counts such calls). ``side_calls="skip"`` (``agent.side_calls``) records them and leaves
them out of the batch: the episode's reward is for the agent's work, which a title's tokens did not do.
``"train"`` trains them as forks are trained (above).

**Incomplete episodes.** An episode that ends on a budget is truncated, as an environment's episode is
(``truncated``: the trainer's missing-EOS penalty applies, and nothing is bootstrapped past it): its main
trajectory cut at ``max_turns`` calls or ``max_total_tokens`` ids, its last kept call cut at its token cap (or at
the model's positions), the episode stopped at ``agent.timeout_s`` (``agent/timeouts``: what it recorded is kept
with its rewards), or its last request refused because the prompt leaves no room in the model's positions
(``context_length_exceeded``, ``agent/context_exceeded``; ``solve`` may let that error out).

**Faults.** ``solve`` raising (but for the context limit, above), or returning anything but a finite number or
None is a fault naming the agent and the row: ``agent.on_error=raise`` stops the run with the first one (in row order,
once the batch's episodes ended); ``end_episode`` keeps what the episode recorded with every reward 0
(``failed``, ``agent/errors``). An episode with no call has nothing to train: a row with no sampled token, left
out of the update as a non-finite score is.

**Torchrun.** Each process serves its own share of the rows on its own gateway, never rank 0 for all: a gateway
answers calls as they come, so it samples off-step from whole weights (DDP's module, ZeRO-2's; under FSDP2 and
ZeRO-3 a plain copy every rank gathers from the shards once per collect, ``strategy.whole``), and W gateways
sample W shares at once where one would sample them one after another and leave W - 1 processes waiting.

**Reproducibility.** A completion's randomness is the run's and its own, not the order calls arrive in: per
collect the trainer's generator draws the gateway's seed (so the step is in it; without a generator the seed is
the collect's number), row ``i``'s episode runs in a
session of row id ``i``, and each choice of the session's ``k``-th call samples from a generator of its own
seeded by (seed, ``i``, ``k``, choice) (:mod:`shifu.gateway.engine`). That alone gives the same tokens, not the
same bits: a row's logits differ in their last bits with the rows beside it in a sampler call (the padded width
and the number of rows change the CPU kernels' order of summation; 2e-7 in log-probs on the tests' tiny model),
and training carries the difference into the weights. So the gateway also fixes the sampler calls
(:meth:`shifu.gateway.Gateway.plan_sessions`): episodes start in row order as the ``agent.concurrency`` slots
free, and a sampler call starts once every open episode has a call pending or has ended, its calls in (row,
call) order. Two runs with the same seed and threads are then bit-identical in metrics and weights, and so is a
run killed and resumed (``--resume``). The price is waiting: a sampler call waits for the slowest open episode's
next call, however long its tools take (at most ``agent.timeout_s``), where an episode that sent nothing for a
moment used to be left to a later call. With agents that answer promptly, as the examples do, that wait is a
turn-around of HTTP, and the sampler calls are fewer and full (``agent/batched_calls`` is the number of open
episodes). Still up to timing: an episode cut by ``agent.timeout_s``, an agent that
sends several calls of one session at once (they are numbered as they arrive), and a chat template that renders
the random ids of tool calls into prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import numbers
import secrets
from collections.abc import Callable
from typing import Any

import torch

from shifu.config.imports import load_callable, typed_key
from shifu.envs.base import describe_row
from shifu.errors import ConfigError, ShifuError
from shifu.generation.rollout import SamplingParams, policy_forward
from shifu.rollout.batch import Part, PromptBatch, Trajectories, Trajectory, episode_metrics, stack
from shifu.rollout.episodes import EpisodeLimits
from shifu.rollout.sources import AGENT, Policy, SourceDescription

AGENTS_EXTRA = "pip install 'shifu-rlhf[agents]' (the openai client) and 'shifu-rlhf[serve]' (uvicorn)"


def agents_installed() -> bool:
    """Whether the agent source can run here: the openai client and uvicorn importable (:data:`AGENTS_EXTRA`)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("openai", "uvicorn"))


class AgentFault(ShifuError):
    """An agent raised or returned something else than a reward; the message names it and the row."""


async def set_reward(client: Any, reward: float, call: str | None = None) -> None:
    """Set a reward in the session of ``client`` (an ``openai.AsyncOpenAI`` whose API key is a session key):
    ``call``, a completion's id (``response.id``) or ``"last"``, gets it on its last sampled token; without
    ``call`` it is the episode's reward (as if ``solve`` returned it). ``POST /rl/set_reward`` over HTTP."""
    import httpx

    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    body = {"reward": float(reward)} | ({"call": call} if call is not None else {})
    await client.post(root + "/rl/set_reward", body=body, cast_to=httpx.Response)


@dataclasses.dataclass
class _Episode:
    """One row's episode: its recorded session, what ``solve`` returned, and its fault (None: none)."""

    row: dict
    record: Any  # shifu.gateway.RecordedSession
    returned: float | None = None
    fault: str | None = None
    timed_out: bool = False

    @property
    def incomplete(self) -> bool:
        """Ended at ``agent.timeout_s`` or on the model's context limit: its main trajectory is truncated."""
        return self.timed_out or self.record.context_exceeded

    @property
    def reward(self) -> float:
        """The episode's reward: the return, else the session's (0 when neither; 0 after a fault)."""
        if self.fault is not None:
            return 0.0
        return float(self.returned if self.returned is not None else (self.record.reward or 0.0))


class AgentEpisodes:
    """The rollout source of ``agent.factory`` (module docstring): ``solve`` the loaded function, ``spec`` its
    name as configured, ``limits`` the trajectories' budgets (``stop`` unused: the agent sends its own),
    ``train_forks`` whether fork trajectories become rows of their own, ``max_prompt_len`` the most ids of a
    trajectory's first input (None: no bound), ``side_calls`` ``"train"`` or ``"skip"`` (module docstring)."""

    gold = True  # what the agent returns is the task's own measure
    what, on_error_key = "agent", "agent.on_error"  # faults name the source and the setting to change

    def __init__(
        self,
        solve: Callable[..., Any],
        spec: str,
        limits: EpisodeLimits,
        concurrency: int = 64,
        timeout_s: float | None = 300.0,
        on_error: str = "raise",
        kwargs: dict | None = None,
        train_forks: bool = True,
        max_prompt_len: int | None = None,
        side_calls: str = "skip",
    ):
        self.solve, self.spec, self.limits, self.max_prompt_len = solve, spec, limits, max_prompt_len
        self.side_calls = side_calls
        self.concurrency, self.timeout_s, self.on_error = concurrency, timeout_s, on_error
        self.kwargs, self.train_forks = dict(kwargs or {}), train_forks
        self.version = 0  # the policy version the gateway records: one per collect

    @classmethod
    def describe(cls, spec: str) -> SourceDescription:
        """The description of the agent ``spec``'s episodes (available where its extras are installed)."""
        counted = ("turns", "tool_calls", "observation_tokens")
        return SourceDescription(AGENT, "agent's reward", spec, cls.gold, counted, agents_installed())

    @property
    def description(self) -> SourceDescription:
        return self.describe(self.spec)

    @property
    def name(self) -> str:
        return self.description.name

    @torch.no_grad()
    def collect(
        self, policy: Policy, batch: PromptBatch, params: SamplingParams, generator: torch.Generator | None
    ) -> Trajectories:
        """One episode of the agent per row of ``batch`` (its prompt ids are not read: the agent's first call
        renders the first input), sampled as ``params`` says."""
        gateway = self._gateway(policy, params, generator)
        gateway.plan_sessions(len(batch.rows), self.concurrency)
        with gateway:
            episodes = asyncio.run(self._run(gateway, batch.rows))
        sampler_calls = gateway.engine.calls
        t = self._finished(episodes, policy, params)
        calls = sum(ep.record.calls for ep in episodes)
        batched = {"agent/batched_calls": calls / max(1, sampler_calls)}
        return dataclasses.replace(t, metrics=t.metrics | batched | gateway.prefix_metrics(len(episodes)))

    def stream(self, policy: Policy, params: SamplingParams, generator: torch.Generator | None):
        """Episodes that run on their own, each group out as its episodes end
        (:class:`shifu.rollout.agent_stream.AgentStream`); ``policy``'s model may be given new weights in place
        while the stream is paused."""
        from shifu.rollout.agent_stream import AgentStream

        return AgentStream(self, policy, params, generator)

    def _gateway(self, policy: Policy, params: SamplingParams, generator: torch.Generator | None):
        """A recording gateway (not started) on ``policy`` with the trainer's sampling, for one collect or one
        stream."""
        from shifu.gateway import Gateway, Sampling

        try:
            import openai  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            raise ShifuError(f"{typed_key('agent.factory')} needs its extras: {AGENTS_EXTRA}") from None
        check_tokenizer(policy.tokenizer)
        self.version += 1
        # the gateway's seed: drawn from the run's generator; without one, the collect's own number (each batch
        # of an evaluation samples other tokens, the same on every run)
        seed = (
            int(torch.randint(0, 2**62, (1,), generator=generator)) if generator is not None else self.version
        )
        sampling = Sampling(
            temperature=0.0 if params.greedy else params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
        )
        return Gateway(
            policy.whole(policy.model),  # (a sharded actor's whole copy: the gateway samples off-step)
            policy.tokenizer,
            recording=True,
            token=secrets.token_urlsafe(18),
            version=self.version,
            sampling=sampling,
            seed=seed,
            prefix_cache_mb=self.limits.prefix_cache_mb,
        )

    def _finished(self, episodes: list[_Episode], policy: Policy, params: SamplingParams) -> Trajectories:
        """The ended ``episodes`` as trajectories; the first fault (in row order) raised with ``on_error=raise``."""
        for ep in episodes:
            if ep.fault is not None and self.on_error == "raise":
                raise AgentFault(
                    f"{ep.fault}. Fix the {self.what}, or set {typed_key(self.on_error_key)}=end_episode to "
                    "end such episodes with reward 0 (counted as agent/errors)"
                )
        return self._trajectories(episodes, policy, params)

    # ------------------------------------------------------------------------------------ the episodes
    async def _run(self, gateway, rows: list[dict]) -> list[_Episode]:
        """Row ``i``'s episode in a session of row id ``i``, started in row order (each of ``concurrency``
        workers takes the next row when its episode ends), as the gateway's plan says."""
        episodes: list[_Episode] = [None] * len(rows)
        order = iter(range(len(rows)))

        async def worker() -> None:
            for i in order:  # (one iterator: the next row not yet started)
                episodes[i] = await self._episode(gateway, i, rows[i])

        await asyncio.gather(*[worker() for _ in range(min(self.concurrency, len(rows)))])
        return episodes

    async def _episode(self, gateway, i: int, row: dict) -> _Episode:
        import httpx
        import openai

        where = f"{self.what} {self.spec}, row {describe_row(row)}"
        key = gateway.start_session(row_id=i)
        # a connection of its own (a pool shared by many episodes checks each of its connections per request)
        transport = httpx.AsyncHTTPTransport(verify=False)  # (plain HTTP on 127.0.0.1)
        http = httpx.AsyncClient(transport=transport, trust_env=False, timeout=None)
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key, http_client=http, max_retries=0)
        ep, raised = _Episode(row, None), None
        try:
            ep.returned = await asyncio.wait_for(self._solve(client, row), self.timeout_s)
        except _Raised as e:
            raised = e.__cause__
            ep.fault = f"{where}: solve() raised {_described(e.__cause__)}"
        except (TimeoutError, asyncio.TimeoutError):  # (two classes before Python 3.11)
            ep.timed_out = True  # not a fault: the episode ends truncated (module docstring)
        ep.record = gateway.end_session(key)
        await http.aclose()
        # the gateway's refusal of a prompt with no room left (the openai client's error), last of the episode
        if ep.record.context_exceeded and getattr(raised, "code", None) == "context_length_exceeded":
            ep.fault = None  # the episode ended on the context limit: truncated
        if ep.fault is None:
            ep.fault = _bad_return(ep.returned, ep.record.reward, where)
        return ep

    async def _solve(self, client, row: dict) -> Any:
        """What ``solve`` returns; whatever it raises comes out as :class:`_Raised` (so that a TimeoutError of
        its own is told apart from ``asyncio.wait_for``'s at ``agent.timeout_s``)."""
        try:
            return await self.solve(client, row, **self.kwargs)
        except Exception as e:  # noqa: BLE001 (whatever the agent raises is reported, as on_error says)
            raise _Raised() from e

    # ------------------------------------------------------------------------------------ the batch
    def _trajectories(self, episodes: list[_Episode], policy: Policy, params: SamplingParams) -> Trajectories:
        """Each episode's main trajectory in row order, then (``train_forks``) its other trajectories."""
        main, extra = [], []
        for ep in episodes:
            trajs = ep.record.trajectories
            self._check_first_inputs(ep)
            made = [_trajectory(t, ep, self.limits, policy.tokenizer) for t in trajs]
            own = [r for r, t in zip(made, trajs) if not t.side]  # (the agent's: the main one is its last)
            failed = ep.fault is not None
            main.append(
                own[-1] if own else Trajectory(ep.row, [policy.tokenizer.eos_token_id], failed=failed)
            )
            main[-1].counts = main[-1].counts or _counts()
            main[-1].counts["forks"] = ep.record.forks
            main[-1].truncated |= ep.incomplete and bool(own)
            if self.train_forks:
                trained = made if self.side_calls == "train" else own
                extra += [r for r in trained if r is not main[-1]]
        t = stack(main + extra, policy.tokenizer.pad_token_id, policy.with_log_probs, False)
        if policy.value_head is not None:  # a shared-trunk critic's (the gateway's sampler has no value head)
            T = 1.0 if params.greedy else params.temperature
            t = dataclasses.replace(t, values=_values(policy, t, T))
        return dataclasses.replace(t, metrics=self._metrics(episodes, t, len(extra)))

    def _check_first_inputs(self, ep: _Episode) -> None:
        """A trajectory's first input (its first call's prompt) longer than ``max_prompt_len`` is an error (a
        skipped side call's is not read)."""
        read = [t for t in ep.record.trajectories if self.side_calls == "train" or not t.side]
        longest = max((len(t.segments[0].read_ids) for t in read), default=0)
        if self.max_prompt_len and longest > self.max_prompt_len:
            raise ShifuError(
                f"agent {self.spec}, row {describe_row(ep.row)}: the first input is {longest} tokens (the prompt "
                f"the gateway rendered for the call that starts a trajectory); it must be at most "
                f"{typed_key('data.max_prompt_len')}={self.max_prompt_len}: raise it, or send shorter first messages"
            )

    def _metrics(self, episodes: list[_Episode], t: Trajectories, fork_rows: int) -> dict[str, float]:
        """Means over the episodes (their main trajectories): see ``agent/*`` in :mod:`shifu.runs.metrics`."""
        n, B = max(1, len(episodes)), len(episodes)
        records = [ep.record for ep in episodes]
        lengths = [s.finish_reason == "length" for r in records for tr in r.trajectories for s in tr.segments]
        main = episode_metrics(
            {k: v[:B] for k, v in t.counts.items()},
            t.truncated[:B],
            t.failed[:B],
            t.returns[:B],
            "agent/",
            tools=True,
        )
        # (an episode ends on done only in an environment; agent/errors counts the episodes' faults, below)
        return {k: v for k, v in main.items() if k not in ("agent/terminated", "agent/errors")} | {
            "agent/calls": sum(r.calls for r in records) / n,
            "agent/forks": sum(r.forks for r in records) / n,
            "agent/side_calls": sum(r.side_calls for r in records) / n,
            "agent/context_exceeded": sum(r.context_exceeded for r in records) / n,
            "agent/fork_rows": fork_rows / n,
            "agent/length_calls": sum(lengths) / max(1, len(lengths)),
            "agent/no_calls": sum(r.calls == 0 for r in records) / n,
            "agent/errors": sum(ep.fault is not None for ep in episodes) / n,
            "agent/timeouts": sum(ep.timed_out for ep in episodes) / n,
        }


class _Raised(Exception):
    """``solve`` raised (the exception is the ``__cause__``)."""


def _described(e: BaseException) -> str:
    """What a fault says the agent raised: ``TimeoutError`` for its own timeout, else ``Name: message``."""
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "TimeoutError"
    return f"{type(e).__name__}: {e}"


def _bad_return(value: Any, session_reward: float | None, where: str) -> str | None:
    """The fault of what ``solve`` returned (None: a finite number, or None), and of a reward given twice."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return f"{where}: solve() returned {type(value).__name__} {shown}; it must return a finite number or None"
    if session_reward is not None:
        return (
            f"{where}: solve() returned {value} and also set the episode's reward {session_reward} (POST "
            "/rl/set_reward without a call): give it one way"
        )
    return None


def _counts() -> dict[str, int]:
    # every call says whether it called a tool (its finish reason): tool use is reported (tool_reports)
    return {"turns": 0, "tool_calls": 0, "observation_tokens": 0, "forks": 0, "tool_reports": 0}


def _trajectory(traj, ep: _Episode, limits: EpisodeLimits, tok) -> Trajectory:
    """A recorded trajectory cut to the budgets (module docstring), with the rewards of its calls and the
    episode's reward on its last sampled token (all 0 after a fault)."""
    segments, length = [], 0
    for k, seg in enumerate(traj.segments):
        grows = (len(seg.read_ids) if k else 0) + len(seg.sampled_ids)
        if k == limits.max_turns or length + grows > limits.max_total_tokens:
            break
        segments.append(seg)
        length += grows
    first, failed = segments[0], ep.fault is not None
    cut = len(segments) < len(traj.segments) or segments[-1].finish_reason == "length"
    out = Trajectory(
        ep.row, list(first.read_ids), [], cut, failed, _counts(), [("input", tok.decode(first.read_ids))]
    )
    for k, seg in enumerate(segments):
        if k:
            out.parts.append(Part(list(seg.read_ids), False))
            out.counts["observation_tokens"] += len(seg.read_ids)
            out.spans.append(("observation", tok.decode(seg.read_ids)))
        entropy = seg.entropy if seg.entropy is not None else [0.0] * len(seg.sampled_ids)
        reward = 0.0 if failed else float(seg.reward or 0.0)
        out.parts.append(Part(list(seg.sampled_ids), True, list(zip(seg.log_probs, entropy)), reward))
        out.counts["turns"] += 1
        out.counts["tool_reports"] += 1
        out.counts["tool_calls"] += seg.finish_reason == "tool_calls"
        out.spans.append(("policy", tok.decode(seg.sampled_ids)))
    out.parts[-1].reward += ep.reward
    return out


def _values(policy: Policy, t: Trajectories, temperature: float) -> torch.Tensor:
    """``(B, R)`` the shared-trunk critic's values of the trajectories (one forward: the gateway's sampler has no
    value head)."""
    device = next(policy.model.parameters()).device
    ids, mask = t.input_ids.to(device), t.attention_mask.to(device)
    values = policy_forward(
        policy.model, ids, mask, t.prompt_ids.shape[1], temperature, value_head=policy.value_head
    )
    return values[2].float().cpu()


def check_tokenizer(tok) -> None:
    """ConfigError unless the policy's tokenizer has a chat template (the gateway renders every call with it)."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"{typed_key('agent.factory')}: the policy's tokenizer has no chat template, and the gateway renders "
            "every call through one: start from a chat model, or save a Jinja chat_template in its "
            "tokenizer_config.json"
        )


def load_agent(spec: str) -> Callable[..., Any]:
    """The async function ``agent.factory`` names; ConfigError saying what to write otherwise."""
    fn = load_callable(spec, typed_key("agent.factory"), "async function")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"{typed_key('agent.factory')} '{spec}' is not an async function: write "
            "`async def solve(client, row): ...` (it awaits client.chat.completions.create)"
        )
    return fn

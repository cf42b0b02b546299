"""SFT demonstrations from an agent itself: the agent (``agent.factory``) runs its episodes against a teacher
through the gateway (:class:`shifu.gateway.teacher.TeacherGateway`), and each recorded trajectory becomes an SFT
row of exactly the ids the gateway rendered, trained on what the teacher answered.

So an agent written without the task in mind (its own tool names and argument schemas, its own system
prompt or none) starts RL from a policy that has seen its calls answered well, in its own format: the
first input as the gateway renders the agent's messages and tools, each answer as the policy would have
sampled it (the tool call in the model's call syntax, then end of turn, or up to the agent's stop string).

**A row** (the plain SFT format, read with ``data.chat_template=false``): ``prompt`` is the first call's prompt,
``response`` its segments in order, each call's answer trained and what was read between calls (tool results,
the template's headers) not; the last call's closing EOS is the one SFT appends. Each row is checked to encode
back to the recorded ids and trained positions (:func:`shifu.data.demonstrations.encode_demonstration`); a
trajectory that does not (a tokenizer that reads its decoded text otherwise), or whose last call did not end
with EOS, is left out and counted. Episodes that faulted or that the agent rewarded 0 are left out too: the
teacher's answers should earn the agent's reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Any

from shifu.data.demonstrations import encode_demonstration
from shifu.data.rows import validate_row
from shifu.envs.base import describe_row
from shifu.errors import ConfigError, DataError, ShifuError


@dataclasses.dataclass
class Demonstrations:
    """SFT ``rows`` made from ``episodes`` agent episodes, and how many were left out: ``faults`` (the agent
    raised or timed out; ``first_fault`` says how), ``unrewarded`` (the agent returned 0), ``unfinished``
    (a trajectory whose last call did not end with EOS), ``unencodable`` (its text does not encode back to its
    ids); ``capped``: episodes with a call cut at its token budget (an answer longer than the policy may write)."""

    rows: list[dict]
    episodes: int
    faults: int = 0
    unrewarded: int = 0
    unfinished: int = 0
    unencodable: int = 0
    capped: int = 0
    first_fault: str | None = None
    longest_prompt: int = 0  # the most ids of a row's prompt (its first call's), and of a whole row
    longest: int = 0

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"} | {
            "demonstrations": len(self.rows)
        }


def load_teacher(function: str | None, base_url: str | None, model: str | None, api_key: str | None = None):
    """``(teacher, its name)``: the function ``function`` names (``package.module:function``), or an
    OpenAI-compatible endpoint ``base_url`` serving ``model`` (:func:`shifu.gateway.teacher.endpoint_teacher`)."""
    from shifu.config.imports import load_callable
    from shifu.gateway.teacher import endpoint_teacher

    if bool(function) == bool(base_url):
        raise ConfigError(
            "teacher: give teacher.function (package.module:function (messages, tools) -> assistant message) or "
            f"teacher.base_url (an OpenAI-compatible endpoint, with teacher.model), one of them; got {function!r} "
            f"and {base_url!r} (or, in a quickstart, teacher.enabled=false: SFT on the task's own demonstrations)"
        )
    if base_url:
        if not model:
            raise ConfigError(
                f"teacher.base_url {base_url} needs teacher.model: the model the endpoint serves"
            )
        teacher = endpoint_teacher(base_url, model, api_key)
        return teacher, teacher.__name__
    return load_callable(function, "teacher.function"), function


def demonstrations(
    solve,
    rows: list[dict],
    model,
    tokenizer,
    teacher,
    who: str = "",
    kwargs: dict | None = None,
    max_tokens: int = 256,
    concurrency: int = 8,
    timeout_s: float | None = 300.0,
) -> Demonstrations:
    """One episode of the agent ``solve`` per row, against ``teacher`` (named ``who``) through a teacher gateway
    on the policy ``model`` (or its :class:`shifu.gateway.teacher.ModelShape`) and ``tokenizer``, each call's
    answer within ``max_tokens`` tokens; the recorded trajectories as SFT rows (module docstring)."""
    from shifu.gateway import Sampling
    from shifu.gateway.teacher import TeacherGateway

    gateway = TeacherGateway(
        teacher,
        model,
        tokenizer,
        who=who,
        token=secrets.token_urlsafe(18),
        sampling=Sampling(temperature=0.0, max_tokens=max_tokens),
    )
    with gateway:
        episodes = asyncio.run(_episodes(gateway, solve, rows, dict(kwargs or {}), concurrency, timeout_s))
    out = Demonstrations([], len(episodes))
    for row, record, reward, fault in episodes:
        segments = [s for t in record.trajectories for s in t.segments]
        out.capped += any(s.finish_reason == "length" for s in segments)
        if fault is not None:
            out.faults += 1
            out.first_fault = out.first_fault or f"row {describe_row(row)}: {fault}"
            continue
        if reward is not None and not reward > 0:
            out.unrewarded += 1
            continue
        for trajectory in record.trajectories:
            made = trajectory_row(trajectory, tokenizer)
            if isinstance(made, dict):
                out.rows.append(made)
                out.longest_prompt = max(out.longest_prompt, len(trajectory.segments[0].read_ids))
                out.longest = max(out.longest, len(trajectory.ids))
            elif made == "unfinished":
                out.unfinished += 1
            else:
                out.unencodable += 1
    return out


async def _episodes(gateway, solve, rows, kwargs, concurrency, timeout_s) -> list[tuple]:
    """``(row, recorded session, reward, fault)`` per row: ``solve`` run with a client on a session of its own."""
    import httpx
    import openai

    gate = asyncio.Semaphore(concurrency)

    async def episode(row: dict) -> tuple:
        async with gate:
            key = gateway.start_session()
            http = httpx.AsyncClient(trust_env=False, timeout=None)
            client = openai.AsyncOpenAI(
                base_url=gateway.base_url, api_key=key, http_client=http, max_retries=0
            )
            returned, fault = None, None
            try:
                returned = await asyncio.wait_for(solve(client, row, **kwargs), timeout_s)
            except asyncio.TimeoutError:
                fault = f"solve() took longer than {timeout_s} s"
            except Exception as e:  # noqa: BLE001 (counted, the first one reported)
                fault = f"solve() raised {type(e).__name__}: {e}"
            record = gateway.end_session(key)
            await http.aclose()
            reward = returned if returned is not None else record.reward
            return row, record, (None if reward is None else float(reward)), fault

    return await asyncio.gather(*[episode(row) for row in rows])


def trajectory_row(trajectory, tokenizer) -> dict | str:
    """The SFT row of a recorded trajectory (module docstring), or why there is none: ``"unfinished"`` (its last
    call did not end with EOS) or ``"unencodable"`` (the row does not encode back to the recorded ids)."""
    segments = trajectory.segments
    eos = tokenizer.eos_token_id
    last = segments[-1].sampled_ids
    if not last or last[-1] != eos:
        return "unfinished"

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    response = []
    for k, seg in enumerate(segments):
        if k:
            response.append({"text": text(seg.read_ids), "train": False})
        sampled = seg.sampled_ids[:-1] if k == len(segments) - 1 else seg.sampled_ids  # (SFT appends EOS)
        response.append({"text": text(sampled)})
    row = {"prompt": text(segments[0].read_ids), "response": response}
    trained = [
        m
        for k, s in enumerate(segments)
        for m in ([False] * len(s.read_ids) if k else []) + [True] * len(s.sampled_ids)
    ]
    try:
        prompt, ids, mask = encode_demonstration(
            tokenizer, validate_row(row, "sft", ("teacher", None)), False
        )
    except (DataError, ValueError):
        return "unencodable"
    if prompt + ids != trajectory.ids or mask != trained:
        return "unencodable"
    return row


def check_demonstrations(made: Demonstrations, agent: str, teacher: str) -> None:
    """ShifuError unless some demonstrations were made, saying why none were."""
    if made.rows:
        return
    s = made.summary()
    why = f" (the first fault: {made.first_fault})" if made.first_fault else ""
    capped = (
        f" {made.capped} episodes had a call cut at its token budget: give the policy's calls more tokens "
        "(ppo.generation.max_new_tokens)."
        if made.capped
        else ""
    )
    raise ShifuError(
        f"the agent {agent} made no SFT demonstrations with the teacher {teacher}: of {made.episodes} episodes, "
        f"{s['faults']} faulted{why}, {s['unrewarded']} were rewarded 0, and {s['unfinished']} trajectories did not "
        f"end with EOS, {s['unencodable']} did not encode back to their ids.{capped} Check the teacher's answers "
        "against the agent, or set teacher.enabled=false to train SFT on the task's own demonstrations"
    )

"""A gateway that answers from a teacher instead of sampling the policy: what an agent's calls look like when
they are answered well, recorded token for token as the policy's would be (:mod:`shifu.rollout.teacher` makes
SFT demonstrations of them).

A **teacher** is a function ``teacher(messages, tools) -> message``: a request's messages (OpenAI-style dicts
as :mod:`shifu.gateway.protocol` normalises them) and its offered tools (None: none), in; an assistant message,
out: ``{"content": str | None, "tool_calls": [{"function": {"name", "arguments"}}, ...]}`` (arguments an
object or a JSON string; ``tool_calls`` may be left out). :func:`endpoint_teacher` makes one of any
OpenAI-compatible endpoint.

:class:`TeacherEngine` stands where the gateway's sampler stands (the ``run`` / ``joins`` seam of
:class:`shifu.gateway.engine.Engine`): each choice is the teacher's answer encoded as the policy would have
sampled it, its content, then its calls in the model's own call syntax
(:func:`shifu.models.tool_calls.tool_call_text`), then EOS; cut after the request's earliest stop string when
the text holds one (the policy's turn ends there, without EOS), and at the call's token budget. Its log-probs
are 0 (the teacher's choice is certain). Everything else is the gateway's own: the prompt rendering, the answer
and its parsed ``tool_calls``, the sessions that record each call.

The engine reads the request a job's prompt came from: :class:`TeacherGateway` serves the gateway's app behind
an ASGI layer that notes each chat completion's messages and tools under the prompt ids the gateway renders for
it (:func:`shifu.gateway.completions.prompt_ids`, with a copy of the tokenizer: the gateway's own is used on its
encoding thread).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

from shifu.errors import ShifuError
from shifu.gateway.chat.translate import parse_chat_request
from shifu.gateway.completions import offered_tools, prompt_ids
from shifu.gateway.engine import Choice, Job
from shifu.gateway.gateway import Gateway
from shifu.models.tool_calls import tool_call_text

Teacher = Callable[[list[dict], "list[dict] | None"], dict]


class TeacherError(ShifuError):
    """The teacher failed, or answered with something that is not an assistant message."""


def answer_text(message: dict, syntax: str) -> str:
    """The text of an assistant ``message`` as the policy writes it: its content, then (after a newline) its
    tool calls in ``syntax``, as the gateway writes an assistant message of the history for a template without
    tools."""
    content = message.get("content") or ""
    calls = tool_call_text(message["tool_calls"], syntax) if message.get("tool_calls") else ""
    return f"{content}\n{calls}" if content and calls else content or calls


def check_answer(message: object, who: str) -> dict:
    """``message`` if it is an assistant message (module docstring), else a :class:`TeacherError` naming ``who``."""
    shape = 'it must return {"content": str | None, "tool_calls": [{"function": {"name": ..., "arguments": ...}}]}'
    if not isinstance(message, dict):
        raise TeacherError(f"the teacher {who} returned {type(message).__name__}; {shape}")
    content, calls = message.get("content"), message.get("tool_calls") or []
    if content is not None and not isinstance(content, str):
        raise TeacherError(f"the teacher {who} returned content of type {type(content).__name__}; {shape}")
    for c in calls if isinstance(calls, list) else [None]:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise TeacherError(f"the teacher {who} returned the tool call {c!r}; {shape}")
    return {"role": "assistant", "content": content, "tool_calls": calls}


class TeacherEngine:
    """The gateway's sampler replaced by ``teacher`` (module docstring): ``positions`` and ``end_id`` (the EOS
    that ends a turn) as the policy's. Jobs are answered one at a time, each from the request :meth:`expect`
    noted under its prompt ids."""

    def __init__(self, teacher: Teacher, tokenizer, syntax: str, positions: int | None, who: str = ""):
        self.teacher, self.tok, self.syntax, self.positions = teacher, tokenizer, syntax, positions
        self.who = who or getattr(teacher, "__name__", repr(teacher))
        self.end_ids = [tokenizer.eos_token_id]
        self.version, self.calls, self.last_seconds = 0, 0, 0.0
        self._lock = threading.Lock()
        self._requests: dict[tuple[int, ...], deque] = defaultdict(deque)

    def set_policy(self, model, version: int) -> None:
        self.version = int(version)

    def prefix_counters(self) -> dict[str, float]:
        return {}  # nothing is prefilled: no prefix cache

    def kv_counters(self) -> dict[str, float]:
        return {}  # nothing is decoded: no block pool

    def too_big(self, job: Job) -> str | None:
        return None

    def expect(self, ids: list[int], messages: list[dict], tools: list[dict] | None) -> None:
        """Note the request whose prompt renders to ``ids`` (answered in arrival order per prompt)."""
        with self._lock:
            self._requests[tuple(ids)].append((messages, tools))

    def joins(self, jobs: list[Job], job: Job) -> bool:
        return False  # one request per call: the teacher answers each on its own

    def run(self, jobs: list[Job]) -> list[list[Choice]]:
        t0 = time.perf_counter()
        out = [self._answer(job) for job in jobs]
        self.calls += 1
        self.last_seconds = time.perf_counter() - t0
        return out

    def _answer(self, job: Job) -> list[Choice]:
        with self._lock:
            waiting = self._requests.get(tuple(job.prompt_ids))
            if not waiting:
                raise TeacherError(
                    "a completion reached the teacher without its request (only /v1/chat/completions)"
                )
            messages, tools = waiting.popleft()
            if not waiting:
                del self._requests[tuple(job.prompt_ids)]
        try:
            message = self.teacher(messages, tools)
        except Exception as e:  # noqa: BLE001 (named, with the teacher, in the error the agent gets back)
            raise TeacherError(f"the teacher {self.who} raised {type(e).__name__}: {e}") from e
        text = answer_text(check_answer(message, self.who), self.syntax)
        return [self._choice(text, job) for _ in range(job.n)]

    def _choice(self, text: str, job: Job) -> Choice:
        """``text`` as sampled ids: cut after the earliest stop string (ended ``"stop"``), else EOS appended
        (``"eos"``); then at most the job's budget (``"length"``)."""
        hits = [(text.find(s) + len(s), s) for s in job.stops if s and s in text]
        end, hit = min(hits) if hits else (None, None)
        ids = self.tok(text[:end], add_special_tokens=False)["input_ids"]
        ended = "stop" if hit is not None else "eos"
        if hit is None:
            ids = [*ids, self.tok.eos_token_id]
        if len(ids) > job.budget:
            ids, ended, hit = ids[: job.budget], "length", None
        top = [[(t, 0.0)] for t in ids] if job.top_logprobs else None
        return Choice(ids, [0.0] * len(ids), ended, hit, top, self.version, [0.0] * len(ids))


class _NoteRequests:
    """ASGI layer in front of the gateway's app: each ``POST /v1/chat/completions`` body is read, noted with
    the engine under the prompt ids it renders to (``note``), then passed on unchanged."""

    def __init__(self, app, note: Callable[[bytes, str | None], None]):
        self.app, self.note = app, note

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        received, body = [], b""
        while True:
            message = await receive()
            received.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        headers = dict(scope.get("headers") or [])
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        self.note(body, key.strip() if scheme.lower() == "bearer" else None)
        pending = deque(received)

        async def replay():
            return pending.popleft() if pending else await receive()

        await self.app(scope, replay, send)


class TeacherGateway(Gateway):
    """A :class:`Gateway` (recording by default) whose completions the teacher answers (module docstring). ``model``: the
    policy, or its shape alone (:class:`ModelShape`): only its positions are read, to bound each call as the
    policy's would be. ``who`` names the teacher in errors. Other arguments as :class:`Gateway`'s."""

    def __init__(self, teacher: Teacher, model, tokenizer, who: str = "", recording: bool = True, **kwargs):
        super().__init__(model, tokenizer, recording=recording, **kwargs)
        self.engine = TeacherEngine(teacher, tokenizer, self.format.syntax, self.engine.positions, who)
        self.max_wait_s = 0.0  # nothing to batch: each call is answered as it comes
        self._note_tok = copy.deepcopy(tokenizer)  # (the gateway's own is busy on its encoding thread)

    def app(self):
        return _NoteRequests(super().app(), self._note)

    def _note(self, body: bytes, key: str | None) -> None:
        """The request's prompt ids, as the gateway will render them, noted with its messages and tools; a
        request the gateway will refuse is left to it."""
        try:
            req = parse_chat_request(json.loads(body))
            ids = prompt_ids(self._note_tok, req, self.format, self.memory_of(key))
        except Exception:  # noqa: BLE001 (the gateway answers the same request with its own error)
            return
        self.engine.expect(ids, req.messages, offered_tools(req))


class ModelShape:
    """What a gateway reads of a model, without its weights: the ``config`` (positions) and
    ``generation_config`` (end-of-turn ids) of the model directory ``path``."""

    def __init__(self, path: str):
        from transformers import AutoConfig, GenerationConfig

        self.config = AutoConfig.from_pretrained(path, local_files_only=True)
        try:
            self.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # (a directory without generation_config.json)
            self.generation_config = None

    def eval(self) -> ModelShape:
        return self


def endpoint_teacher(
    base_url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0
) -> Teacher:
    """A teacher that asks an OpenAI-compatible endpoint (``base_url`` such as ``http://host:8000/v1``, the
    served ``model``, greedy): the request's messages and tools sent as they came, the first choice's message
    returned."""
    import httpx

    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def teacher(messages: list[dict], tools: list[dict] | None) -> dict:
        body = {"model": model, "messages": messages, "temperature": 0} | ({"tools": tools} if tools else {})
        r = httpx.post(url, json=body, headers=headers, timeout=timeout_s, trust_env=False)
        if r.status_code != 200:
            raise TeacherError(f"{url} answered {r.status_code}: {r.text[:300]}")
        return r.json()["choices"][0]["message"]

    teacher.__name__ = f"endpoint {url} ({model})"
    return teacher

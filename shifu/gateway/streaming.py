"""Streamed answers, for every dialect: a completion's events as the sampler decodes them
(:func:`stream_events`), which a dialect sends in its own shape (the chat dialect's chunks:
:mod:`shifu.gateway.chat.stream`). Streaming is a way of sending an answer, not a second sampler: the job is
the one a non-streamed request makes, merged and sampled the same way, and the finished choices go through the
dialect's own answer and recording, so a streamed and a non-streamed call with the same seed sample, record and
answer the same tokens.

**Interface for a dialect.** Build the request's :class:`~shifu.gateway.engine.Job` as for a plain answer, one
:class:`Withheld` per choice (what its text may not show yet), and an async ``resolve(choices) ->
list[Outcome]`` that does what the plain answer does with the sampled
:class:`~shifu.gateway.engine.Choice` list (parse it, remember it, record it) and returns each choice's
:class:`Outcome`. Then::

    async for event in stream_events(queue, job, withheld, resolve):
        ...  # TextDelta, ToolCall, Finish, then one Usage

- :class:`TextDelta` ``(choice, text, tokens)``: content as it is decoded; the deltas of a choice join into its
  outcome's content exactly (text that may still turn out to be a stop string or a tool call's opening is held
  back until that is known), and ``tokens`` are the sampled ids (:class:`~shifu.gateway.tokens.Token`) whose
  text the delta releases (the rule under **Tokens**);
- :class:`ToolCall` ``(choice, index, call)``: a complete call, ``{"id", "type": "function", "function":
  {"name", "arguments"}}``, once the choice is sampled;
- :class:`Finish` ``(choice, outcome, tokens)``: the choice's end (its :class:`Outcome`, with the finish reason)
  and the sampled ids no delta carried;
- :class:`Usage` ``(prompt_tokens, completion_tokens)``: last, once.

**Tokens.** Every sampled id of a choice goes out once, in order, so that the tokens of its deltas and its
finish join into all it sampled (what its answer's ``logprobs`` and ``token_ids`` list and a session records).
A delta ends where an id's text ends (a part of an id's text that may show waits for the rest of it) and
carries the ids whose text it releases; an id that adds no text by itself (the first bytes of a multi-byte
character, a special token) goes with the next id that does, and so with the text it begins.
The last delta, sent once the answer is known, also carries the ids whose text it shows only in part (one a
stop string cuts). Ids whose text never shows go with the finish: the ending EOS or end-of-turn id, a stop
string's ids, a tool call's (whose call goes out whole as :class:`ToolCall`), all of a forced call's, and an
incomplete character's at the very end.

Text is handed from the sampler thread to the event loop with one wake-up for whatever piled up meanwhile:
each step's text goes out as soon as the loop runs, and a loop that falls behind sends what came since in one
delta instead of falling further behind. ``resolve`` runs to its end even when the client goes away
mid-stream (the call is recorded as a plain one is); an exception it or the sampler raises comes out of the
iteration after the deltas already sent.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from shifu.gateway.engine import Choice, Job
from shifu.gateway.protocol import ChatRequest
from shifu.gateway.tokens import Token
from shifu.generation.stops import cut_at_stop
from shifu.models.tool_calls import ToolFormat

log = logging.getLogger(__name__)
HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_RUNNING: set[asyncio.Task] = set()  # resolutions outliving their stream (a client that went away)


@dataclass
class Outcome:
    """What a dialect made of one sampled choice: its ``content`` (None: none), ``tool_calls`` and
    ``finish_reason`` (``"stop"``, ``"length"`` or ``"tool_calls"``)."""

    content: str | None
    tool_calls: list[dict]
    finish_reason: str


@dataclass
class TextDelta:
    choice: int
    text: str
    tokens: list[Token] = field(default_factory=list)


@dataclass
class ToolCall:
    choice: int
    index: int
    call: dict


@dataclass
class Finish:
    choice: int
    outcome: Outcome
    tokens: list[Token] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int


Event = TextDelta | ToolCall | Finish | Usage


def _held_suffix(text: str, marks: list[str]) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of one of ``marks``."""
    longest = 0
    for mark in marks:
        for k in range(min(len(mark) - 1, len(text)), longest, -1):
            if text.endswith(mark[:k]):
                longest = k
                break
    return longest


@dataclass
class Withheld:
    """What a choice's streamed text may not show yet, so that the deltas join into the answer's content:
    the ``stops`` (content ends before the earliest; a beginning of one at the end waits), the tool-call
    ``syntax`` of offered tools (None: none offered; a call's opening and the text after it never stream,
    and in the Hermes syntax, where the content before a call is stripped, neither does trailing whitespace
    nor a text that starts with whitespace) and ``forced`` (the text is the rest of a forced call: none
    streams)."""

    stops: list[str] = field(default_factory=list)
    syntax: str | None = None
    forced: bool = False

    def visible(self, text: str) -> str:
        """The part of ``text`` (the choice's text so far) sure to begin its content."""
        if self.forced:
            return ""
        text = cut_at_stop(text, self.stops)
        text = text[: len(text) - _held_suffix(text, self.stops)]
        if self.syntax == "hermes":
            if text[:1].isspace():
                return ""
            at = text.find(HERMES_OPEN)
            text = text[:at] if at >= 0 else text[: len(text) - _held_suffix(text, [HERMES_OPEN])]
            return text.rstrip()
        if self.syntax == "llama3_json":  # a completion that is calls is JSON from its first character
            body = text.lstrip()
            if not body or body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body):
                return ""
        return text


class _Ids:
    """A choice's sampled ids as they come, each with the span of the choice's text that it (with the ids before
    it that added none) ends, handed out once by :meth:`ending` / :meth:`beginning` / :meth:`rest` (the rule under
    **Tokens** in the module docstring)."""

    def __init__(self):
        self.tokens: list[Token] = []
        self.spans: list[tuple[int, int]] = []  # (start, end) in the choice's text, per token
        self.waiting: list[Token] = []  # ids that added no text yet: they go with the next that does
        self.out = 0  # tokens handed out

    def add(self, token: Token, start: int, end: int) -> None:
        self.waiting.append(token)
        if end > start:
            self.tokens += self.waiting
            self.spans += [(start, end)] * len(self.waiting)
            self.waiting = []

    def _take(self, keep: Callable[[tuple[int, int]], bool]) -> list[Token]:
        at = self.out
        while at < len(self.tokens) and keep(self.spans[at]):
            at += 1
        taken, self.out = self.tokens[self.out : at], at
        return taken

    def boundary(self, length: int, floor: int) -> int:
        """The longest text of at most ``length`` characters that ends where an id's text ends (at least
        ``floor``: the text handed out)."""
        at, end = self.out, floor
        while at < len(self.tokens) and self.spans[at][1] <= length:
            end, at = self.spans[at][1], at + 1
        return end

    def ending(self, length: int) -> list[Token]:
        """The ids not handed out whose text ends within the first ``length`` characters."""
        return self._take(lambda span: span[1] <= length)

    def beginning(self, length: int) -> list[Token]:
        """The ids not handed out whose text begins within the first ``length`` characters."""
        return self._take(lambda span: span[0] < length)

    def rest(self) -> list[Token]:
        taken, self.out = self.tokens[self.out :] + self.waiting, len(self.tokens)
        self.waiting = []
        return taken


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def withheld(req: ChatRequest, fmt: ToolFormat, offered: bool) -> list[Withheld]:
    """What each choice's streamed text holds back (:class:`~shifu.gateway.streaming.Withheld`)."""
    return [Withheld(list(req.stop), fmt.syntax if offered else None, req.forced) for _ in range(req.n)]


def outcomes(body: dict) -> list[Outcome]:
    """Each choice of a chat completion answer as an :class:`~shifu.gateway.streaming.Outcome`."""
    return [
        Outcome(c["message"]["content"], c["message"].get("tool_calls") or [], c["finish_reason"])
        for c in body["choices"]
    ]


async def stream_events(
    queue,
    job: Job,
    withheld: list[Withheld],
    resolve: Callable[[list[Choice]], Awaitable[list[Outcome]]],
) -> AsyncIterator[Event]:
    """The events of ``job``'s choices (module docstring); ``queue``: the gateway's
    :class:`~shifu.http.batching.BatchQueue` of sampler calls."""
    loop = asyncio.get_running_loop()
    handed: list[tuple[int, Token, str]] = []  # (choice, token, text) from the sampler thread, not yet taken
    lock, wake, waking = threading.Lock(), asyncio.Event(), [False]

    def on_text(choice: int, token: Token, text: str) -> None:  # on the sampler thread
        with lock:
            handed.append((choice, token, text))
            if waking[0]:  # the loop is woken already and takes this too: one wake-up for what piled up
                return
            waking[0] = True
        loop.call_soon_threadsafe(wake.set)

    job.on_text = on_text

    async def sampled() -> tuple[list[Choice], list[Outcome]]:
        choices = await queue.submit(job)
        return choices, await resolve(choices)

    done = loop.create_task(sampled())
    _RUNNING.add(done)
    # the sampler thread hands its text over before the call's result reaches the loop: once done, all is here
    done.add_done_callback(lambda task: (_RUNNING.discard(task), wake.set()))
    texts, sent, ids = [""] * job.n, [""] * job.n, [_Ids() for _ in range(job.n)]
    while not done.done() or handed:
        await wake.wait()
        wake.clear()
        with lock:
            taken, handed[:], waking[0] = handed[:], [], False
        for choice, token, piece in taken:
            ids[choice].add(token, len(texts[choice]), len(texts[choice]) + len(piece))
            texts[choice] += piece
        for choice in sorted({c for c, _, piece in taken if piece}):
            shown = withheld[choice].visible(texts[choice])
            shown = shown[: ids[choice].boundary(len(shown), len(sent[choice]))]
            if len(shown) > len(sent[choice]) and shown.startswith(sent[choice]):
                yield TextDelta(choice, shown[len(sent[choice]) :], ids[choice].ending(len(shown)))
                sent[choice] = shown
    choices, outcomes = done.result()
    for i, outcome in enumerate(outcomes):
        content = outcome.content or ""
        if content.startswith(sent[i]):
            if len(content) > len(sent[i]):
                yield TextDelta(i, content[len(sent[i]) :], ids[i].beginning(len(content)))
        else:  # the held-back rules keep this from happening; say so where it would
            log.warning("streamed text %r is not the start of the answer's content %r", sent[i], content)
        for k, call in enumerate(outcome.tool_calls):
            yield ToolCall(i, k, call)
        yield Finish(i, outcome, ids[i].rest())
    yield Usage(len(job.prompt_ids), sum(len(c.ids) for c in choices))

"""A chat completion streamed (``stream: true``): the completion's events (:mod:`shifu.gateway.streaming`) as
OpenAI ``chat.completion.chunk`` objects over Server-Sent Events, ``data: {chunk}`` each, then ``data: [DONE]``.

Per choice (``index``): a first chunk with ``delta.role``, then ``delta.content`` as the text is decoded,
each tool call once it is complete in one ``delta.tool_calls`` entry (``index``, ``id``, ``type``,
``function.name`` and the whole ``function.arguments``), then a chunk with ``finish_reason`` (and with
``token_ids`` when asked, every sampled id of the choice). With ``logprobs``, as OpenAI's chunks do, each
content delta carries ``logprobs.content`` for the sampled ids whose text it releases (the rule:
:mod:`shifu.gateway.streaming`'s **Tokens**: an id that adds no text by itself goes with the next one's) and
the ``finish_reason`` chunk the entries of the ids whose text never showed (the ending EOS or end-of-turn id, a
stop string's, a tool call's), so that the chunks' entries join into the answer's ``logprobs.content``, one
per sampled id, with the very log-probs a session records. With
``stream_options.include_usage`` every chunk has ``usage: null`` and a last chunk has ``choices: []``, the
``usage`` and shifu's ``shifu`` field. The non-streamed answer is built, remembered and recorded as for
``stream: false`` (:func:`shifu.gateway.completions.answer`); the streamed deltas join into its message.
A failure after the first chunk is sent as ``data: {"error": {...}}`` (what OpenAI's clients raise).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from shifu.gateway.completions import logprob_entry
from shifu.gateway.protocol import ChatRequest
from shifu.gateway.streaming import Finish, TextDelta, ToolCall, Usage
from shifu.gateway.tokens import Token
from shifu.http.requests import RequestError


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(e: Exception) -> dict:
    if isinstance(e, RequestError):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return {"message": e.message, "type": kind, "param": e.field, "code": e.code}
    message = f"the gateway failed ({type(e).__name__}: {e})"
    return {"message": message, "type": "server_error", "param": None, "code": None}


def _rest(answered: dict | None, sent: int) -> dict | None:
    """The finish chunk's ``logprobs``: the answer's entries after the ``sent`` ones the deltas carried (the
    entries of the ids whose text never showed: :class:`~shifu.gateway.streaming.Finish`'s tokens). Taken from
    the answer itself, so the chunks join into it whatever the sampler told the stream: a sampler that tells
    no tokens as it goes (a teacher's, :mod:`shifu.gateway.teacher`) leaves them all to this chunk."""
    if answered is None:
        return None
    return {"content": answered["content"][sent:], "refusal": None}


async def chat_chunks(
    events: AsyncIterator, req: ChatRequest, completion_id: str, model: str, answered: dict, prompt: list[int]
) -> AsyncIterator[str]:
    """The SSE text of a streamed chat completion (module docstring). ``events``:
    :func:`~shifu.gateway.streaming.stream_events` of the request's job, whose ``resolve`` puts the finished
    answer's body in ``answered["body"]``; ``prompt``: the prompt's ids (``prompt_token_ids``)."""
    created = int(time.time())
    usage = {"usage": None} if req.include_usage else {}

    def chunk(choices: list[dict], **extra) -> str:
        head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        return _sse(head | {"system_fingerprint": None, "choices": choices} | usage | extra)

    def choice(i: int, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish} | extra

    def logprobs(tokens: list[Token]) -> dict | None:
        if not req.logprobs:
            return None
        entries = [
            logprob_entry(t.text, t.log_prob, t.top and [(a, lp) for _, a, lp in t.top]) for t in tokens
        ]
        return {"content": entries, "refusal": None}

    first = {"prompt_token_ids": prompt} if req.return_token_ids else {}
    for i in range(req.n):
        yield chunk([choice(i, {"role": "assistant"})], **first)
    texted, entries_sent = [False] * req.n, [0] * req.n
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                texted[ev.choice] = True
                entries_sent[ev.choice] += len(ev.tokens)
                yield chunk([choice(ev.choice, {"content": ev.text}, logprobs=logprobs(ev.tokens))])
            elif isinstance(ev, ToolCall):
                yield chunk([choice(ev.choice, {"tool_calls": [{"index": ev.index} | ev.call]})])
            elif isinstance(ev, Finish):
                if ev.outcome.content == "" and not texted[ev.choice]:  # an empty answer: content ""
                    yield chunk([choice(ev.choice, {"content": ""})])
                item = answered["body"]["choices"][ev.choice]
                extra = {"logprobs": _rest(item["logprobs"], entries_sent[ev.choice])} | (
                    {"token_ids": item["token_ids"]} if "token_ids" in item else {}
                )
                yield chunk([choice(ev.choice, {}, ev.outcome.finish_reason) | extra])
            elif isinstance(ev, Usage) and req.include_usage:
                body = answered["body"]
                yield chunk([], usage=body["usage"], shifu=body["shifu"])
    except Exception as e:  # the status line is sent: the failure goes in the stream
        yield _sse({"error": _error(e)})
        return
    yield "data: [DONE]\n\n"

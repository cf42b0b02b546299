"""A message streamed (``stream: true``): the completion's events (:mod:`shifu.gateway.streaming`) as the
Messages API's Server-Sent Events, ``event: <type>`` and ``data: {"type", ...}`` each.

``message_start`` (the message with no content, ``stop_reason: null`` and the prompt's ``input_tokens``); the
text block, opened at its first text: ``content_block_start``, ``content_block_delta`` (``text_delta``) as the
text is decoded, ``content_block_stop``; each tool call once it is complete: ``content_block_start`` (a
``tool_use`` block with ``input: {}``), one ``content_block_delta`` (``input_json_delta``: the whole input as
JSON), ``content_block_stop``; then ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage.output_tokens``)
and ``message_stop``. The blocks are those of the non-streamed answer. A failure after the first event is sent
as an ``error`` event in Anthropic's shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from shifu.gateway.streaming import Finish, TextDelta, ToolCall
from shifu.http.requests import RequestError


def _event(kind: str, **fields) -> str:
    data = {"type": kind} | fields
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error(e: Exception) -> dict:
    if isinstance(e, RequestError) and e.status < 500:
        return {"type": "invalid_request_error", "message": e.message}
    return {"type": "api_error", "message": f"the gateway failed ({type(e).__name__}: {e})"}


async def message_events(events: AsyncIterator, head: dict, answered: dict) -> AsyncIterator[str]:
    """The SSE text of a streamed message (module docstring). ``events``:
    :func:`~shifu.gateway.streaming.stream_events` of the request's job, whose ``resolve`` puts the finished
    answer in ``answered["body"]``; ``head``: the message's fields known before sampling."""
    yield _event("message_start", message=head)
    opened = closed = False
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                if not opened:
                    opened = True
                    yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ToolCall | Finish):
                if opened and not closed:
                    closed = True
                    yield _event("content_block_stop", index=0)
                if isinstance(ev, ToolCall):
                    index = ev.index + opened
                    block = answered["body"]["content"][index]
                    yield _event("content_block_start", index=index, content_block=block | {"input": {}})
                    partial = json.dumps(block["input"], ensure_ascii=False)
                    yield _event(
                        "content_block_delta",
                        index=index,
                        delta={"type": "input_json_delta", "partial_json": partial},
                    )
                    yield _event("content_block_stop", index=index)
        body = answered["body"]
        delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
        yield _event("message_delta", delta=delta, usage={"output_tokens": body["usage"]["output_tokens"]})
        yield _event("message_stop")
    except Exception as e:  # the status line is sent: the failure goes in the stream
        yield _event("error", error=_error(e))

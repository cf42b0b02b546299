"""A Response streamed (``stream: true``): the completion's events (:mod:`shifu.gateway.streaming`) as the
Responses API's Server-Sent Events, ``event: <type>`` and ``data: {"type", "sequence_number", ...}`` each.

``response.created`` and ``response.in_progress`` (the response with ``status: "in_progress"`` and no output);
the message item, opened at its first text: ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` as the text is decoded, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; each function call once it is complete:
``response.output_item.added`` (arguments empty), ``response.function_call_arguments.delta`` (all of them),
``response.function_call_arguments.done``, ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` at the token budget) with the whole response, the one a non-streamed call answers. A
failure after the first event is sent as an ``error`` event.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator

from shifu.gateway.streaming import Finish, TextDelta, ToolCall
from shifu.http.requests import RequestError


def in_progress(head: dict) -> dict:
    """The response as ``response.created`` shows it: in progress, no output, no usage yet."""
    return head | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}


def _error(e: Exception) -> dict:
    if isinstance(e, RequestError):
        return {"code": e.code, "message": e.message, "param": e.field}
    return {"code": "server_error", "message": f"the gateway failed ({type(e).__name__}: {e})", "param": None}


class _Writer:
    """The SSE text of one streamed response, its sequence numbers and which items it has opened."""

    def __init__(self, message_id: str):
        self.seq = itertools.count()
        self.message_id, self.opened, self.closed, self.text = message_id, False, False, ""

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(self.seq)} | fields
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def item(self, status: str) -> dict:
        content = [self.part()] if status == "completed" else []
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def open(self) -> list[str]:
        self.opened = True
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=0, item=self.item("in_progress")),
            self.event("response.content_part.added", **at, part=self.part()),
        ]

    def delta(self, text: str) -> str:
        self.text += text
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return self.event("response.output_text.delta", **at, delta=text, logprobs=[])

    def close(self) -> list[str]:
        self.closed = True
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_text.done", **at, text=self.text, logprobs=[]),
            self.event("response.content_part.done", **at, part=self.part()),
            self.event("response.output_item.done", output_index=0, item=self.item("completed")),
        ]

    def call(self, index: int, item: dict) -> list[str]:
        at = {"item_id": item["id"], "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=item | {"arguments": ""}),
            self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


async def response_events(
    events: AsyncIterator, head: dict, message_id: str, answered: dict
) -> AsyncIterator[str]:
    """The SSE text of a streamed response (module docstring). ``events``:
    :func:`~shifu.gateway.streaming.stream_events` of the request's job, whose ``resolve`` puts the finished
    response in ``answered["body"]``; ``head``: the response's fields known before sampling; ``message_id``:
    its message item's id."""
    out = _Writer(message_id)
    yield out.event("response.created", response=in_progress(head))
    yield out.event("response.in_progress", response=in_progress(head))
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                for text in out.open() if not out.opened else []:
                    yield text
                yield out.delta(ev.text)
            elif isinstance(ev, ToolCall | Finish):
                body = answered["body"]
                has_message = bool(body["output"]) and body["output"][0]["type"] == "message"
                if has_message and not out.opened:  # an empty answer: its message item, with no text
                    for text in out.open():
                        yield text
                if out.opened and not out.closed:
                    for text in out.close():
                        yield text
                if isinstance(ev, ToolCall):
                    index = ev.index + has_message
                    for text in out.call(index, body["output"][index]):
                        yield text
        body = answered["body"]
        yield out.event(f"response.{body['status']}", response=body)
    except Exception as e:  # the status line is sent: the failure goes in the stream
        yield out.event("error", **_error(e))

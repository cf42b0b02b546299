"""A Responses request into the engine's :class:`~shifu.gateway.protocol.ChatRequest`, and the engine's chat
answer back into a :class:`~shifu.gateway.responses.protocol.Response`.

**Into chat messages.** ``instructions`` is the first, system message; then the conversation of
``previous_response_id`` (:class:`Stored`: its input and its output, without its instructions, as OpenAI
does); then ``input``: a string is a user message, a message item is a message of its role (its text parts
joined), ``function_call`` items are the ``tool_calls`` of one assistant message (the message item just
before them when it is the assistant's), and a ``function_call_output`` is a tool message. A call keeps its
``call_id`` as the chat call's id, so the engine's memory of what it sampled finds it again.

**Back.** The chat message's text is one ``message`` item (left out when the answer is only calls), each
tool call a ``function_call`` item with its ``call_id``; ``finish_reason: "length"`` is ``status:
"incomplete"`` with ``incomplete_details.reason: "max_output_tokens"``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from shifu.gateway.completions import forced_choice
from shifu.gateway.protocol import ChatRequest
from shifu.gateway.responses.protocol import (
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesJsonObjectFormat,
    ResponsesJsonSchemaFormat,
    ResponsesMessageItem,
    ResponsesNamedToolChoice,
    ResponsesRequest,
)
from shifu.http.requests import RequestError


class Stored:
    """The conversations of recent responses (their chat messages, input and output, without instructions),
    by response id and the key that made them, for ``previous_response_id``. Bounded: the oldest go first; a
    recording session's go when it ends (:meth:`drop`)."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, tuple[str | None, list[dict]]] = OrderedDict()

    def put(self, response_id: str, key: str | None, messages: list[dict]) -> None:
        with self._lock:
            self._by_id[response_id] = (key, messages)
            while len(self._by_id) > self.size:
                self._by_id.popitem(last=False)

    def drop(self, key: str | None) -> None:
        """Forget the conversations made with ``key`` (a recording session that ended)."""
        with self._lock:
            for response_id in [r for r, (owner, _) in self._by_id.items() if owner == key]:
                del self._by_id[response_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def get(self, response_id: str, key: str | None) -> list[dict]:
        """The conversation of ``response_id`` made with ``key``; a 400 naming ``previous_response_id``
        when there is none (unknown, made with another key, or gone)."""
        with self._lock:
            owner, messages = self._by_id.get(response_id, (None, None))
        if messages is None or owner != key:
            raise RequestError(
                400,
                "previous_response_id",
                f"previous_response_id: no response {response_id!r} is kept for this key (the gateway keeps "
                f"the last {self.size} responses sent with store left true); send the whole conversation in "
                "input instead",
                code="previous_response_not_found",
            )
        return list(messages)


def named_choice(req: ResponsesRequest) -> bool:
    return isinstance(req.tool_choice, ResponsesNamedToolChoice)


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def conversation(req: ResponsesRequest) -> list[dict]:
    """``input`` as chat messages (module docstring), without instructions or a previous response."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for item in req.input:
        if isinstance(item, ResponsesMessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, ResponsesFunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatRequest:
    """The engine's request: instructions, ``history`` (a previous response's conversation), then input."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
        for t in req.tools or []
    ]
    named = named_choice(req)
    kind = "function" if named else req.tool_choice or "auto"
    choice, forced_name = forced_choice(kind, req.tool_choice.name if named else None, tools, "tool_choice")
    return ChatRequest(
        model=req.model,
        messages=messages + history + conversation(req),
        tools=tools or None,
        tool_choice=choice,
        forced_name=forced_name,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_output_tokens,
        json_schema=json_schema(req),
    )


def json_schema(req: ResponsesRequest) -> dict | None:
    """The JSON schema ``text.format`` asks the answer to follow (None: text; ``json_object``: any object)."""
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, ResponsesJsonSchemaFormat):
        return fmt.schema_
    return {"type": "object"} if isinstance(fmt, ResponsesJsonObjectFormat) else None


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def output_items(message: dict, status: str, message_id: str) -> list[dict]:
    """A chat answer's message as Responses output items (module docstring)."""
    items = []
    calls = message.get("tool_calls") or []
    if message["content"] or not calls:
        text = {"type": "output_text", "text": message["content"] or "", "annotations": [], "logprobs": []}
        items.append(
            {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": [text]}
        )
    for c in calls:
        fn = c["function"]
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": c["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return items


def _format(req: ResponsesRequest) -> dict:
    """The request's ``text.format`` as the response echoes it."""
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def response_head(req: ResponsesRequest, response_id: str, model: str, sampling: dict) -> dict:
    """The fields of a Response known before sampling; ``sampling``: the chat answer's ``shifu`` field (the
    temperature and top-p used)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens,
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "tool_choice": req.tool_choice.model_dump() if named_choice(req) else req.tool_choice or "auto",
        "tools": [t.model_dump() for t in req.tools or []],
        "store": req.store is not False,
        "metadata": req.metadata or {},
        "text": {"format": _format(req), "verbosity": "medium"},
        "truncation": "disabled",
        "usage": None,
        "shifu": sampling,
    }


def response_body(req: ResponsesRequest, chat: dict, response_id: str, message_id: str) -> dict:
    """The Response of a chat answer ``chat`` (module docstring)."""
    choice = chat["choices"][0]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    usage = chat["usage"]
    return response_head(req, response_id, chat["model"], chat["shifu"]) | {
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output_items(choice["message"], status, message_id),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def answered_turn(chat: dict) -> dict:
    """The chat message of an answer, as the next request's history holds it."""
    message = chat["choices"][0]["message"]
    turn = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return turn

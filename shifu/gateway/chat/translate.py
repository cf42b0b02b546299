"""A chat completion request (:class:`~shifu.gateway.chat.protocol.ChatCompletionRequest`) into the engine's
:class:`~shifu.gateway.protocol.ChatRequest`: messages normalised to ``{"role", "content": str | None,
"tool_calls"?, "tool_call_id"?, "name"?}`` (text parts joined, ``developer`` read as ``system``), tools as
``{"type": "function", "function": {...}}`` without ``strict``, the forced call of ``tool_choice`` checked
against the tools (:func:`~shifu.gateway.completions.forced_choice`), ``max_completion_tokens`` over
``max_tokens``, and ``response_format`` as the JSON schema the answer must follow. The chat answer needs no
translation back: it is the engine's own (:func:`shifu.gateway.completions.answer`).
"""

from __future__ import annotations

from shifu.gateway.chat.protocol import (
    ChatAssistantMessage,
    ChatCompletionRequest,
    ChatNamedToolChoice,
    ChatResponseFormatJsonObject,
    ChatResponseFormatJsonSchema,
    ChatToolMessage,
)
from shifu.gateway.completions import forced_choice
from shifu.gateway.protocol import ChatRequest
from shifu.gateway.typed import validated


def _text(content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _message(m) -> dict:
    out: dict = {"role": "system" if m.role == "developer" else m.role}
    if m.name is not None:
        out["name"] = m.name
    out["content"] = _text(m.content)
    if isinstance(m, ChatAssistantMessage) and m.tool_calls is not None:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": c.function.model_dump()} for c in m.tool_calls
        ]
    if isinstance(m, ChatToolMessage):
        out["tool_call_id"] = m.tool_call_id
    return out


def _json_schema(response_format) -> dict | None:
    """None for text, else the JSON schema every choice must follow (``json_object``: any object)."""
    if isinstance(response_format, ChatResponseFormatJsonObject):
        return {"type": "object"}
    if isinstance(response_format, ChatResponseFormatJsonSchema):
        schema = response_format.json_schema.schema_
        return {"type": "object"} if schema is None else schema
    return None


def chat_request(req: ChatCompletionRequest, body: dict) -> ChatRequest:
    """The engine's request of a chat completion request ``body`` validated as ``req`` (module docstring)."""
    tools = None
    if (
        req.tools is not None
    ):  # each function's keys in the order sent: a template may render them as they are
        tools = [
            {
                "type": "function",
                "function": {k: v for k, v in t["function"].items() if k != "strict" and v is not None},
            }
            for t in body["tools"]
        ]
    named = isinstance(req.tool_choice, ChatNamedToolChoice)
    kind = "function" if named else req.tool_choice or "auto"
    choice, forced_name = forced_choice(
        kind, req.tool_choice.function.name if named else None, tools, "tool_choice"
    )
    budget = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    options = req.stream_options
    return ChatRequest(
        model=req.model,
        messages=[_message(m) for m in req.messages],
        tools=tools,
        tool_choice=choice,
        forced_name=forced_name,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        n=req.n or 1,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=budget,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        seed=req.seed,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        return_token_ids=bool(req.return_token_ids),
        stream=bool(req.stream),
        include_usage=bool(req.stream and options is not None and options.include_usage),
        json_schema=_json_schema(req.response_format),
    )


def parse_chat_request(body) -> ChatRequest:
    """A decoded body -> the engine's :class:`~shifu.gateway.protocol.ChatRequest`; a 400 names the field to
    fix (:func:`shifu.gateway.typed.validated`)."""
    return chat_request(validated(ChatCompletionRequest, body), body)

"""A Messages request into the engine's :class:`~shifu.gateway.protocol.ChatRequest`, and the engine's chat
answer back into a :class:`~shifu.gateway.messages.protocol.MessagesAnswer`.

**Into chat messages.** ``system`` is the first, system message (text blocks joined). A user message's
``tool_result`` blocks are tool messages (``tool_call_id``: the ``tool_use_id``) and its text blocks, joined, a
user message, in the order they come; an assistant message's text blocks are its content and its ``tool_use``
blocks its ``tool_calls`` (``input`` as a JSON string), the block's ``id`` kept as the call's, so the engine's
memory of what it sampled finds it again.

**Back.** The chat message's text is one ``text`` block (none when it is empty), each tool call a
``tool_use`` block (its arguments as an object; arguments the policy wrote as no JSON object are kept under
``{"arguments": text}``). ``stop_reason``: ``tool_use`` for calls, ``max_tokens`` for the budget,
``stop_sequence`` for a stop string, else ``end_turn``.
"""

from __future__ import annotations

import json

from shifu.gateway.completions import forced_choice
from shifu.gateway.engine import Choice
from shifu.gateway.messages.protocol import (
    MessagesMessage,
    MessagesRequest,
    MessagesTextBlock,
    MessagesToolResultBlock,
    MessagesToolUseBlock,
)
from shifu.gateway.protocol import ChatRequest


def _joined(blocks) -> str:
    if blocks is None:
        return ""
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def _user(m: MessagesMessage) -> list[dict]:
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict] = []
    for block in m.content:
        if isinstance(block, MessagesToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _joined(block.content)})
        elif isinstance(block, MessagesTextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += block.text
            else:
                out.append({"role": "user", "content": block.text})
    return out or [{"role": "user", "content": ""}]


def _assistant(m: MessagesMessage) -> dict:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    text = [b.text for b in m.content if isinstance(b, MessagesTextBlock)]
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
        }
        for b in m.content
        if isinstance(b, MessagesToolUseBlock)
    ]
    turn = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def chat_request(req: MessagesRequest) -> ChatRequest:
    """The engine's request (module docstring)."""
    messages = [] if req.system is None else [{"role": "system", "content": _joined(req.system)}]
    for m in req.messages:
        messages += _user(m) if m.role == "user" else [_assistant(m)]
    tools = []
    for t in req.tools or []:  # keys in OpenAI's order, so that a template renders them as a chat request's
        fn = {"name": t.name} | ({"description": t.description} if t.description is not None else {})
        tools.append({"type": "function", "function": fn | {"parameters": t.input_schema}})
    choice = req.tool_choice
    kind = {"any": "required", "tool": "function"}.get(choice.type, choice.type) if choice else "auto"
    kind, forced_name = forced_choice(kind, getattr(choice, "name", None), tools, "tool_choice")
    return ChatRequest(
        model=req.model,
        messages=messages,
        tools=tools or None,
        tool_choice=kind,
        forced_name=forced_name,
        parallel_tool_calls=not getattr(choice, "disable_parallel_tool_use", False),
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences or []),
        json_schema=req.output_config.format.schema_
        if req.output_config and req.output_config.format
        else None,
    )


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def content_blocks(message: dict) -> list[dict]:
    """A chat answer's message as content blocks (module docstring)."""
    blocks = [{"type": "text", "text": message["content"]}] if message["content"] else []
    for c in message.get("tool_calls") or []:
        fn = c["function"]
        blocks.append(
            {"type": "tool_use", "id": c["id"], "name": fn["name"], "input": _input(fn["arguments"])}
        )
    return blocks


def stop_reason(finish: str, choice: Choice) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat answer's ``finish_reason`` and the sampler's choice."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if choice.ended == "stop":
        return "stop_sequence", choice.stop_hit
    return "end_turn", None


def message_head(message_id: str, model: str, prompt_tokens: int) -> dict:
    """The message as ``message_start`` shows it: no content, no stop reason, the prompt's tokens."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }


def answer_body(chat: dict, choice: Choice, message_id: str) -> dict:
    """The Messages answer of a chat answer ``chat`` and its sampled ``choice`` (module docstring)."""
    first = chat["choices"][0]
    reason, sequence = stop_reason(first["finish_reason"], choice)
    usage = {
        "input_tokens": chat["usage"]["prompt_tokens"],
        "output_tokens": chat["usage"]["completion_tokens"],
    }
    return message_head(message_id, chat["model"], 0) | {
        "content": content_blocks(first["message"]),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
        "shifu": chat["shifu"],
    }

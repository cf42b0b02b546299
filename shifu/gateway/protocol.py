"""``POST /v1/chat/completions`` bodies read strictly (:func:`parse_chat_request`): every field the gateway
takes is checked for its type and range, and any other field is refused with a 400 that names it (a field
the gateway does not implement is never silently ignored). Errors are :class:`~shifu.http.requests.RequestError`
with the field's path (``messages[2].tool_calls[0].function.arguments``).

Fields (OpenAI's, with vLLM's ``return_token_ids``): ``model``, ``messages`` (roles system / developer /
user / assistant / tool; content a string or text parts; assistant ``tool_calls``; tool ``tool_call_id``),
``tools`` (functions), ``tool_choice`` (``"auto"`` or ``"none"``), ``parallel_tool_calls``, ``n``,
``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``,
``top_logprobs``, ``return_token_ids``, ``stream`` (``false`` only), ``user`` (read, unused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shifu.http.requests import RequestError, field_path, json_type

FIELDS = (
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "stream",
    "user",
)
MAX_N = 16  # choices per request
MAX_STOPS, MAX_STOP_CHARS = 4, 64  # stop strings per request (OpenAI's 4) and the longest one
MAX_TOP_LOGPROBS = 20
ROLE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal"},
    "tool": {"role", "content", "tool_call_id"},
}
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOOL_KEYS = {"name", "description", "parameters", "strict"}


@dataclass
class ChatRequest:
    """A checked chat completion request; ``messages`` normalised to ``{"role", "content": str | None,
    "tool_calls"?, "tool_call_id"?, "name"?}`` (text parts joined; developer is system)."""

    model: str
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False


def bad(path: str, message: str, code: str = "invalid_value") -> RequestError:
    """A 400 for the field at ``path`` (the message starts with it); ``code`` is the OpenAI error code."""
    return RequestError(400, path, f"{path}: {message}", code=code)


def _typed(value, path: str, kinds: tuple, what: str):
    if type(value) not in kinds:
        raise bad(path, f"expected {what}, got {json_type(value)}")
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    _typed(value, name, (int, float), "a number")
    if value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad(name, f"{value} is outside {bound}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    """An integer field; a number with no fraction (``3.0``) counts, as in JSON Schema."""
    value = body.get(name)
    if value is None:
        return None
    if type(value) is float and value.is_integer():
        value = int(value)
    _typed(value, name, (int,), "an integer")
    if value < low or (high is not None and value > high):
        raise bad(name, f"{value} is outside [{low}, {high if high is not None else 'any'}]")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    return default if value is None else _typed(value, name, (bool,), "true or false")


def _text(content, path: str, nullable: bool) -> str | None:
    """A message's content: a string, null (where allowed) or an array of ``{"type": "text", "text"}``."""
    if content is None:
        if nullable:
            return None
        raise bad(path, "missing: this role's messages carry text")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(path, f"expected a string or an array of text parts, got {json_type(content)}")
    texts = []
    for i, part in enumerate(content):
        where = f"{path}[{i}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise bad(where, f"a {kind!r} part is not supported: this policy reads text parts only")
        if set(part) != {"type", "text"}:
            raise bad(where, "a text part has exactly the keys type and text")
        texts.append(_typed(part["text"], f"{where}.text", (str,), "a string"))
    return "".join(texts)


def _tool_calls(calls, path: str) -> list[dict]:
    _typed(calls, path, (list,), "an array of tool calls")
    out = []
    for i, c in enumerate(calls):
        where = f"{path}[{i}]"
        _typed(c, where, (dict,), "an object")
        if set(c) - {"id", "type", "function"} or c.get("type", "function") != "function":
            extra = sorted(set(c) - {"id", "type", "function"})
            raise bad(where, f"unknown field {extra[0]!r}" if extra else "type must be 'function'")
        call_id = _typed(c.get("id"), f"{where}.id", (str,), "a string")
        fn = _typed(c.get("function"), f"{where}.function", (dict,), "an object")
        if set(fn) != {"name", "arguments"}:
            raise bad(f"{where}.function", "a tool call's function has exactly the keys name and arguments")
        name = _typed(fn["name"], f"{where}.function.name", (str,), "a string")
        args = _typed(fn["arguments"], f"{where}.function.arguments", (str,), "a string (JSON arguments)")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def _message(m, path: str) -> dict:
    _typed(m, path, (dict,), "an object")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLE_KEYS:
        raise bad(f"{path}.role", f"{role!r} is not one of {', '.join(ROLE_KEYS)}")
    unknown = sorted(set(m) - ROLE_KEYS[role])
    if unknown:
        raise bad(field_path(path, unknown[0]), f"unknown field of a {role} message", "unknown_field")
    out: dict = {"role": "system" if role == "developer" else role}
    if "name" in m:
        out["name"] = _typed(m["name"], f"{path}.name", (str,), "a string")
    if role == "assistant":
        if m.get("refusal") is not None:
            _typed(m["refusal"], f"{path}.refusal", (str,), "a string or null")
        out["content"] = _text(m.get("content"), f"{path}.content", nullable=True)
        if m.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(m["tool_calls"], f"{path}.tool_calls")
        return out
    out["content"] = _text(m.get("content"), f"{path}.content", nullable=False)
    if role == "tool":
        out["tool_call_id"] = _typed(m.get("tool_call_id"), f"{path}.tool_call_id", (str,), "a string")
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    _typed(tools, "tools", (list,), "an array of tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        _typed(t, where, (dict,), "an object")
        if set(t) != {"type", "function"} or t["type"] != "function":
            raise bad(where, "a tool is {'type': 'function', 'function': {...}}: function tools only")
        fn = _typed(t["function"], f"{where}.function", (dict,), "an object")
        unknown = sorted(set(fn) - _TOOL_KEYS)
        if unknown:
            raise bad(f"{where}.function.{unknown[0]}", "unknown field of a function", "unknown_field")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise bad(f"{where}.function.name", "a function name is 1-64 letters, digits, _ or -")
        if fn.get("description") is not None:
            _typed(fn["description"], f"{where}.function.description", (str,), "a string")
        if fn.get("parameters") is not None:
            _typed(fn["parameters"], f"{where}.function.parameters", (dict,), "a JSON Schema object")
        if fn.get("strict") is not None:
            _typed(fn["strict"], f"{where}.function.strict", (bool,), "true, false or null")
        kept = {k: v for k, v in fn.items() if k != "strict" and v is not None}
        out.append({"type": "function", "function": kept})
    return out


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise bad("stop", f"expected a string or an array of at most {MAX_STOPS} strings")
    for i, s in enumerate(stops):
        where = "stop" if isinstance(value, str) else f"stop[{i}]"
        _typed(s, where, (str,), "a string")
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise bad(where, f"a stop string has 1 to {MAX_STOP_CHARS} characters")
    return stops


def _tool_choice(value) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str) and value in ("auto", "none"):
        return value
    raise bad(
        "tool_choice",
        "only 'auto' and 'none' are supported: shifu samples the policy freely and cannot force a call",
        "unsupported_value",
    )


def parse_chat_request(body) -> ChatRequest:
    """A decoded body -> :class:`ChatRequest`; a 400 names the first field to fix (module docstring)."""
    if not isinstance(body, dict):
        raise bad("body", f"the body must be a JSON object, got {json_type(body)}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise bad(
            field_path("", unknown[0]),
            f"unknown or unsupported field ({len(unknown)} such: {', '.join(unknown)}); this gateway takes "
            f"{', '.join(FIELDS)}",
            "unknown_field",
        )
    for name in ("model", "messages"):
        if name not in body:
            raise bad(name, "missing: a chat completion needs model and messages")
    model = _typed(body["model"], "model", (str,), "a string")
    messages = _typed(body["messages"], "messages", (list,), "an array of messages")
    if not messages:
        raise bad("messages", "empty: give at least one message")
    if body.get("stream") is not None and body["stream"] is not False:
        raise bad("stream", "streaming is not supported: leave stream out or send false", "unsupported_value")
    if body.get("user") is not None:
        _typed(body["user"], "user", (str,), "a string")
    budget = _integer(body, "max_completion_tokens", 1)
    legacy = _integer(body, "max_tokens", 1)
    budget = budget if budget is not None else legacy
    return ChatRequest(
        model=model,
        messages=[_message(m, f"messages[{i}]") for i, m in enumerate(messages)],
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=_boolean(body, "parallel_tool_calls", True),
        n=_integer(body, "n", 1, MAX_N) or 1,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        max_tokens=budget,
        stop=_stop(body.get("stop")),
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        logprobs=_boolean(body, "logprobs", False),
        top_logprobs=_integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0,
        return_token_ids=_boolean(body, "return_token_ids", False),
    )

"""``POST /v1/chat/completions`` bodies read strictly (:func:`parse_chat_request`): every field the gateway
takes is checked for its type and range, and any other field is refused with a 400 that names it (a field
the gateway does not implement is never silently ignored). Errors are :class:`~shifu.http.requests.RequestError`
with the field's path (``messages[2].tool_calls[0].function.arguments``).

Fields (OpenAI's, with vLLM's ``return_token_ids``): ``model``, ``messages`` (roles system / developer /
user / assistant / tool; content a string or text parts; assistant ``tool_calls``; tool ``tool_call_id``),
``tools`` (functions), ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function",
"function": {"name"}}``), ``parallel_tool_calls``, ``n``, ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``, ``top_logprobs``, ``return_token_ids``,
``stream``, ``stream_options`` (``include_usage``), ``response_format`` (``text``, ``json_object`` or
``json_schema``: :func:`shifu.gateway.completions.json_grammar`).

Fields that change nothing sampled are read and accepted (:data:`NO_OP_FIELDS`: ``user``, ``store``,
``metadata``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``modalities: ["text"]``,
``frequency_penalty`` / ``presence_penalty`` 0, ``logit_bias: {}``, and vLLM's ``top_k`` 0 or -1, ``min_p`` 0,
``repetition_penalty`` 1); any other value of those that would change what is sampled is refused with a 400
that says so (shifu records the exact log-probs of what it sampled, and its sampler and the trainer's
recomputation implement none of them), as is ``reasoning_effort``. In messages, ``name`` (any role),
``function_call`` / ``audio`` / ``annotations`` null (or ``[]``) on an assistant message, ``index`` in a
history tool call and ``cache_control`` on a text part are read and change nothing.
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
    "stream_options",
    "response_format",
)
NO_OP_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "modalities",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "top_k",
    "min_p",
    "repetition_penalty",
)
NOT_OFFERED = "tool_not_offered"  # the code of a forced call of a tool the request does not offer
REFUSED_FIELDS = ("reasoning_effort",)  # known, and refused with the reason (_sampling_changes)
_EXACT = (
    "shifu records the exact log-probs of what it samples, and neither its sampler nor the trainer's "
    "recomputation implements it yet"
)
MAX_N = 16  # choices per request
MAX_STOPS, MAX_STOP_CHARS = 4, 64  # stop strings per request (OpenAI's 4) and the longest one
MAX_TOP_LOGPROBS = 20
ROLE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {
        "role",
        "content",
        "name",
        "tool_calls",
        "refusal",
        "function_call",
        "audio",
        "annotations",
    },
    "tool": {"role", "content", "tool_call_id", "name"},
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
    tool_choice: str = "auto"  # "auto", "none", "required" or "function" (a named one: ``forced_name``)
    forced_name: str | None = None
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
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    json_schema: dict | None = None  # response_format json_object / json_schema: what the answer must follow

    @property
    def forced(self) -> bool:
        """Whether the answer must be a tool call (``tool_choice`` ``"required"`` or a named function)."""
        return self.tool_choice in ("required", "function")


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
        if "text" not in part or set(part) - {"type", "text", "cache_control"}:
            raise bad(
                where, "a text part has the keys type and text (and cache_control, which changes nothing)"
            )
        if part.get("cache_control") is not None:
            _typed(part["cache_control"], f"{where}.cache_control", (dict,), "an object or null")
        texts.append(_typed(part["text"], f"{where}.text", (str,), "a string"))
    return "".join(texts)


_LEGACY = {
    "function_call": "send a call of this gateway's answers in tool_calls",
    "audio": "this policy reads and writes text only",
}


def _tool_calls(calls, path: str) -> list[dict]:
    _typed(calls, path, (list,), "an array of tool calls")
    out = []
    for i, c in enumerate(calls):
        where = f"{path}[{i}]"
        _typed(c, where, (dict,), "an object")
        if set(c) - {"id", "type", "function", "index"} or c.get("type", "function") != "function":
            extra = sorted(set(c) - {"id", "type", "function", "index"})
            raise bad(where, f"unknown field {extra[0]!r}" if extra else "type must be 'function'")
        index = c.get("index")
        if "index" in c and not (type(index) in (int, float) and float(index).is_integer() and index >= 0):
            raise bad(f"{where}.index", "expected an integer >= 0 (the call's place in its message)")
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
        for name in ("function_call", "audio"):  # the legacy call and an audio answer: null only
            if m.get(name) is not None:
                raise bad(f"{path}.{name}", f"only null is taken here: {_LEGACY[name]}", "unsupported_value")
        if m.get("annotations") not in (None, []):  # a web search's citations: none written by this policy
            raise bad(
                f"{path}.annotations",
                "only null or [] is taken: this policy cites nothing",
                "unsupported_value",
            )
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


def _tool_choice(value, tools: list[dict] | None) -> tuple[str, str | None]:
    """``(tool_choice, forced function name)``: ``"auto"`` / ``"none"`` / ``"required"`` or a named function
    (``"function"``); forcing a call needs the tools, and a named one among them."""
    if value is None:
        return "auto", None
    if isinstance(value, str) and value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise bad(
                "tool_choice",
                "'required' needs tools to call: send tools, or leave tool_choice out",
                NOT_OFFERED,
            )
        return value, None
    named = (
        isinstance(value, dict)
        and set(value) == {"type", "function"}
        and value["type"] == "function"
        and isinstance(value["function"], dict)
        and set(value["function"]) == {"name"}
        and isinstance(value["function"]["name"], str)
    )
    if not named:
        raise bad(
            "tool_choice",
            "expected 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "unsupported_value",
        )
    name = value["function"]["name"]
    offered = [t["function"]["name"] for t in tools or []]
    if name not in offered:
        raise bad(
            "tool_choice",
            f"names the function {name!r}, which is not among the tools ({', '.join(offered) or 'none sent'})",
            NOT_OFFERED,
        )
    return "function", name


def _stream_options(body: dict, stream: bool) -> bool:
    """``stream_options.include_usage`` (``include_obfuscation`` is read: no padding is ever sent)."""
    options = body.get("stream_options")
    if options is None:
        return False
    _typed(options, "stream_options", (dict,), "an object")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise bad(
            field_path("stream_options", unknown[0]),
            "unknown field: stream_options takes include_usage and include_obfuscation",
            "unknown_field",
        )
    for name in ("include_usage", "include_obfuscation"):
        if options.get(name) is not None:
            _typed(options[name], f"stream_options.{name}", (bool,), "true or false")
    return bool(options.get("include_usage")) and stream


def _response_format(value) -> dict | None:
    """None for text, else the JSON schema every choice must follow (``json_object``: any object)."""
    if value is None or value == {"type": "text"}:
        return None
    _typed(value, "response_format", (dict,), "an object")
    kind = value.get("type")
    if kind == "json_object" and set(value) == {"type"}:
        return {"type": "object"}
    if kind != "json_schema" or set(value) != {"type", "json_schema"}:
        raise bad(
            "response_format",
            "expected {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {...}}",
            "unsupported_value",
        )
    spec = _typed(value["json_schema"], "response_format.json_schema", (dict,), "an object")
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown:
        raise bad(f"response_format.json_schema.{unknown[0]}", "unknown field", "unknown_field")
    _typed(spec.get("name"), "response_format.json_schema.name", (str,), "a string")
    if spec.get("description") is not None:
        _typed(spec["description"], "response_format.json_schema.description", (str,), "a string")
    if spec.get("strict") is not None:
        _typed(spec["strict"], "response_format.json_schema.strict", (bool,), "true, false or null")
    schema = spec.get("schema")
    if schema is None:
        return {"type": "object"}
    return _typed(schema, "response_format.json_schema.schema", (dict,), "a JSON Schema object")


def _neutral(value, neutral: tuple) -> bool:
    return value is None or (type(value) in (int, float) and value in neutral)


def _sampling_changes(body: dict) -> None:
    """A 400 for the first no-op field (:data:`NO_OP_FIELDS`) whose value would change what is sampled, and
    for ``reasoning_effort``; the others' types are checked (they change nothing)."""
    for name, neutral in (
        ("frequency_penalty", (0,)),
        ("presence_penalty", (0,)),
        ("top_k", (0, -1)),
        ("min_p", (0,)),
        ("repetition_penalty", (1,)),
    ):
        if not _neutral(body.get(name), neutral):
            shown = " or ".join(str(v) for v in neutral)
            raise bad(name, f"only {shown} is taken (it changes nothing): {_EXACT}", "unsupported_value")
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", f"only {{}} is taken (it changes nothing): {_EXACT}", "unsupported_value")
    if body.get("reasoning_effort") is not None:
        raise bad(
            "reasoning_effort",
            f"not taken: a thinking switch would change the prompt and what is sampled, and {_EXACT}",
            "unsupported_value",
        )
    if body.get("modalities") not in (None, ["text"]):
        raise bad("modalities", 'only ["text"] is taken: this policy writes text', "unsupported_value")
    for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None:
            _typed(body[name], name, (str,), "a string")
    if body.get("store") is not None:
        _typed(body["store"], "store", (bool,), "true or false (nothing is stored either way)")
    if body.get("metadata") is not None:
        meta = _typed(body["metadata"], "metadata", (dict,), "an object of strings")
        for k, v in meta.items():
            _typed(v, field_path("metadata", k), (str,), "a string")


def parse_chat_request(body) -> ChatRequest:
    """A decoded body -> :class:`ChatRequest`; a 400 names the first field to fix (module docstring)."""
    if not isinstance(body, dict):
        raise bad("body", f"the body must be a JSON object, got {json_type(body)}")
    unknown = sorted(set(body) - set(FIELDS) - set(NO_OP_FIELDS) - set(REFUSED_FIELDS))
    if unknown:
        raise bad(
            field_path("", unknown[0]),
            f"unknown or unsupported field ({len(unknown)} such: {', '.join(unknown)}); this gateway takes "
            f"{', '.join(FIELDS)}, and accepts {', '.join(NO_OP_FIELDS)} where they change nothing",
            "unknown_field",
        )
    for name in ("model", "messages"):
        if name not in body:
            raise bad(name, "missing: a chat completion needs model and messages")
    model = _typed(body["model"], "model", (str,), "a string")
    messages = _typed(body["messages"], "messages", (list,), "an array of messages")
    if not messages:
        raise bad("messages", "empty: give at least one message")
    _sampling_changes(body)
    stream = _boolean(body, "stream", False)
    tools = _tools(body.get("tools"))
    tool_choice, forced_name = _tool_choice(body.get("tool_choice"), tools)
    budget = _integer(body, "max_completion_tokens", 1)
    legacy = _integer(body, "max_tokens", 1)
    budget = budget if budget is not None else legacy
    return ChatRequest(
        model=model,
        messages=[_message(m, f"messages[{i}]") for i, m in enumerate(messages)],
        tools=tools,
        tool_choice=tool_choice,
        forced_name=forced_name,
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
        stream=stream,
        include_usage=_stream_options(body, stream),
        json_schema=_response_format(body.get("response_format")),
    )

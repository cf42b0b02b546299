"""Tool calls in a chat model's own text: how its chat template offers tools, and the OpenAI-style calls parsed
back out of what it wrote.

**Offering tools.** :func:`tool_format` asks the template itself (by rendering, never by model name): a
template that renders ``tools=`` (Qwen2.5, Llama 3.1, Hermes) gets them natively, and its assistant tool
calls are rendered by it too; a template that ignores ``tools=`` (SmolLM2's ChatML) gets them in a system
message (:func:`tools_system_message`) that describes the Hermes syntax, placed before the conversation's own
system text (:func:`with_tools_system`, the same for an environment's episodes and an agent's calls), and
assistant tool calls in the history are written in that syntax (:func:`render_messages`).

**Parsing calls.** :func:`parse_tool_calls` reads every call of a completion in one of two syntaxes:

- ``"hermes"`` (Hermes, Qwen2/2.5/3, and the fallback for templates without tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, text before the first
  one is the message's content; an unclosed last call at the very end counts when its JSON is complete (a
  completion cut by the stop string ``</tool_call>``);
- ``"llama3_json"`` (Llama 3.1/3.2/3.3 JSON tool calling): the whole completion is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), optionally after ``<|python_tag|>``.

Other syntaxes (Mistral's ``[TOOL_CALLS]``, Llama's ``<function=...>``, DeepSeek's, pythonic calls) are not
parsed: :func:`tool_format` offers such a model its tools in the Hermes system message instead. A call
whose JSON does not parse, or names no function, is left in the content as text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

SYNTAXES = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_PROBE = {
    "type": "function",
    "function": {
        "name": "shifu_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}
# an assistant's call of the probe tool, rendered to read the template's call syntax
_PROBE_CALL = {
    "type": "function",
    "id": "call_0",
    "function": {"name": "shifu_probe_tool", "arguments": {"x": "1"}},
}


@dataclass(frozen=True)
class ToolFormat:
    """How a template takes tools: ``native`` (its own ``tools=`` rendering) or the Hermes system message,
    and the ``syntax`` its completions write calls in (one of :data:`SYNTAXES`)."""

    native: bool
    syntax: str


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None, prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=False)


def renders_tools(tokenizer) -> bool:
    """True when the chat template renders ``tools=`` (a probe tool's name appears only when it is given)."""
    probe = [{"role": "user", "content": "hello"}]
    try:
        with_tools = _render(tokenizer, probe, [_PROBE])
    except Exception:  # a template that refuses tools (raise_exception) does not render them
        return False
    return "shifu_probe_tool" in with_tools and "shifu_probe_tool" not in _render(tokenizer, probe)


def _call_syntax(tokenizer) -> str | None:
    """The syntax the template writes an assistant tool call in, read off a rendered probe call."""
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "done"},
    ]
    try:
        text = _render(tokenizer, messages, [_PROBE])
    except Exception:
        return None
    if "<tool_call>" in text:
        return "hermes"
    if re.search(r'\{"name":\s*"shifu_probe_tool",\s*"parameters"', text):
        return "llama3_json"
    return None


def tool_format(tokenizer) -> ToolFormat:
    """The template's own tools when it renders them in a syntax :func:`parse_tool_calls` reads; else the
    Hermes system message (module docstring). A tokenizer without a chat template has no tool format: the
    callers refuse tools for it."""
    if getattr(tokenizer, "chat_template", None) and renders_tools(tokenizer):
        syntax = _call_syntax(tokenizer)
        if syntax is not None:
            return ToolFormat(True, syntax)
    return ToolFormat(False, "hermes")


def call_opening(tokenizer, fmt: ToolFormat, name: str | None = None) -> str:
    """The text a call in ``fmt`` begins with, which a forced call's prompt ends with: for any call
    (``tool_choice: "required"``) Hermes' ``<tool_call>`` (with what the template writes after it: Qwen's
    newline) or Llama 3's ``{"name": "``; for the function ``name``, the call up to its arguments
    (``<tool_call>{"name": "NAME", "arguments":``, ``{"name": "NAME", "parameters":``), the model writing the
    rest (no space after the colon: the arguments' own first token carries it, as the model would write it)."""
    if fmt.syntax == "llama3_json":
        return '{"name": "' if name is None else f'{{"name": {json.dumps(name)}, "parameters":'
    opening = "<tool_call>" + (_hermes_gap(tokenizer) if fmt.native else "")
    return opening if name is None else f'{opening}{{"name": {json.dumps(name)}, "arguments":'


def _hermes_gap(tokenizer) -> str:
    """What a template writes between ``<tool_call>`` and the call's JSON (Qwen: a newline)."""
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
    ]
    try:
        text = _render(tokenizer, messages, [_PROBE])
    except Exception:
        return ""
    found = re.search(r"<tool_call>(\s*)\{", text)
    return found.group(1) if found else ""


def tools_system_message(tools: list[dict]) -> str:
    """The system text that offers ``tools`` (OpenAI ``{"type": "function", "function": {...}}`` dicts) to a
    template without tools: each function's schema, one per line, and the Hermes call syntax."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        f'You can call these tools:\n{listed}\nTo call one, write <tool_call>{{"name": ..., "arguments": '
        "{...}}</tool_call> and wait for its result. When you know the answer, write it without a tool call."
    )


def tool_call_text(calls: list[dict], syntax: str = "hermes") -> str:
    """OpenAI ``tool_calls`` of an assistant message written in ``syntax`` as :func:`tools_system_message`
    describes it (the history of a template without tools)."""
    parts = []
    for c in calls:
        fn = c["function"]
        args = _arguments(fn.get("arguments"))
        if syntax == "llama3_json":
            parts.append(json.dumps({"name": fn["name"], "parameters": args}, ensure_ascii=False))
        else:
            body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
            parts.append(f"<tool_call>{body}</tool_call>")
    return ("; " if syntax == "llama3_json" else "").join(parts)


def _arguments(value):
    """A call's arguments as an object: OpenAI sends them as a JSON string, templates want the object."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
    return value if value is not None else {}


def render_messages(
    tokenizer, messages: list[dict], tools: list[dict] | None, fmt: ToolFormat, generation_prompt: bool = True
) -> str:
    """The prompt text of OpenAI-style ``messages`` (roles system/user/assistant/tool, assistant
    ``tool_calls``) offering ``tools``: through the template natively, or with the Hermes system message in
    front of the messages' own system text (:func:`with_tools_system`) and the history's calls written as text
    (:func:`tool_format`). Always through the chat template."""
    if tools and fmt.native:
        native = [_native_message(m) for m in messages]
        return _render(tokenizer, native, tools, generation_prompt)
    plain = [_plain_message(m, fmt.syntax) for m in messages]
    if tools:
        plain = with_tools_system(plain, tools_system_message(tools))
    return _render(tokenizer, plain, None, generation_prompt)


def with_tools_system(messages: list[dict], text: str) -> list[dict]:
    """``messages`` with the system text ``text`` that offers tools to a template without them: before the
    first message's own text when that is a system message (``text``, a blank line, its content), else as a
    system message of its own. The one rendering of the tools block, for an environment's episodes
    (:class:`shifu.rollout.turns.ChatTurns`) and an agent's calls through the gateway (:func:`render_messages`)
    alike, so that the same conversation reads the same ids either way."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _native_message(m: dict) -> dict:
    """A message for a template that renders tools: call arguments as objects, content never None."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in m["tool_calls"]
        ]
    return out


def _plain_message(m: dict, syntax: str) -> dict:
    """A message for a template without tools: role and text only, assistant calls appended as text."""
    content = m.get("content") or ""
    if m.get("tool_calls"):
        calls = tool_call_text(m["tool_calls"], syntax)
        content = f"{content}\n{calls}" if content else calls
    return {"role": m["role"], "content": content}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(name, args) -> dict | None:
    if not isinstance(name, str) or not name:
        return None
    if args is None:
        args = {}
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes_calls(text: str) -> tuple[str | None, list[dict]]:
    calls, first = [], None
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        call = (
            _call(obj.get("name"), obj.get("arguments", obj.get("parameters")))
            if isinstance(obj, dict)
            else None
        )
        if call is not None:
            calls.append(call)
            first = m.start() if first is None else first
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def _llama3_calls(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = (
            _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
            if isinstance(obj, dict)
            else None
        )
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def parse_tool_calls(text: str, syntax: str = "hermes") -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a completion's text: every call written in ``syntax`` (module docstring) as
    an OpenAI ``{"id", "type": "function", "function": {"name", "arguments": JSON string}}`` dict, and the
    text that is not a call (None when there is none). No call: ``(text, [])``."""
    if syntax not in SYNTAXES:
        raise ValueError(f"tool-call syntax must be one of {SYNTAXES}, not {syntax!r}")
    return _hermes_calls(text) if syntax == "hermes" else _llama3_calls(text)

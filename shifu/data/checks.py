"""What a valid field of a row is: a non-empty string, a chat's messages (with ``tool_calls`` and ``train``), a
response's segments. Each check raises :class:`shifu.errors.DataError` naming the file, the line and the field
(``where`` is the ``(path text, line)`` pair that :mod:`shifu.data.rows` reads rows with)."""

from __future__ import annotations

from typing import Any

from shifu.errors import DataError

SEGMENT = '{"text": "...", "train": false}'
TOOL_CALL_HINT = 'each tool call is {"function": {"name": ..., "arguments": {...}}}'


def check_text(row: dict, key: str, where: tuple[str, int | None], required: bool = True) -> None:
    """``row[key]`` is a string that is not all whitespace (or, when not ``required``, absent or null)."""
    path, line = where
    if key not in row or row[key] is None:
        if required:
            raise DataError(path, line, key, "missing field", f"every row needs a '{key}' string")
        return
    value = row[key]
    if not isinstance(value, str):
        raise DataError(path, line, key, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(path, line, key, "empty string", "remove the row or fill in the text")
    check_unicode(value, path, line, key)


def check_unicode(value: str, path: str, line: int | None, key: str) -> None:
    """A JSON escape of half a UTF-16 surrogate pair (``"\\ud83d"`` alone) is no character: tokenizers fail
    on it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(
            path,
            line,
            key,
            f"invalid Unicode escape at character {e.start} (a lone surrogate \\u{ord(value[e.start]):04x})",
            "write the character itself, or escape the whole surrogate pair",
        ) from None


def _check_tool_calls(m: dict, path: str, line: int | None, field: str) -> None:
    """An assistant message's optional ``tool_calls``: a non-empty list of ``{"function": {"name",
    "arguments"}}`` objects (the form chat templates read; ``arguments`` an object or a JSON string)."""
    calls = m["tool_calls"]
    if m["role"] != "assistant":
        raise DataError(
            path, line, f"{field}.tool_calls", f"only assistant messages call tools (role '{m['role']}')"
        )
    if not isinstance(calls, list) or not calls:
        raise DataError(path, line, f"{field}.tool_calls", "expected a non-empty list", TOOL_CALL_HINT)
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(path, line, f"{field}.tool_calls[{k}]", "no function name", TOOL_CALL_HINT)
        if not isinstance(fn.get("arguments"), (dict, str)):
            raise DataError(
                path,
                line,
                f"{field}.tool_calls[{k}].function.arguments",
                "expected an object",
                TOOL_CALL_HINT,
            )


def _check_message(m: Any, path: str, line: int | None, field: str, reply: bool) -> None:
    """One message: a string ``role``; a non-empty string ``content`` (an assistant message with ``tool_calls``
    may leave it empty or out); ``train`` (a boolean) only on an SFT row's assistant messages."""
    if not isinstance(m, dict):
        raise DataError(path, line, field, f"expected an object, got {type(m).__name__}")
    if not isinstance(m.get("role"), str):
        raise DataError(path, line, f"{field}.role", "missing or not a string")
    if m.get("tool_calls") is not None:
        _check_tool_calls(m, path, line, field)
    content = m.get("content")
    if not (m.get("tool_calls") is not None and content in (None, "")):
        if not isinstance(content, str):
            raise DataError(path, line, f"{field}.content", "missing or not a string")
        if not content.strip():
            raise DataError(path, line, f"{field}.content", "empty string")
        check_unicode(content, path, line, f"{field}.content")
    if m.get("train") is not None:
        if not reply:
            raise DataError(path, line, f"{field}.train", "a prompt is read, never trained", "remove 'train'")
        if m["role"] != "assistant":
            raise DataError(
                path, line, f"{field}.train", f"only assistant messages are trained (role '{m['role']}')"
            )
        if not isinstance(m["train"], bool):
            raise DataError(path, line, f"{field}.train", f"expected true or false, got {m['train']!r}")


def check_messages(row: dict, where: tuple[str, int | None], reply: bool = True) -> None:
    """``row["messages"]``: a non-empty list of messages that ends on the assistant's reply, at least one
    assistant message trained (``reply``: an SFT row), or on another role (a prompt: nothing trained)."""
    path, line = where
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(path, line, "messages", "expected a non-empty list of {role, content} objects")
    for j, m in enumerate(msgs):
        _check_message(m, path, line, f"messages[{j}]", reply)
    last = f"messages[{len(msgs) - 1}].role"
    if reply and msgs[-1]["role"] != "assistant":
        raise DataError(
            path, line, last, f"the last message must be the assistant's reply (got '{msgs[-1]['role']}')"
        )
    if reply and not any(m["role"] == "assistant" and trained(m) for m in msgs):
        raise DataError(path, line, "messages", 'no assistant message is trained (each says "train": false)')
    if not reply and msgs[-1]["role"] == "assistant":
        raise DataError(
            path,
            line,
            last,
            "the last message is the assistant's: a prompt's conversation ends on the user's turn",
        )


def check_segments(row: dict, where: tuple[str, int | None]) -> None:
    """A ``response`` given as segments: a non-empty list of ``{"text": str, "train": bool}`` (``train``
    optional, default true), at least one trained, not all whitespace."""
    path, line = where
    segments = row["response"]
    if not segments:
        raise DataError(path, line, "response", "empty list", "give the response text, or its segments")
    for k, seg in enumerate(segments):
        field = f"response[{k}]"
        if not isinstance(seg, dict):
            raise DataError(path, line, field, f"expected an object {SEGMENT}, got {type(seg).__name__}")
        if set(seg) - {"text", "train"}:
            extra = ", ".join(sorted(set(seg) - {"text", "train"}))
            raise DataError(path, line, field, f"unknown key {extra}", f"a segment is {SEGMENT}")
        if not isinstance(seg.get("text"), str) or not seg["text"]:
            raise DataError(
                path, line, f"{field}.text", "missing, empty or not a string", f"a segment is {SEGMENT}"
            )
        check_unicode(seg["text"], path, line, f"{field}.text")
        if seg.get("train") is not None and not isinstance(seg["train"], bool):
            raise DataError(path, line, f"{field}.train", f"expected true or false, got {seg['train']!r}")
    if not any(trained(seg) for seg in segments):
        raise DataError(path, line, "response", 'no segment is trained (each says "train": false)')
    if not "".join(seg["text"] for seg in segments).strip():
        raise DataError(path, line, "response", "only whitespace", "remove the row or fill in the text")


def trained(item: dict) -> bool:
    """Whether a response segment or an assistant message is trained: its ``train`` is absent, null (a
    Parquet column fills in null) or true."""
    return item.get("train") is not False


def check_prompt(row: dict, where: tuple[str, int | None]) -> None:
    """A prompt is a ``prompt`` string or a ``messages`` conversation up to the user's turn; with only
    ``messages``, ``prompt`` becomes its last message's text (what reward functions and judges read)."""
    if row.get("messages") is not None:
        check_messages(row, where, reply=False)
        row.setdefault("prompt", row["messages"][-1]["content"])
        return
    check_text(row, "prompt", where)

"""Demonstrations from ATIF trajectories (Harbor's Agent Trajectory Interchange Format) and from OpenAI-format
chat logs with tools: an SFT row trains the agent's turns only.

An ATIF document (a row of a JSON Lines file, or a ``.json`` file of one document or a list of them) becomes one
SFT row, in one of two ways:

- **as recorded**, when every agent step carries ``metrics.prompt_token_ids`` and ``completion_token_ids`` and
  each step's prompt continues the previous step's prompt and completion token for token (what ``shifu traces
  export`` writes): the ids are the last step's prompt and completion, and each agent step's completion is
  trained. The ids must be the policy's own: each completion must decode, with the policy's tokenizer, to text
  that contains its step's ``message``, else a :class:`DataError` names the step
  (:func:`shifu.data.demonstrations.encode_demonstration` checks it);
- **rendered**, otherwise: the steps as OpenAI messages (``system`` and ``user`` steps as such, an ``agent``
  step as an assistant message with its ``tool_calls``, its observation's results as ``tool`` messages answering
  their ``source_call_id``, or as a user message without one) and ``agent.tool_definitions`` as ``tools``: the
  row is then a ``{"messages", "tools"}`` chat log.

A chat log ``{"messages": [...], "tools": [...]}`` is rendered as the policy gateway renders an agent's request
(:func:`shifu.models.tool_calls.render_messages`: tools natively where the template renders them, else in a
Hermes system message), so that a demonstration is the same text as the agent's first input and each assistant
turn is trained as the policy would have sampled it: its content and tool calls in the model's syntax, and its
end of turn. Steps marked ``is_copied_context`` are read, not trained.
"""

from __future__ import annotations

import json
from typing import Any

from shifu.errors import DataError

Where = tuple[str, int | None]
SOURCES = ("system", "user", "agent")


def is_atif(row: Any) -> bool:
    """Whether a parsed row is an ATIF trajectory document (its ``schema_version`` says so)."""
    return isinstance(row, dict) and str(row.get("schema_version", "")).startswith("ATIF-")


def _text(content: Any, where: Where, field: str) -> str:
    """A step's message or an observation's content as text (ATIF: a string, or content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise DataError(
                    *where, f"{field}[{k}]", "only text parts can be trained on", "remove images and audio"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise DataError(*where, field, f"expected a string or content parts, got {type(content).__name__}")


def _steps(doc: dict, where: Where) -> list[dict]:
    steps = doc.get("steps")
    if not isinstance(steps, list) or not steps:
        raise DataError(*where, "steps", "expected a non-empty list of steps", "an ATIF trajectory has steps")
    for k, step in enumerate(steps):
        if not isinstance(step, dict):
            raise DataError(*where, f"steps[{k}]", f"expected an object, got {type(step).__name__}")
        if step.get("source") not in SOURCES:
            raise DataError(*where, f"steps[{k}].source", f"expected one of {', '.join(SOURCES)}")
    if not any(s["source"] == "agent" and not s.get("is_copied_context") for s in steps):
        raise DataError(
            *where, "steps", "no agent step to train on", "a demonstration needs the agent's turns"
        )
    return steps


def _ids(value: Any) -> list[int] | None:
    ok = isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    )
    return value if ok else None


def _as_recorded(steps: list[dict], where: Where) -> dict | None:
    """The row of a trajectory whose agent steps carry chained token ids (module docstring); None otherwise."""
    ids: list[int] = []
    mask: list[bool] = []
    checks: list[tuple[str, int, int, str]] = []
    for k, step in enumerate(steps):
        if step["source"] != "agent":
            continue
        metrics = step.get("metrics") or {}
        prompt, completion = _ids(metrics.get("prompt_token_ids")), _ids(metrics.get("completion_token_ids"))
        if prompt is None or not completion or prompt[: len(ids)] != ids:
            return None
        mask += [False] * (len(prompt) - len(ids))
        train = not step.get("is_copied_context")
        field = f"steps[{k}].metrics.completion_token_ids"
        checks.append(
            (field, len(prompt), len(prompt) + len(completion), _text(step.get("message"), where, field))
        )
        ids, mask = prompt + completion, mask + [train] * len(completion)
    if not any(mask):
        return None
    first = next((_text(s.get("message"), where, "message") for s in steps if s["source"] != "agent"), "")
    return {"token_ids": ids, "token_train": mask, "token_checks": checks, "prompt": first or "(token ids)"}


def _tool_calls(step: dict, where: Where, k: int) -> list[dict]:
    calls = step.get("tool_calls") or []
    out = []
    for j, call in enumerate(calls):
        field = f"steps[{k}].tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function_name"), str):
            raise DataError(*where, f"{field}.function_name", "missing or not a string")
        args = call.get("arguments", {})
        if not isinstance(args, dict):
            raise DataError(*where, f"{field}.arguments", "expected an object")
        call_id = call.get("tool_call_id") or f"call_{k}_{j}"
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call["function_name"], "arguments": args},
            }
        )
    return out


def _messages(steps: list[dict], where: Where) -> list[dict]:
    """The steps as OpenAI messages (module docstring), up to the last assistant message."""
    messages: list[dict] = []
    for k, step in enumerate(steps):
        text = _text(step.get("message"), where, f"steps[{k}].message")
        if step["source"] != "agent":
            messages.append({"role": step["source"], "content": text})
            continue
        m: dict[str, Any] = {"role": "assistant", "content": text}
        calls = _tool_calls(step, where, k)
        if calls:
            m["tool_calls"] = calls
        if step.get("is_copied_context"):
            m["train"] = False
        messages.append(m)
        ids = {c["id"] for c in calls}
        for j, result in enumerate(((step.get("observation") or {}).get("results")) or []):
            body = _text(result.get("content"), where, f"steps[{k}].observation.results[{j}].content")
            if result.get("source_call_id") in ids:
                messages.append({"role": "tool", "tool_call_id": result["source_call_id"], "content": body})
            elif body.strip():
                messages.append({"role": "user", "content": body})
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[: last + 1]


def atif_row(doc: dict, where: Where) -> dict:
    """The SFT row of one ATIF document (module docstring): as recorded, or a ``{"messages", "tools"}`` chat."""
    steps = _steps(doc, where)
    recorded = _as_recorded(steps, where)
    if recorded is not None:
        return recorded
    row: dict[str, Any] = {"messages": _messages(steps, where)}
    tools = (doc.get("agent") or {}).get("tool_definitions")
    if tools:
        row["tools"] = tools
    return row


def check_tools(row: dict, where: Where) -> None:
    """A chat log's ``tools``: a list of OpenAI ``{"type": "function", "function": {"name", ...}}`` objects."""
    tools = row["tools"]
    hint = 'each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}'
    if not isinstance(tools, list):
        raise DataError(*where, "tools", f"expected a list, got {type(tools).__name__}", hint)
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(*where, f"tools[{k}].function.name", "missing or not a string", hint)
        if tool.get("type", "function") != "function":
            raise DataError(*where, f"tools[{k}].type", f"expected 'function', got {tool['type']!r}", hint)


def check_recorded(tokenizer, row: dict) -> None:
    """The ids of a row read as recorded are the policy's: in its vocabulary, and each agent step's completion
    decodes to text that contains the step's message (module docstring)."""
    where = getattr(row, "where", ("SFT row", None))
    ids, size = row["token_ids"], len(tokenizer)
    if ids and max(ids) >= size:
        raise DataError(
            *where,
            "steps",
            f"token id {max(ids)} is outside the tokenizer's {size} ids: the trajectory was recorded with another "
            "model",
            "remove the steps' metrics.prompt_token_ids and completion_token_ids to render the steps with this "
            "model's chat template",
        )
    for field, start, end, message in row["token_checks"]:
        decoded = tokenizer.decode(ids[start:end], skip_special_tokens=True)
        if message.strip() and message.strip() not in decoded:
            raise DataError(
                *where,
                field,
                f"the ids decode to {decoded[:60]!r} with this tokenizer, not to the step's message "
                f"{message[:60]!r}: the trajectory was recorded with another tokenizer",
                "remove the steps' metrics.prompt_token_ids and completion_token_ids to render the steps with this "
                "model's chat template",
            )


def read_json_documents(data: bytes) -> list[tuple[int, Any, DataError | None]] | None:
    """A ``.json`` file's ATIF documents as rows: one trajectory (as Harbor writes it) or a list of them. None
    when the file is not that (JSON rows under a ``.json`` name are read, or refused, as JSONL is)."""
    try:
        doc = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    docs = doc if isinstance(doc, list) else [doc]
    if not docs or not all(is_atif(d) for d in docs):
        return None
    return [(i, d, None) for i, d in enumerate(docs)]

"""``shifu.ToolEnv``: typed Python functions offered to the policy as tools, an environment in a few lines.

Each tool is a function with type hints and a Google-style docstring (``Args:``); its JSON schema is
``transformers.utils.get_json_schema(fn)``. An episode: the policy reads the prompt (with the tools offered in
its own format, chat models), then each turn either calls tools or answers. Every call of a turn runs, in
order, and their results (or the exceptions they raised, as text: the policy can read them and try again) are
the next observation; an answer ends the episode with ``reward(row, answer)``. Two call formats:

- ``format="json"`` (chat models): the instance's ``tools`` (OpenAI function schemas) are rendered through the
  chat template's ``tools=`` where the template renders tools (Qwen, Llama 3.1, Hermes), else described in a
  system message (``system``; by default every tool's schema and the Hermes call syntax); calls are read in
  the Hermes / Qwen syntax ``<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}
  </tool_call>`` (any number in a turn) or Llama 3's JSON ``{"name": ..., "parameters": {...}}``
  (:func:`shifu.models.tool_calls.parse_tool_calls`); a turn that calls should end at its last call
  (``generation.stop: ["</tool_call>"]`` ends it at the first); each result comes back as a ``{"role":
  "tool", "content": "10063"}`` message, in the order of the calls;
- ``format="bracket"`` (plain tokenizers, one tool of one argument): ``[347*29]`` calls the tool on the text
  between the brackets; the turn ends at ``]`` (``generation.stop: ["]"]``), the result comes back as the text
  ``{10063}`` (an exception as ``{error: MESSAGE}``, its message without the type: short for a small model).

``Step.info`` counts ``tool_calls`` and ``tool_errors`` (a call that could not be parsed, named an unknown
tool, or raised).

A ``<tool_call>`` that does not parse is a failed call the policy reads about (``invalid_calls="error"``), or,
with ``invalid_calls="answer"``, the turn is the final answer: what an agent sees from an OpenAI-compatible
server, which returns such a turn as text (so calls are then read in the Hermes syntax only, as the policy
gateway reads them for a template without tools of its own).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from shifu.envs.base import Step

FORMATS = ("json", "bracket")
INVALID = 'the tool call is not valid: expected <tool_call>{"name": ..., "arguments": {...}}</tool_call>'


class ToolEnv:
    """An environment whose actions are tool calls or a final answer (see the module docstring).

    ``tools``: typed functions with docstrings. ``reward(row, answer) -> float``: the reward of the final
    answer (``row`` is the prompt file's row). ``system``: the system message that offers the tools where the
    chat template does not render them (default: the tools' schemas and how to call them). ``prompt_key``: the
    row field that holds the question (a row with ``messages`` starts from them instead).

    Attributes the episode reads: ``tools`` (the OpenAI function schemas; None in the bracket format) and
    ``tools_system`` (``system``). ``invalid_calls``: a ``<tool_call>`` that does not parse is a failed call
    (``"error"``) or the final answer (``"answer"``; the module docstring)."""

    def __init__(
        self,
        tools: list[Callable[..., Any]],
        reward: Callable[[dict, str], float],
        *,
        format: str = "json",
        system: str | None = None,
        prompt_key: str = "prompt",
        invalid_calls: str = "error",
    ):
        from transformers.utils import get_json_schema

        if format not in FORMATS:
            raise ValueError(f"ToolEnv format must be one of {FORMATS}, not {format!r}")
        if not tools or not all(callable(t) for t in tools):
            raise ValueError("ToolEnv needs a non-empty list of functions as tools")
        if invalid_calls not in ("error", "answer"):
            raise ValueError(f"ToolEnv invalid_calls must be 'error' or 'answer', not {invalid_calls!r}")
        if format == "bracket" and (len(tools) != 1 or len(inspect.signature(tools[0]).parameters) != 1):
            raise ValueError("ToolEnv format='bracket' takes exactly one tool of exactly one argument")
        from shifu.models.tool_calls import tools_system_message

        schemas = [get_json_schema(t) for t in tools]  # (raises on a missing type hint or docstring)
        self.functions = {s["function"]["name"]: t for s, t in zip(schemas, tools)}
        self.reward, self.format, self.prompt_key = reward, format, prompt_key
        self.invalid_calls = invalid_calls
        self.tools = schemas if format == "json" else None
        self.tools_system = system if system is not None else tools_system_message(schemas)
        self.row: dict = {}

    def reset(self, row: dict) -> str | list[dict]:
        self.row = row
        if self.format == "bracket":
            return row[self.prompt_key]
        return row.get("messages") or [{"role": "user", "content": row[self.prompt_key]}]

    def step(self, action: str) -> Step:
        calls = self._calls(action)
        if not calls:  # an answer: the episode ends with its reward
            return Step(
                reward=float(self.reward(self.row, action)),
                done=True,
                info={"tool_calls": 0, "tool_errors": 0},
            )
        results = [self._run(*call) for call in calls]
        errors = sum(error for _, error in results)
        if self.format == "bracket":
            result, error = results[0]
            observation: str | list[dict] = (
                "{" + (f"error: {result.split(': ', 1)[-1]}" if error else result) + "}"
            )
        else:
            observation = [{"role": "tool", "content": result} for result, _ in results]
        return Step(observation=observation, info={"tool_calls": len(calls), "tool_errors": errors})

    def _calls(self, action: str) -> list[tuple[str | None, Any]]:
        """``(tool name, arguments)`` of every call in ``action``, in order (name None: unparseable); none for
        an answer."""
        if self.format == "bracket":
            m = re.search(r"\[([^\[\]]*)\]\s*$", action)
            if m is None:
                return [] if "[" not in action else [(None, "expected [argument]")]
            return [(next(iter(self.functions)), m.group(1))]
        from shifu.models.tool_calls import parse_tool_calls

        _, calls = parse_tool_calls(action, "hermes")
        # invalid_calls="answer": read as the gateway reads it, what does not parse is text
        if not calls and self.invalid_calls == "answer":
            return []
        if not calls:
            _, calls = parse_tool_calls(action, "llama3_json")
        if not calls:  # a <tool_call> that does not parse is a failed call, not an answer
            return [(None, INVALID)] if "<tool_call>" in action else []
        out = []
        for c in calls:
            try:
                arguments = json.loads(c["function"]["arguments"])
            except ValueError:
                arguments = None
            ok = isinstance(arguments, dict)
            out.append((c["function"]["name"], arguments) if ok else (None, "arguments must be an object"))
        return out

    def _run(self, name: str | None, arguments: Any) -> tuple[str, bool]:
        """The tool's result as text and whether it failed (the exception's text is the result then)."""
        if name is None:
            return str(arguments), True
        if name not in self.functions:
            return f"unknown tool {name!r}; the tools are {', '.join(self.functions)}", True
        fn = self.functions[name]
        try:
            out = fn(**arguments) if isinstance(arguments, dict) else fn(arguments)
        except Exception as e:  # noqa: BLE001 (the policy reads what went wrong)
            return f"{type(e).__name__}: {e}", True
        return str(out), False

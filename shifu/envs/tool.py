"""``shifu.ToolEnv``: typed Python functions offered to the policy as tools, an environment in a few lines.

Each tool is a function with type hints and a Google-style docstring (``Args:``); its JSON schema is
``transformers.utils.get_json_schema(fn)``. An episode: the policy reads the prompt (with the tools described
in a system message, chat format), then each turn either calls a tool or answers. A call runs the tool and
shows its result (or the exception it raised, as text: the policy can read it and try again) as the next
observation; an answer ends the episode with ``reward(row, answer)``. Two call formats:

- ``format="json"`` (chat models): ``<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}
  </tool_call>``; the turn should end at ``</tool_call>`` (``ppo.env.stop: ["</tool_call>"]``), the result
  comes back as a ``{"role": "tool", "content": "10063"}`` message;
- ``format="bracket"`` (plain tokenizers, one tool of one argument): ``[347*29]`` calls the tool on the text
  between the brackets; the turn ends at ``]`` (``ppo.env.stop: ["]"]``), the result comes back as the text
  ``{10063}`` (an exception as ``{error: MESSAGE}``, its message without the type: short for a small model).

``Step.info`` counts ``tool_calls`` and ``tool_errors`` (a call that could not be parsed, named an unknown
tool, or raised).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from shifu.envs.base import Step

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
FORMATS = ("json", "bracket")


class ToolEnv:
    """An environment whose actions are tool calls or a final answer (see the module docstring).

    ``tools``: typed functions with docstrings. ``reward(row, answer) -> float``: the reward of the final
    answer (``row`` is the prompt file's row). ``system``: the system message of the json format (default: the
    tools' schemas and how to call them). ``prompt_key``: the row field that holds the question (a row with
    ``messages`` starts from them instead)."""

    def __init__(
        self,
        tools: list[Callable[..., Any]],
        reward: Callable[[dict, str], float],
        *,
        format: str = "json",
        system: str | None = None,
        prompt_key: str = "prompt",
    ):
        from transformers.utils import get_json_schema

        if format not in FORMATS:
            raise ValueError(f"ToolEnv format must be one of {FORMATS}, not {format!r}")
        if not tools or not all(callable(t) for t in tools):
            raise ValueError("ToolEnv needs a non-empty list of functions as tools")
        if format == "bracket" and (len(tools) != 1 or len(inspect.signature(tools[0]).parameters) != 1):
            raise ValueError("ToolEnv format='bracket' takes exactly one tool of exactly one argument")
        self.schemas = [get_json_schema(t) for t in tools]  # (raises on a missing type hint or docstring)
        self.tools = {s["function"]["name"]: t for s, t in zip(self.schemas, tools)}
        self.reward, self.format, self.prompt_key = reward, format, prompt_key
        self.system = system if system is not None else self.describe()
        self.row: dict = {}

    def describe(self) -> str:
        """The default system message of the json format: every tool's schema and the call syntax."""
        listed = "\n".join(json.dumps(s["function"]) for s in self.schemas)
        return (
            f'You can call these tools:\n{listed}\nTo call one, write <tool_call>{{"name": ..., "arguments": '
            "{...}}</tool_call> and wait for its result. When you know the answer, write it without a tool call."
        )

    def reset(self, row: dict) -> str | list[dict]:
        self.row = row
        if self.format == "bracket":
            return row[self.prompt_key]
        messages = row.get("messages") or [{"role": "user", "content": row[self.prompt_key]}]
        return [{"role": "system", "content": self.system}, *messages]

    def step(self, action: str) -> Step:
        call = self._parse(action)
        if call is None:  # an answer: the episode ends with its reward
            return Step(
                reward=float(self.reward(self.row, action)),
                done=True,
                info={"tool_calls": 0, "tool_errors": 0},
            )
        result, error = self._run(*call)
        if self.format == "bracket":
            observation: str | list[dict] = (
                "{" + (f"error: {result.split(': ', 1)[-1]}" if error else result) + "}"
            )
        else:
            observation = [{"role": "tool", "content": result}]
        return Step(observation=observation, info={"tool_calls": 1, "tool_errors": int(error)})

    def _parse(self, action: str) -> tuple[str | None, Any] | None:
        """``(tool name, arguments)`` of the call in ``action`` (name None: unparseable), or None for an answer."""
        if self.format == "bracket":
            m = re.search(r"\[([^\[\]]*)\]\s*$", action)
            if m is None:
                return None if "[" not in action else (None, "expected [argument]")
            return next(iter(self.tools)), m.group(1)
        m = CALL.search(action)
        if m is None:
            return None
        try:
            call = json.loads(m.group(1).strip())
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": ..., "arguments": {...}}')
            arguments = call.get("arguments", {})
            if not isinstance(arguments, dict):
                raise ValueError("arguments must be an object")
        except ValueError as e:
            return None, f"the tool call is not valid: {e}"
        return call["name"], arguments

    def _run(self, name: str | None, arguments: Any) -> tuple[str, bool]:
        """The tool's result as text and whether it failed (the exception's text is the result then)."""
        if name is None:
            return str(arguments), True
        if name not in self.tools:
            return f"unknown tool {name!r}; the tools are {', '.join(self.tools)}", True
        try:
            out = (
                self.tools[name](**arguments) if isinstance(arguments, dict) else self.tools[name](arguments)
            )
        except Exception as e:  # noqa: BLE001 (the policy reads what went wrong)
            return f"{type(e).__name__}: {e}", True
        return str(out), False

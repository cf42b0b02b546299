"""The engine's request (:class:`ChatRequest`): what every dialect's request becomes (the chat dialect's:
:mod:`shifu.gateway.chat`, the Responses': :mod:`shifu.gateway.responses`, the Messages': :mod:`shifu.gateway.messages`),
and :func:`bad`, the 400 that names a field. Below it the engine renders, samples, answers and records without
knowing which dialect asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shifu.http.requests import RequestError

NOT_OFFERED = "tool_not_offered"  # the code of a forced call of a tool the request does not offer


@dataclass
class ChatRequest:
    """The engine's request, whichever dialect asked; ``messages`` normalised to ``{"role", "content": str | None,
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

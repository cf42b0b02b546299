"""``POST /v1/responses`` as typed models: the request (:class:`ResponsesRequest`) and the answer
(:class:`Response`), OpenAI's Responses API shapes as far as the gateway takes them.

Taken: ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts, ``function_call``
and ``function_call_output`` items), ``instructions``, function ``tools``, ``tool_choice`` (``auto``,
``none``, ``required`` or ``{"type": "function", "name"}``: a forced call, :mod:`shifu.gateway.completions`),
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p`` (both the trainer's when
recording), ``previous_response_id``, ``text.format`` (``text``, or ``json_object`` / ``json_schema``: a JSON
answer, :func:`shifu.gateway.completions.json_grammar`; serving only), ``stream`` (events: :mod:`shifu.gateway.responses.stream`). Read and
changing nothing: ``store``, ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``truncation: "disabled"``, ``include`` of
``reasoning.encrypted_content`` (there are no reasoning items). Anything else is refused with a 400 that names
it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shifu.gateway.typed import Count, Strict, by_type

Status = Literal["in_progress", "completed", "incomplete"]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class ResponsesInputText(Strict):
    type: Literal["input_text"]
    text: str


class ResponsesOutputText(Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict] | None = None
    logprobs: list[dict] | None = None


class ResponsesMessageItem(Strict):
    """A message of the conversation; ``developer`` is read as ``system``."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[by_type(ResponsesInputText, ResponsesOutputText)]
    id: str | None = None
    status: Status | None = None


class ResponsesFunctionCallItem(Strict):
    """A call the model made (sent back in the history): ``arguments`` is a JSON string."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None


class ResponsesFunctionCallOutputItem(Strict):
    """A tool's result for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[by_type(ResponsesInputText)]
    id: str | None = None
    status: Status | None = None


InputItem = by_type(
    ResponsesMessageItem, ResponsesFunctionCallItem, ResponsesFunctionCallOutputItem, default="message"
)


class ResponsesFunctionTool(Strict):
    """A function the model may call (the Responses shape: name and parameters at the top level)."""

    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(Strict):
    """A call of this function, forced."""

    type: Literal["function"]
    name: str


ToolChoice = Literal["auto", "none", "required"] | ResponsesNamedToolChoice


class ResponsesTextFormat(Strict):
    type: Literal["text"]


class ResponsesJsonObjectFormat(Strict):
    """A JSON object answer (any object), as chat's ``response_format`` ``json_object``."""

    type: Literal["json_object"]


class ResponsesJsonSchemaFormat(Strict):
    """An answer following ``schema``, as chat's ``response_format`` ``json_schema`` (llguidance's masks)."""

    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema", description="The JSON Schema of the answer.")
    description: str | None = None
    strict: bool | None = Field(None, description="Read: the answer is constrained either way.")


class ResponsesText(Strict):
    format: by_type(ResponsesTextFormat, ResponsesJsonObjectFormat, ResponsesJsonSchemaFormat) | None = Field(
        None,
        description=(
            "text (the default), or a JSON answer constrained by llguidance's grammar masks as chat's "
            "response_format is: refused with code constrained_decoding by a recording gateway and with a "
            "forced tool call; a schema llguidance cannot follow is refused with code invalid_json_schema."
        ),
    )
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(Strict):
    """A Responses API request (module docstring)."""

    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None
    text: ResponsesText | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = (
        None  # the policy writes no reasoning items
    )
    stream: bool | None = None


# ------------------------------------------------------------------------------------------- answers
class ResponsesOutputMessage(Strict):
    type: Literal["message"]
    id: str
    status: Status
    role: Literal["assistant"]
    content: list[ResponsesOutputText]


class ResponsesOutputFunctionCall(Strict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


class ResponsesIncomplete(Strict):
    reason: Literal["max_output_tokens"]


class ResponsesInputDetails(Strict):
    cached_tokens: int


class ResponsesOutputDetails(Strict):
    reasoning_tokens: int


class ResponsesUsage(Strict):
    input_tokens: int
    input_tokens_details: ResponsesInputDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputDetails
    total_tokens: int


class Response(Strict):
    """The answer: ``output`` holds the message (its text) and a ``function_call`` item per call; ``status``
    is ``incomplete`` when the token budget ended it. ``shifu``: the sampling used and whether it was
    recorded (as in a chat completion's answer)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Status
    error: None
    incomplete_details: ResponsesIncomplete | None
    instructions: str | None
    model: str
    output: list[by_type(ResponsesOutputMessage, ResponsesOutputFunctionCall)]
    parallel_tool_calls: bool
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tool_choice: ToolChoice
    tools: list[ResponsesFunctionTool]
    store: bool
    metadata: dict[str, str]
    text: ResponsesText
    truncation: Literal["disabled"]
    usage: ResponsesUsage
    shifu: dict


# ------------------------------------------------------------------------------------ stream events
class _Event(Strict):
    sequence_number: int


class ResponsesResponseCreated(_Event):
    """The response before sampling: ``status: "in_progress"``, no output, ``usage: null``."""

    type: Literal["response.created"]
    response: dict


class ResponsesResponseInProgress(ResponsesResponseCreated):
    type: Literal["response.in_progress"]


class ResponsesResponseCompleted(_Event):
    type: Literal["response.completed"]
    response: Response


class ResponsesResponseIncomplete(ResponsesResponseCompleted):
    type: Literal["response.incomplete"]


class ResponsesOutputItemAdded(_Event):
    type: Literal["response.output_item.added"]
    output_index: int
    item: by_type(ResponsesOutputMessage, ResponsesOutputFunctionCall)


class ResponsesOutputItemDone(ResponsesOutputItemAdded):
    type: Literal["response.output_item.done"]


class ResponsesContentPartAdded(_Event):
    type: Literal["response.content_part.added"]
    item_id: str
    output_index: int
    content_index: int
    part: ResponsesOutputText


class ResponsesContentPartDone(ResponsesContentPartAdded):
    type: Literal["response.content_part.done"]


class ResponsesOutputTextDelta(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list


class ResponsesOutputTextDone(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list


class ResponsesFunctionCallArgumentsDelta(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ResponsesFunctionCallArgumentsDone(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponsesStreamError(_Event):
    """A failure after the stream began: ``code``, ``message`` and the field at fault (``param``)."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


STREAM_EVENTS = (
    ResponsesResponseCreated,
    ResponsesResponseInProgress,
    ResponsesOutputItemAdded,
    ResponsesContentPartAdded,
    ResponsesOutputTextDelta,
    ResponsesOutputTextDone,
    ResponsesContentPartDone,
    ResponsesFunctionCallArgumentsDelta,
    ResponsesFunctionCallArgumentsDone,
    ResponsesOutputItemDone,
    ResponsesResponseCompleted,
    ResponsesResponseIncomplete,
    ResponsesStreamError,
)

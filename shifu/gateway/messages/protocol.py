"""``POST /v1/messages`` as typed models: the request (:class:`MessagesRequest`) and the answer
(:class:`MessagesAnswer`), Anthropic's Messages API shapes as far as the gateway takes them.

Taken: ``system`` (a string or text blocks), ``messages`` (content a string or blocks: ``text``,
``tool_use``, ``tool_result``), ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
(``auto``, ``none``, or a forced call: ``any``, or ``tool`` with its ``name``; :mod:`shifu.gateway.completions`), ``max_tokens`` (required, as in Anthropic's API),
``stop_sequences``, ``temperature``, ``top_p`` (both the trainer's when recording), ``output_config.format``
(a JSON schema the answer follows, :func:`shifu.gateway.completions.json_grammar`; serving only), ``stream`` (events:
:mod:`shifu.gateway.messages.stream`). Read and changing nothing: ``metadata``, ``service_tier``,
``inference_geo``, ``cache_control`` (on the request, its blocks and tools). Anything else (images, thinking,
``top_k``) is refused with a 400 that names it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shifu.gateway.typed import Count, Strict, by_type

MAX_STOP_SEQUENCES = 8
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class MessagesCacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class MessagesTextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: MessagesCacheControl | None = None
    citations: None = None


class MessagesToolUseBlock(Strict):
    """A call the model made (sent back in the history): ``input`` is the arguments object."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: MessagesCacheControl | None = None


class MessagesToolResultBlock(Strict):
    """A tool's result for the call ``tool_use_id`` (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[MessagesTextBlock] | None = None
    is_error: bool | None = None
    cache_control: MessagesCacheControl | None = None


Block = by_type(MessagesTextBlock, MessagesToolUseBlock, MessagesToolResultBlock)


class MessagesMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class MessagesTool(Strict):
    type: Literal["custom"] | None = None
    name: Name
    description: str | None = None
    input_schema: dict
    cache_control: MessagesCacheControl | None = None


class MessagesToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class MessagesToolChoiceAny(Strict):
    """A call of any tool, forced."""

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class MessagesToolChoiceTool(Strict):
    """A call of the tool ``name``, forced."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class MessagesToolChoiceNone(Strict):
    type: Literal["none"]


class MessagesMetadata(Strict):
    user_id: str | None = None


StopSequence = Annotated[str, Field(min_length=1, max_length=64)]


class MessagesJsonOutputFormat(Strict):
    """An answer following ``schema`` (Anthropic's structured outputs), as chat's ``response_format``
    ``json_schema``: llguidance's grammar masks."""

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema", description="The JSON Schema of the answer.")


class MessagesOutputConfig(Strict):
    format: MessagesJsonOutputFormat | None = Field(
        None,
        description=(
            "A JSON answer constrained by llguidance's grammar masks as chat's response_format is: refused by a "
            "recording gateway (the trainer's recomputation would not apply the masks) and with a forced tool "
            "call; a schema llguidance cannot follow is refused."
        ),
    )


class MessagesRequest(Strict):
    """A Messages API request (module docstring)."""

    model: str
    max_tokens: Count
    messages: Annotated[list[MessagesMessage], Field(min_length=1)]
    system: str | list[MessagesTextBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: (
        by_type(MessagesToolChoiceAuto, MessagesToolChoiceAny, MessagesToolChoiceTool, MessagesToolChoiceNone)
        | None
    ) = None
    stop_sequences: Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: MessagesMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: MessagesOutputConfig | None = None
    cache_control: MessagesCacheControl | None = None
    inference_geo: str | None = None
    stream: bool | None = None


# ------------------------------------------------------------------------------------------- answers
class MessagesAnswerText(Strict):
    type: Literal["text"]
    text: str


class MessagesAnswerToolUse(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class MessagesUsage(Strict):
    input_tokens: int
    output_tokens: int


class MessagesAnswer(Strict):
    """The answer: ``content`` holds the text block and a ``tool_use`` block per call; ``stop_reason``
    ``end_turn`` (the policy ended its turn), ``max_tokens``, ``stop_sequence`` (which one in
    ``stop_sequence``) or ``tool_use``. ``shifu``: the sampling used and whether it was recorded."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[by_type(MessagesAnswerText, MessagesAnswerToolUse)]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessagesUsage
    shifu: dict


class MessagesErrorDetail(Strict):
    type: str
    message: str


class MessagesError(Strict):
    """Anthropic's error shape; ``error.type`` is ``invalid_request_error``, ``authentication_error``,
    ``not_found_error``, ``request_too_large``, ``api_error`` ..."""

    type: Literal["error"]
    error: MessagesErrorDetail


# ------------------------------------------------------------------------------------ stream events
class MessagesStartedMessage(Strict):
    """The message as ``message_start`` shows it: no content, no stop reason yet."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: Annotated[list, Field(max_length=0)]
    stop_reason: None
    stop_sequence: None
    usage: MessagesUsage


class MessagesMessageStart(Strict):
    type: Literal["message_start"]
    message: MessagesStartedMessage


class MessagesContentBlockStart(Strict):
    type: Literal["content_block_start"]
    index: int
    content_block: by_type(MessagesAnswerText, MessagesAnswerToolUse)


class MessagesTextDelta(Strict):
    type: Literal["text_delta"]
    text: str


class MessagesInputJsonDelta(Strict):
    type: Literal["input_json_delta"]
    partial_json: str


class MessagesContentBlockDelta(Strict):
    type: Literal["content_block_delta"]
    index: int
    delta: by_type(MessagesTextDelta, MessagesInputJsonDelta)


class MessagesContentBlockStop(Strict):
    type: Literal["content_block_stop"]
    index: int


class MessagesStop(Strict):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None


class MessagesOutputUsage(Strict):
    output_tokens: int


class MessagesMessageDelta(Strict):
    type: Literal["message_delta"]
    delta: MessagesStop
    usage: MessagesOutputUsage


class MessagesMessageStop(Strict):
    type: Literal["message_stop"]


STREAM_EVENTS = (
    MessagesMessageStart,
    MessagesContentBlockStart,
    MessagesContentBlockDelta,
    MessagesContentBlockStop,
    MessagesMessageDelta,
    MessagesMessageStop,
    MessagesError,
)

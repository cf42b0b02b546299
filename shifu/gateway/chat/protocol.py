"""``POST /v1/chat/completions`` as typed models: the request (:class:`ChatCompletionRequest`), the answer
(:class:`ChatCompletion`) and the stream's chunks (:class:`ChatCompletionChunk`), OpenAI's chat shapes (with
vLLM's token fields) as far as the gateway takes them.

Taken: ``model``, ``messages`` (roles system / developer / user / assistant / tool; content a string or text
parts; assistant ``tool_calls``; tool ``tool_call_id``), ``tools`` (functions), ``tool_choice`` (``"auto"``,
``"none"``, ``"required"`` or ``{"type": "function", "function": {"name"}}``: a forced call,
:mod:`shifu.gateway.completions`), ``parallel_tool_calls``, ``n``, ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``, ``top_logprobs``, vLLM's ``return_token_ids``,
``stream``, ``stream_options`` (``include_usage``), ``response_format`` (``text``, ``json_object`` or
``json_schema``: :func:`shifu.gateway.completions.json_grammar`).

Fields that change nothing sampled are read and accepted (:data:`NO_OP_FIELDS`: ``user``, ``store``,
``metadata``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``modalities: ["text"]``,
``frequency_penalty`` / ``presence_penalty`` 0, ``logit_bias: {}``, and vLLM's ``top_k`` 0 or -1, ``min_p`` 0,
``repetition_penalty`` 1); any other value of those that would change what is sampled is refused with a 400
(code ``unsupported_value``) that says so (shifu records the exact log-probs of what it sampled, and its sampler
and the trainer's recomputation implement none of them), as is ``reasoning_effort``. In messages, ``name`` (any
role), ``function_call`` / ``audio`` / ``annotations`` null (or ``[]``) on an assistant message, ``index`` in a
history tool call and ``cache_control`` on a text part are read and change nothing. Any other field is refused
with a 400 that names it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, WithJsonSchema

from shifu.gateway.typed import Count, Integral, Strict, by_type

MAX_N = 16  # choices per request
MAX_STOPS, MAX_STOP_CHARS = 4, 64  # stop strings per request (OpenAI's 4) and the longest one
MAX_TOP_LOGPROBS = 20
EXACT = (
    "shifu records the exact log-probs of what it samples, and neither its sampler nor the trainer's "
    "recomputation implements it yet"
)
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
Id = Annotated[int, Field(ge=0)]


def only(kind, allowed: list, why: str, schema: dict) -> Any:
    """A field of type ``kind`` taken only at the values ``allowed`` (each changes nothing); any other value of
    the right JSON type is refused (code ``unsupported_value``) saying ``why``. ``schema``: its JSON Schema."""

    def check(value):
        if value is not None and not any(value == a and type(value) is not bool for a in allowed):
            shown = " or ".join(json.dumps(a) for a in allowed)
            raise ValueError(f"only {shown} is taken{why}")
        return value

    return Annotated[kind, AfterValidator(check), WithJsonSchema(schema)]


def _neutral(kind, allowed: list, what: str, why: str = f" (it changes nothing): {EXACT}") -> Any:
    """A sampling knob taken only where it is off (``allowed``); ``what``: its description."""
    described = f"{what}; any other value would change what is sampled: refused with code unsupported_value"
    schema = {"enum": [*allowed, None], "description": f"{described} ({EXACT})."}
    return only(kind | None, allowed, why, schema)


# ------------------------------------------------------------------------------------------ requests
class ChatTextPart(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = Field(None, description="Read; changes nothing.")


Text = str | list[ChatTextPart]


class ChatFunctionCall(Strict):
    name: str
    arguments: str = Field(description="The arguments as JSON text (a JSON object, as the model wrote it).")


class ChatHistoryToolCall(Strict):
    """A call of an assistant message sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ChatFunctionCall
    index: Annotated[Id, Integral] = Field(None, description="Read; changes nothing.")


class ChatSystemMessage(Strict):
    """A system message; ``developer`` is read as ``system``."""

    role: Literal["system", "developer"]
    content: Text = Field(description="Text, or an array of text parts joined in order.")
    name: str = Field(None, description="Read; changes nothing.")


class ChatUserMessage(Strict):
    role: Literal["user"]
    content: Text = Field(description="Text, or an array of text parts joined in order.")
    name: str = Field(None, description="Read; changes nothing.")


_NULL_ONLY = {"type": "null", "description": "null only (read; changes nothing)."}


class ChatAssistantMessage(Strict):
    """A message this gateway produced is rendered as the text the policy sampled (its calls as written, the
    stop string it cut included), so the next prompt extends the last one token for token where the template
    allows."""

    role: Literal["assistant"]
    content: Text | None = None
    name: str = Field(None, description="Read; changes nothing.")
    refusal: str | None = None
    tool_calls: list[ChatHistoryToolCall] | None = None
    function_call: only(Any, [None], ": send a call of this gateway's answers in tool_calls", _NULL_ONLY) = (
        None
    )
    audio: only(Any, [None], ": this policy reads and writes text only", _NULL_ONLY) = None
    annotations: only(
        list | None,
        [[]],
        ": this policy cites nothing",
        {
            "type": ["array", "null"],
            "maxItems": 0,
            "description": "null or [] only (read; changes nothing).",
        },
    ) = None


class ChatToolMessage(Strict):
    role: Literal["tool"]
    content: Text = Field(description="Text, or an array of text parts joined in order.")
    tool_call_id: str
    name: str = Field(None, description="The function's name (read; changes nothing).")


ChatMessage = by_type(
    ChatSystemMessage,
    ChatUserMessage,
    ChatAssistantMessage,
    ChatToolMessage,
    key="role",
    aliases={"developer": "system"},
)


class ChatFunction(Strict):
    name: Name
    description: str | None = None
    parameters: dict | None = Field(None, description="The arguments' JSON Schema.")
    strict: bool | None = Field(None, description="Read, not enforced.")


class ChatTool(Strict):
    """A function the model may call: rendered by the chat template where it takes tools, otherwise described in
    a system message with the Hermes syntax ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    type: Literal["function"]
    function: ChatFunction


class ChatToolChoiceFunction(Strict):
    name: str


class ChatNamedToolChoice(Strict):
    """A call of this function, forced."""

    type: Literal["function"]
    function: ChatToolChoiceFunction


class ChatStreamOptions(Strict):
    include_usage: bool | None = Field(
        None, description="A last chunk with choices [] and the usage; every other chunk has usage null."
    )
    include_obfuscation: bool | None = Field(None, description="Read; no padding is sent either way.")


class ChatResponseFormatText(Strict):
    type: Literal["text"]


class ChatResponseFormatJsonObject(Strict):
    type: Literal["json_object"]


class ChatJsonSchema(Strict):
    name: str
    description: str | None = None
    schema_: dict | None = Field(
        None, alias="schema", description="The JSON Schema of the answer (null: any object)."
    )
    strict: bool | None = Field(None, description="Read: the answer is constrained either way.")


class ChatResponseFormatJsonSchema(Strict):
    type: Literal["json_schema"]
    json_schema: ChatJsonSchema


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
_READ = "Read; changes nothing."


class ChatCompletionRequest(Strict):
    """A chat completion request (module docstring). An optional field sent as null means the same as leaving
    it out."""

    model: str = Field(description="The served model's name (GET /v1/models).")
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ChatNamedToolChoice | None = Field(
        None,
        description=(
            "none: tools are not offered and the output is not parsed for calls. required, or a named function "
            "(one of tools; else 400 tool_not_offered): the template's call opening (<tool_call>, and "
            '{"name": NAME, "arguments": for a named one) follows the generation prompt as prompt tokens (read, '
            "never sampled; a session records them as read), the policy samples the rest, and the answer "
            "parses both as a call."
        ),
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: only the first call of a completion is returned."
    )
    n: Annotated[int, Field(ge=1, le=MAX_N), Integral] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(
        None,
        description=(
            "0: greedy. Log-probs are under logits / temperature (1 when greedy). A recording gateway samples "
            "at the trainer's temperature and ignores this (the answer's shifu field says what was used)."
        ),
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="Ignored by a recording gateway, like temperature."
    )
    max_tokens: Count | None = Field(
        None,
        description="Capped by the gateway's --max-tokens and the room the prompt leaves in the model's positions.",
    )
    max_completion_tokens: Count | None = Field(
        None, description="max_tokens by its new name; wins over max_tokens."
    )
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = Field(
        None,
        description=(
            "A completion ends at the token that completes a stop string; the content leaves the stop string "
            "out, token_ids keep every sampled token."
        ),
    )
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1), Integral] | None = Field(
        None,
        description=(
            "A seeded request is sampled in a call of its own: the same request and seed give the same tokens. "
            "Ignored by a recording gateway."
        ),
    )
    logprobs: bool | None = Field(
        None,
        description="The log-prob of every sampled token (streamed: with the content delta of its text).",
    )
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), Integral] | None = Field(
        None, description="Read with logprobs true."
    )
    return_token_ids: bool | None = Field(
        None, description="vLLM's: the answer carries prompt_token_ids and each choice's token_ids."
    )
    stream: bool | None = Field(
        None,
        description=(
            "true: the answer as chat.completion.chunk Server-Sent Events while it is sampled (the 200 "
            "response's text/event-stream); text that may be a stop string or a tool call's opening is held back "
            "until known, each tool call is sent once complete, logprobs with the content deltas of their tokens' "
            "text (the rest on the finish_reason chunk), token_ids on each choice's finish_reason chunk."
        ),
    )
    stream_options: ChatStreamOptions | None = Field(None, description="Read with stream true.")
    response_format: (
        by_type(ChatResponseFormatText, ChatResponseFormatJsonObject, ChatResponseFormatJsonSchema) | None
    ) = Field(
        None,
        description=(
            "text (the default), or a JSON answer: every choice is constrained to the schema's compact JSON "
            "(json_object: any object) by llguidance's grammar masks, and its log-probs are those of the "
            "constrained distribution. Refused with code constrained_decoding by a recording gateway (the "
            "trainer's recomputation would not apply the masks), with a forced tool call, and with "
            "top_logprobs; a schema llguidance cannot follow is refused with code invalid_json_schema."
        ),
    )
    # read, and changing nothing sampled
    user: str | None = Field(None, description=_READ)
    store: bool | None = Field(None, description="Read; changes nothing. Nothing is stored.")
    metadata: dict[str, str] | None = Field(None, description=_READ)
    service_tier: str | None = Field(None, description=_READ)
    prompt_cache_key: str | None = Field(None, description=_READ)
    safety_identifier: str | None = Field(None, description=_READ)
    modalities: only(
        list[str] | None,
        [["text"]],
        ": this policy writes text",
        {
            "type": ["array", "null"],
            "minItems": 1,
            "maxItems": 1,
            "items": {"const": "text"},
            "description": '["text"] only: this policy writes text.',
        },
    ) = None
    frequency_penalty: _neutral(float, [0], "0 only") = None
    presence_penalty: _neutral(float, [0], "0 only") = None
    logit_bias: only(
        dict | None,
        [{}],
        f" (it changes nothing): {EXACT}",
        {
            "type": ["object", "null"],
            "maxProperties": 0,
            "description": (
                "{} only; a bias would change what is sampled: refused with code unsupported_value "
                f"({EXACT})."
            ),
        },
    ) = None
    top_k: _neutral(float, [0, -1], "vLLM's: 0 or -1 (off) only") = None
    min_p: _neutral(float, [0], "vLLM's: 0 (off) only") = None
    repetition_penalty: _neutral(float, [1], "vLLM's: 1 (off) only") = None
    reasoning_effort: only(
        Any,
        [None],
        f": a thinking switch would change the prompt and what is sampled, and {EXACT}",
        {
            "type": "null",
            "description": (
                "null only: a thinking switch would change what is sampled: refused with code "
                f"unsupported_value ({EXACT})."
            ),
        },
    ) = None

    @classmethod
    def unknown_hint(cls) -> str:
        """What an unknown-field refusal lists: the fields taken, then those read where they change nothing."""
        return (
            f"this gateway takes {', '.join(TAKEN)}, and accepts {', '.join(NO_OP_FIELDS)} where they change "
            "nothing"
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
TAKEN = tuple(
    f for f in ChatCompletionRequest.model_fields if f not in NO_OP_FIELDS and f != "reasoning_effort"
)


# ------------------------------------------------------------------------------------------- answers
class ChatAnswerFunction(Strict):
    name: str
    arguments: str


class ChatAnswerToolCall(Strict):
    id: str
    type: Literal["function"]
    function: ChatAnswerFunction


class ChatAnswerMessage(Strict):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: Annotated[list[ChatAnswerToolCall], Field(min_length=1)] = None


ByteList = list[Annotated[int, Field(ge=0, le=255)]] | None


class ChatTopLogprob(Strict):
    token: str
    logprob: Annotated[float, Field(le=0)]
    bytes: ByteList


class ChatTokenLogprob(Strict):
    token: str
    logprob: Annotated[float, Field(le=0)] = Field(
        description="log pi(token) under logits / T; -9999.0 for an impossible alternative."
    )
    bytes: ByteList
    top_logprobs: list[ChatTopLogprob] = None


class ChatLogprobs(Strict):
    content: list[ChatTokenLogprob] = Field(
        description="One entry per sampled token (token_ids), the ending EOS included."
    )
    refusal: None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(Strict):
    index: Id
    message: ChatAnswerMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None
    token_ids: list[Id] = Field(None, description="Every sampled id (with return_token_ids).")


class ChatUsage(Strict):
    prompt_tokens: Annotated[int, Field(ge=1)]
    completion_tokens: Id
    total_tokens: Annotated[int, Field(ge=1)]


class ShifuSampling(Strict):
    """How the completion was sampled."""

    policy_version: int
    temperature: Annotated[float, Field(ge=0, description="0: greedy.")]
    top_p: float
    top_k: Id
    max_tokens: Annotated[int, Field(ge=1, description="This completion's token budget.")]
    recorded: bool


class ChatCompletion(Strict):
    """The answer of ``stream: false``."""

    id: str = Field(description="The call's id (POST /rl/set_reward names a call by it).")
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: Annotated[list[ChatChoice], Field(min_length=1)]
    usage: ChatUsage
    prompt_token_ids: list[Id] = Field(
        None, description="The prompt as the server rendered it (with return_token_ids)."
    )
    shifu: ShifuSampling


# ------------------------------------------------------------------------------------------- chunks
class ChatDeltaToolCall(Strict):
    index: Id
    id: str
    type: Literal["function"]
    function: ChatAnswerFunction


class ChatDelta(Strict):
    role: Literal["assistant"] = None
    content: str = None
    tool_calls: Annotated[list[ChatDeltaToolCall], Field(min_length=1, max_length=1)] = None


class ChatChunkChoice(Strict):
    index: Id
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = Field(
        description="With logprobs: a content delta's tokens; on the finish_reason chunk the tokens never shown "
        "(EOS, a stop string's, a tool call's). The chunks' join into the answer's logprobs.content."
    )
    token_ids: list[Id] = Field(None, description="On the finish_reason chunk, with return_token_ids.")


class ChatCompletionChunk(Strict):
    """One event of a streamed completion (``data: {chunk}``); the stream ends with ``data: [DONE]``, or with
    ``data: {"error": {...}}`` when the sampler fails after the first chunk."""

    id: str = Field(description="The call's id, the same in every chunk (POST /rl/set_reward).")
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None = None
    prompt_token_ids: list[Id] = Field(
        None, description="On each choice's first chunk, with return_token_ids."
    )
    choices: Annotated[list[ChatChunkChoice], Field(max_length=1)]
    usage: ChatUsage | None = Field(
        None,
        description="With stream_options.include_usage: null, and the usage on the last chunk (choices []).",
    )
    shifu: ShifuSampling = None

"""One chat completion from request to answer: the prompt rendered through the chat template
(:func:`prompt_ids`), the sampler job (:func:`make_job`), and the OpenAI-style answer with vLLM's token fields
(:func:`answer`), which also yields the segments a recording session keeps.

**Prompts.** Messages always go through the tokenizer's chat template, with the generation prompt: tools
natively where the template renders them, else in a Hermes system message
(:mod:`shifu.models.tool_calls`). An assistant message this gateway produced is rendered as the text the
policy sampled, as the ids it sampled (:class:`shifu.gateway.sessions.CompletionMemory`), so that the next
prompt extends the previous one token for token wherever the template renders earlier turns unchanged.

**Forced calls.** With ``tool_choice`` ``"required"`` or a named function, the call's opening (and the
function's name) follows the generation prompt as prompt ids (:func:`forced_opening`): read, never sampled, so
a session records them among the read ids. The answer parses the opening and the completion together, and
remembers both as the assistant message, so the next prompt still extends this one token for token.

**JSON answers.** ``response_format`` ``json_object`` / ``json_schema`` constrain every choice to the
schema's JSON (compact) with llguidance's grammar masks (:mod:`shifu.gateway.engine`); ``strict`` or not, the
answer follows the schema whenever it ends within its budget. The log-probs are then those of the constrained
distribution, which no trainer recomputes: a recording gateway refuses them (400 ``constrained_decoding``), and
any gateway refuses them with a forced call or ``top_logprobs``; a schema llguidance cannot follow is a 400
``invalid_json_schema``.

**Answers.** ``message.content`` is the completion's text without special tokens, cut before the earliest
stop string (OpenAI's rule); tool calls in the model's syntax become ``message.tool_calls`` with
``finish_reason: "tool_calls"`` (content: the text before the first call, or null). ``token_ids`` (with
``return_token_ids``) are every sampled id, the ending EOS and the stop string's tokens included, and
``logprobs.content`` has one entry per sampled id: both describe what was sampled, not only the text.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass

from shifu.gateway.engine import Choice, Job
from shifu.gateway.protocol import NOT_OFFERED, ChatRequest, bad
from shifu.gateway.sessions import CompletionMemory, Segment
from shifu.generation.stops import cut_at_stop
from shifu.http.requests import RequestError
from shifu.models.tool_calls import ToolFormat, call_opening, parse_tool_calls, render_messages

MIN_TEMPERATURE = 1e-5  # below: greedy (logits / T would overflow float32), as vLLM does
CONSTRAINED = "constrained_decoding"  # the code of a response_format this gateway cannot apply to the request
MIN_TOP_P = 1e-6  # below: the same set (the most likely token alone), kept representable in float32


@dataclass(frozen=True)
class Sampling:
    """How the gateway samples: ``temperature`` (below :data:`MIN_TEMPERATURE`: greedy, its log-probs under
    T = 1), ``top_k`` (0: off), ``top_p`` (below :data:`MIN_TOP_P` it keeps the most likely token alone, as at
    that value) and the token cap ``max_tokens`` of one completion. In recording mode the trainer's, for every
    request."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256


@dataclass
class Prepared:
    """One request ready for the sampler, for any dialect: the session ``key`` (None: not recording), the
    engine's ``req``, its prompt ``ids``, the sampler ``job`` and the ``memory`` its answer is remembered in."""

    key: str | None
    req: ChatRequest
    ids: list[int]
    job: Job
    memory: CompletionMemory


@dataclass
class Completed:
    """One completion as the engine answered it, for any dialect: the session ``key`` (None: not recording),
    the ``prompt_ids`` rendered, the chat completion ``body`` (:func:`answer`), the sampler's ``choices`` and
    the ``segments`` a recording session keeps."""

    key: str | None
    prompt_ids: list[int]
    body: dict
    choices: list[Choice]
    segments: list[Segment]


def forced_choice(
    choice: str, name: str | None, tools: list[dict] | None, path: str
) -> tuple[str, str | None]:
    """``(tool_choice, forced name)`` of a :class:`ChatRequest` for a dialect's tool choice: ``choice``
    ``"auto"``, ``"none"``, ``"required"`` (a call of any tool) or ``"function"`` (the tool ``name``). Forcing
    needs tools, and a named tool among them: a 400 at ``path`` (code ``tool_not_offered``, as in the chat dialect) says so."""
    offered = [t["function"]["name"] for t in tools or []]
    if choice in ("required", "function") and not offered:
        raise RequestError(
            400,
            path,
            f"{path}: a forced call needs tools to call; send tools, or leave the tool choice out",
            code=NOT_OFFERED,
        )
    if choice == "function" and name not in offered:
        raise RequestError(
            400,
            path,
            f"{path}: names the tool {name!r}, which is not among the tools ({', '.join(offered)})",
            code=NOT_OFFERED,
        )
    return choice, name if choice == "function" else None


def offered_tools(req: ChatRequest) -> list[dict] | None:
    return req.tools if req.tools and req.tool_choice != "none" else None


def prompt_ids(tokenizer, req: ChatRequest, fmt: ToolFormat, memory: CompletionMemory) -> list[int]:
    """The prompt's ids: the messages through the chat template (module docstring), each assistant message
    this gateway produced spliced in as the ids the policy sampled; a 400 when the template refuses them."""
    nonce = secrets.token_hex(4)
    messages, sampled = [], []
    for m in req.messages:
        found = memory.lookup(m)
        if found is None:
            messages.append(m)
            continue
        messages.append({"role": "assistant", "content": f"<<shifu-sampled-{nonce}-{len(sampled)}>>"})
        sampled.append(found)
    try:
        text = render_messages(tokenizer, messages, offered_tools(req), fmt)
    except Exception as e:  # jinja's raise_exception, a template reading a key the messages lack
        raise bad(
            "messages", f"the chat template refused them ({type(e).__name__}: {e})", "template_error"
        ) from None
    ids = _spliced(tokenizer, text, nonce, sampled)
    if not ids:
        raise bad("messages", "they render to no tokens", "template_error")
    return ids + forced_opening(tokenizer, req, fmt)[1]


def forced_opening(tokenizer, req: ChatRequest, fmt: ToolFormat) -> tuple[str, list[int]]:
    """A forced call's opening (``tool_choice`` ``"required"`` or a named function;
    :func:`shifu.models.tool_calls.call_opening`) as text and ids, tokenised on its own after the generation
    prompt: read tokens of the prompt, never sampled. ``("", [])`` when no call is forced."""
    if not req.forced:
        return "", []
    text = call_opening(tokenizer, fmt, req.forced_name)
    return text, _encode(tokenizer, text)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _spliced(tokenizer, text: str, nonce: str, sampled: list[tuple[str, list[int]]]) -> list[int]:
    """``text``'s ids with each placeholder replaced by the sampled ids it stands for: the text between
    placeholders tokenised piece by piece. Where the template changed a placeholder (it trims or rewrites
    assistant content), or the pieces do not decode back to the text (a tokenizer that adds a prefix space
    to each piece), the whole text with the raw completions in it is tokenised instead."""
    marks = [f"<<shifu-sampled-{nonce}-{k}>>" for k in range(len(sampled))]
    if all(text.count(m) == 1 for m in marks) and all(
        text.index(a) < text.index(b) for a, b in zip(marks, marks[1:])
    ):
        ids, rest = [], text
        for mark, (_, sampled_ids) in zip(marks, sampled):
            before, rest = rest.split(mark, 1)
            ids += _encode(tokenizer, before) + sampled_ids
        ids += _encode(tokenizer, rest)
        plain = text
        for mark, (raw, _) in zip(marks, sampled):
            plain = plain.replace(mark, raw)
        if tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == plain:
            return ids
    for mark, (raw, _) in zip(marks, sampled):
        text = text.replace(mark, raw)
    return _encode(tokenizer, text)


def make_job(
    req: ChatRequest, ids: list[int], sampling: Sampling, positions: int | None, recording: bool
) -> Job:
    """The sampler job of a request: its budget (the request's ``max_tokens`` within the gateway's cap and
    the model's positions) and its sampling setting (the request's, or the trainer's when recording)."""
    room = sampling.max_tokens if positions is None else min(sampling.max_tokens, positions - len(ids))
    if room < 1:
        raise bad(
            "messages",
            f"the prompt has {len(ids)} tokens, which leaves no room in the model's {positions} positions; "
            "send a shorter conversation",
            "context_length_exceeded",
        )
    budget = min(room, req.max_tokens) if req.max_tokens is not None else room
    if recording:
        temperature, top_p, seed = sampling.temperature, sampling.top_p, None
    else:
        temperature = req.temperature if req.temperature is not None else sampling.temperature
        top_p = req.top_p if req.top_p is not None else sampling.top_p
        seed = req.seed
    greedy = temperature < MIN_TEMPERATURE
    return Job(
        prompt_ids=ids,
        n=req.n,
        budget=budget,
        stops=req.stop,
        temperature=1.0 if greedy else temperature,
        top_p=max(top_p, MIN_TOP_P),
        top_k=sampling.top_k,
        greedy=greedy,
        seed=seed,
        top_logprobs=req.top_logprobs if req.logprobs else 0,
        grammar=json_grammar(req, recording),
    )


def json_grammar(req: ChatRequest, recording: bool) -> str | None:
    """llguidance's grammar of the request's ``response_format`` JSON schema (None for text), compact JSON
    (no free whitespace); a 400 where it cannot apply (module docstring)."""
    if req.json_schema is None:
        return None
    if recording:
        raise bad(
            "response_format",
            "a recording gateway takes only {'type': 'text'}: json_object / json_schema sample from the "
            "grammar's masked distribution, whose log-probs the trainer's recomputation (the policy's own) "
            "would not match; leave response_format out",
            CONSTRAINED,
        )
    if req.forced:
        raise bad(
            "response_format",
            "not with a forced tool call (tool_choice): a call is no JSON answer",
            CONSTRAINED,
        )
    if req.logprobs and req.top_logprobs:
        raise bad(
            "top_logprobs",
            "not with a json response_format: the alternatives would come from the unconstrained distribution",
            CONSTRAINED,
        )
    try:
        import llguidance
    except ImportError:
        raise bad(
            "response_format",
            "json answers need llguidance on the server: pip install 'shifu-rlhf[serve]'",
            CONSTRAINED,
        ) from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            req.json_schema, defaults={"whitespace_flexible": False}
        )
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # a schema llguidance's compiler rejects outright
        error = f"{type(e).__name__}: {e}"
    if error:
        raise bad(
            "response_format.json_schema.schema",
            f"llguidance cannot follow it ({error})",
            "invalid_json_schema",
        )
    return grammar


def _finite(lp: float) -> float:
    """A log-prob as JSON takes it: -9999.0 for an impossible token (OpenAI's value for "very unlikely")."""
    return lp if math.isfinite(lp) else -9999.0


def logprob_entry(text: str, log_prob: float, top: list[tuple[str, float]] | None) -> dict:
    """One sampled token's entry of ``logprobs.content`` (a non-streamed answer's, and a streamed chunk's):
    its ``text`` decoded alone, its log-prob and, with ``top_logprobs``, the most likely alternatives' ``(text,
    log-prob)`` (None: ``top_logprobs`` is ``[]``)."""
    alts = [
        {"token": alt, "logprob": _finite(alt_lp), "bytes": list(alt.encode("utf-8"))}
        for alt, alt_lp in top or []
    ]
    return {
        "token": text,
        "logprob": _finite(log_prob),
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": alts,
    }


def _logprobs(tokenizer, choice: Choice, top: int) -> dict:
    content = []
    for k, (t, lp) in enumerate(zip(choice.ids, choice.log_probs)):
        alts = None
        if top and choice.top is not None:
            alts = [(tokenizer.decode([alt]), alt_lp) for alt, alt_lp in choice.top[k]]
        content.append(logprob_entry(tokenizer.decode([t]), lp, alts))
    return {"content": content, "refusal": None}


def _message(tokenizer, req: ChatRequest, fmt: ToolFormat, choice: Choice, memory: CompletionMemory):
    """``(message, finish_reason)`` of one choice; remembers its raw text (module docstring)."""
    text_ids = choice.ids[:-1] if choice.ended == "eos" else choice.ids
    opening, opening_ids = forced_opening(tokenizer, req, fmt)  # a forced call: its prompt's end and the rest
    raw = opening + tokenizer.decode(text_ids, skip_special_tokens=False)
    text = opening + tokenizer.decode(text_ids, skip_special_tokens=True)
    content, calls = (text, [])
    if offered_tools(req):
        content, calls = parse_tool_calls(text, fmt.syntax)
        calls = calls if req.parallel_tool_calls else calls[:1]
    if not calls:
        content = cut_at_stop(text, req.stop) if choice.ended == "stop" else text
    memory.remember(content, calls, raw, opening_ids + text_ids)
    message = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = calls
        return message, "tool_calls"
    return message, "length" if choice.ended == "length" else "stop"


def answer(
    tokenizer,
    req: ChatRequest,
    fmt: ToolFormat,
    ids: list[int],
    job: Job,
    choices: list[Choice],
    memory: CompletionMemory,
    served_name: str,
    recording: bool,
    completion_id: str | None = None,
) -> tuple[dict, list[Segment]]:
    """The response body of a completion and one :class:`Segment` per choice (for a recording session);
    ``completion_id``: the answer's id when a stream has sent it already (else a new one)."""
    out, segments = [], []
    for i, choice in enumerate(choices):
        message, finish = _message(tokenizer, req, fmt, choice, memory)
        item = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            item["logprobs"] = _logprobs(tokenizer, choice, job.top_logprobs)
        if req.return_token_ids:
            item["token_ids"] = choice.ids
        out.append(item)
        segments.append(
            Segment([], choice.ids, choice.log_probs, None, finish, choice.version, choice.entropy)
        )
    sampled = sum(len(c.ids) for c in choices)
    body = {
        "id": completion_id or new_completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_name,
        "choices": out,
        "usage": {
            "prompt_tokens": len(ids),
            "completion_tokens": sampled,
            "total_tokens": len(ids) + sampled,
        },
        "shifu": {
            "policy_version": choices[0].version,
            "temperature": 0.0 if job.greedy else job.temperature,
            "top_p": job.top_p,
            "top_k": job.top_k,
            "max_tokens": job.budget,
            "recorded": recording,
        },
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = ids
    return body, segments


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def check_model(req: ChatRequest, served_name: str) -> None:
    if req.model != served_name:
        raise RequestError(
            404,
            "model",
            f"model: {req.model!r} is not served here; this gateway serves {served_name!r} (GET /v1/models)",
            code="model_not_found",
        )

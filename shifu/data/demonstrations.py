"""A demonstration's token ids and which of them are trained: SFT (and PPO-ptx) learn what the policy would
write, never what it only reads (a system prompt, a user's turn, a tool's output, a template's role headers).

:func:`encode_demonstration` turns a validated SFT row (:mod:`shifu.data.rows`) into ``(prompt_ids,
response_ids, response_mask)``: ``prompt_ids`` is everything read before the first trained token,
``response_ids`` runs from it to the last trained token (an EOS), and ``response_mask`` is True on the
trained tokens of ``response_ids`` and False on those only read.

- ``{"prompt", "response"}``: the prompt (:func:`shifu.data.rows.prompt_text`) is read; the response's
  segments are tokenised one by one, as the response is apart from the prompt (and an episode's observation
  apart from the turn before it), each trained or read as it says; EOS is appended, trained.
- ``messages`` and a tokenizer with a chat template: the ids are the template's rendering of the whole
  conversation, and each trained assistant message's tokens are found by rendering, never by searching
  text. The conversation before it with the generation prompt (``head``) and up to it (``upto``) must
  both be prefixes of the whole, token for token; its tokens from the end of ``head`` through the last EOS
  before the end of ``upto`` are trained: its content and end-of-turn. What the template writes after that
  EOS (ChatML's ``"\\n"``) is read, as it is in an episode (:mod:`shifu.generation.observations`). A
  template that renders a prefix otherwise (it rewrites earlier turns), closes an assistant message without
  EOS, or drops a message's ``tool_calls`` is a :class:`DataError` naming the row and the message.
- ``messages`` with ``tools`` (an agent's chat log): the same, rendered as the policy gateway renders an agent's
  request (:func:`shifu.models.tool_calls.render_messages`: tools natively, or in a Hermes system message with the
  history's calls written in that syntax), so each assistant turn is trained as the policy would have sampled it.
- an ATIF trajectory read as recorded (:mod:`shifu.data.atif`): its ids and trained mask as they are, once
  checked to be the policy's tokenizer's.
- ``messages`` without a chat template: the plain rendering of :func:`shifu.data.rows.prompt_text`,
  ``"{role}: {content}\\n"`` per message, where an assistant message is ``"assistant: "``, its content and
  EOS (trained), then ``"\\n"``.
"""

from __future__ import annotations

from collections.abc import Callable

from shifu.data.atif import check_recorded
from shifu.data.rows import prompt_text, response_segments, trained
from shifu.errors import DataError
from shifu.models.tool_calls import render_messages, tool_format

Where = tuple[str, int | None]
Render = Callable[[list[dict], bool], str]  # (messages, generation prompt) -> the template's text


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_demonstration(
    tokenizer, row: dict, chat_template: bool = True
) -> tuple[list[int], list[int], list[bool]]:
    """A validated SFT row -> ``(prompt_ids, response_ids, response_mask)`` (module docstring); ``chat_template``
    as for :func:`shifu.data.rows.prompt_text` (a ``prompt`` string through the template or verbatim)."""
    where = getattr(row, "where", ("SFT row", None))
    if row.get("token_ids") is not None:  # an ATIF trajectory as recorded
        check_recorded(tokenizer, row)
        ids, mask = row["token_ids"], row["token_train"]
    elif row.get("messages") is None:
        ids, mask = _plain_row(tokenizer, row, chat_template)
    elif row.get("tools") is not None:
        ids, mask = _chat(tokenizer, row["messages"], where, _agent_render(tokenizer, row["tools"], where))
    elif getattr(tokenizer, "chat_template", None):
        ids, mask = _chat(tokenizer, row["messages"], where)
    else:
        ids, mask = _plain_messages(tokenizer, row["messages"], where)
    first, last = mask.index(True), len(mask) - mask[::-1].index(True)
    return ids[:first], ids[first:last], mask[first:last]


def _plain_row(tokenizer, row: dict, chat_template: bool) -> tuple[list[int], list[bool]]:
    ids = _ids(tokenizer, prompt_text(tokenizer, row, chat_template))
    mask = [False] * len(ids)
    for text, train in response_segments(row):
        x = _ids(tokenizer, text)
        ids, mask = ids + x, mask + [train] * len(x)
    return ids + [tokenizer.eos_token_id], mask + [True]


def _plain_messages(tokenizer, messages: list[dict], where: Where) -> tuple[list[int], list[bool]]:
    ids, mask, read = [], [], ""
    for j, m in enumerate(messages):
        if m.get("tool_calls") is not None:
            raise DataError(
                *where,
                f"messages[{j}].tool_calls",
                "the tokenizer has no chat template to write tool calls in",
                "write the call into the message's content as the model writes it, or use a chat model",
            )
        if m["role"] != "assistant":
            read += f"{m['role']}: {m['content']}\n"
            continue
        x = _ids(tokenizer, read + "assistant: ")
        y = _ids(tokenizer, m["content"]) + [tokenizer.eos_token_id]
        ids, mask, read = ids + x + y, mask + [False] * len(x) + [trained(m)] * len(y), "\n"
    return ids, mask


def _template(tokenizer) -> Render:
    return lambda messages, prompt: tokenizer.apply_chat_template(
        messages, add_generation_prompt=prompt, tokenize=False
    )


def _agent_render(tokenizer, tools: list[dict], where: Where) -> Render:
    """The gateway's rendering of an agent's request offering ``tools`` (:func:`render_messages`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            *where,
            "tools",
            "the tokenizer has no chat template to offer tools in",
            "use a chat model, or write the calls into the messages' content and drop 'tools'",
        )
    fmt = tool_format(tokenizer)
    return lambda messages, prompt: render_messages(tokenizer, messages, tools or None, fmt, prompt)


def _text(render: Render, messages: list[dict], generation_prompt: bool, where: Where, i: int) -> str:
    try:
        return render(messages, generation_prompt)
    except Exception as e:  # jinja raises TemplateError, TypeError, UndefinedError, ... from user templates
        calls = any(m.get("tool_calls") is not None for m in messages)
        raise DataError(
            *where,
            f"messages[{i}]",
            f"the chat template cannot render the conversation up to here ({type(e).__name__}: {e})",
            "write tool calls into the message's content as the model writes them, or use a template that "
            "renders tool_calls"
            if calls
            else "check the roles and their order against what the model's template accepts",
        ) from None


def _chat(
    tokenizer, messages: list[dict], where: Where, render: Render | None = None
) -> tuple[list[int], list[bool]]:
    """A chat's ids and trained mask; ``render``: the chat template's text (default: the template alone; an
    agent's chat log: the gateway's rendering with its tools, which writes every tool call)."""
    plain, render = render is None, render or _template(tokenizer)
    try:
        whole = _ids(tokenizer, render(messages, False))
    except Exception:  # named at the first message the template cannot render the conversation up to
        for k in range(1, len(messages) + 1):
            _text(render, messages[:k], False, where, k - 1)
        raise
    mask = [False] * len(whole)
    for i, m in enumerate(messages):
        if plain and m.get("tool_calls") is not None:
            _check_tool_calls_rendered(tokenizer, messages[: i + 1], where)
        if m["role"] != "assistant" or not trained(m):
            continue
        head = _ids(tokenizer, _text(render, messages[:i], True, where, i))
        upto = _ids(tokenizer, _text(render, messages[: i + 1], False, where, i))
        for part in (head, upto):
            if whole[: len(part)] != part:
                raise _rewritten(tokenizer, part, whole, where, i)
        ends = [k for k in range(len(head), len(upto)) if whole[k] == tokenizer.eos_token_id]
        if not ends:
            raise DataError(
                *where,
                f"messages[{i}]",
                f"the chat template does not close an assistant message with EOS ({tokenizer.eos_token!r}), so "
                "the model would not learn where its turn ends",
                "use a template that does (ChatML: <|im_end|> is EOS), or make the template's end-of-turn "
                "token the tokenizer's eos_token",
            )
        mask[len(head) : ends[-1] + 1] = [True] * (ends[-1] + 1 - len(head))
    return whole, mask


def _rewritten(tokenizer, part: list[int], whole: list[int], where: Where, i: int) -> DataError:
    at = next((k for k, (x, y) in enumerate(zip(part, whole)) if x != y), min(len(part), len(whole)))
    return DataError(
        *where,
        f"messages[{i}]",
        f"the chat template renders the conversation up to this message otherwise than in the whole conversation "
        f"(token {at}: {tokenizer.decode(part[at : at + 8])!r} becomes {tokenizer.decode(whole[at : at + 8])!r}), "
        "so its trained tokens cannot be found by rendering",
        "use a template whose earlier turns render the same whatever follows (e.g. ChatML), or split the "
        'conversation into rows that each end at one assistant message, the earlier ones marked "train": false',
    )


def _check_tool_calls_rendered(tokenizer, messages: list[dict], where: Where) -> None:
    """DataError when the template writes the last message's ``tool_calls`` nowhere (SmolLM2's ignores them):
    the calls would silently vanish from what is trained."""
    i, m = len(messages) - 1, messages[-1]
    written = _text(_template(tokenizer), messages, False, where, i)
    without = {k: v for k, v in m.items() if k != "tool_calls"}
    try:
        bare = tokenizer.apply_chat_template([*messages[:-1], without], tokenize=False)
    except Exception:  # the template needs the calls (or content) to render at all: it reads them
        return
    if bare == written:
        raise DataError(
            *where,
            f"messages[{i}].tool_calls",
            "the chat template does not write tool_calls: the calls would vanish from the text trained on",
            "write the call into the message's content as the model writes it (e.g. <tool_call>...</tool_call>), "
            "or use a template that renders tool_calls",
        )

"""Token ids of an episode's first input and of each observation: plain text, or chat messages through the
tokenizer's chat template. Ids are made once and appended; the trajectory is never re-tokenised.

**Plain tokenizers** (no chat template, or ``data.chat_template=false``): the first input and observations are
text, encoded as they are (no special tokens added); the trajectory reads ``first input, turn 1, observation 1,
turn 2, ...`` with nothing in between.

**Chat models**: the first input is a message list (a string becomes one user message), rendered with the
generation prompt. An environment that offers tools (a ``tools`` attribute: OpenAI function schemas, as
:class:`shifu.envs.tool.ToolEnv` has) has them rendered in the model's own format: through the template's
``tools=`` where the template renders tools (Qwen, Llama 3.1, Hermes), else in a system message
(:mod:`shifu.models.tool_calls`; the environment's ``tools_system`` text when it has one, else every tool's schema
and the Hermes call syntax), in every render of the episode. After a turn the policy's action becomes an assistant message and the observation's
messages follow (a string becomes a user message, None none). The observation's ids are the difference of
two renders of the conversation: ``B`` (with the new messages and the generation prompt) minus ``A`` (up to
the assistant message), which must be a prefix of ``B`` token for token, else :class:`TemplateError`. What
the template writes after the assistant's closing EOS in ``A`` (SmolLM2: the ``"\\n"`` after
``<|im_end|>``) belongs to the observation, and so does that EOS when the turn ended at a stop string
instead (the policy did not sample it). For SmolLM2-135M-Instruct (ChatML) a turn that called a tool and its
result read::

    <|im_start|>assistant\\n<tool_call>{...}</tool_call><|im_end|>   <- sampled (trained), EOS included
    \\n<|im_start|>tool\\n10063<|im_end|>\\n<|im_start|>assistant\\n      <- observation (attended, not trained)
"""

from __future__ import annotations

from shifu.errors import ShifuError
from shifu.models.tool_calls import tool_format, tools_system_message, with_tools_system


class TemplateError(ShifuError):
    """The tokenizer's chat template cannot extend a conversation by appending ids (see the module docstring),
    or the environment's messages do not fit the tokenizer."""


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class PlainTurns:
    """One episode's ids for a plain tokenizer: text in, ids out."""

    def __init__(self, tok):
        self.tok = tok

    def _text(self, value, what: str) -> str:
        if isinstance(value, list):
            raise TemplateError(
                f"the environment's {what} is a list of chat messages, but the tokenizer has no chat "
                "template (or data.chat_template=false): return text, or use a chat model"
            )
        return value or ""

    def first(self, first) -> list[int]:
        return _ids(self.tok, self._text(first, "first input"))

    def observation(self, action: str, ended_with_eos: bool, observation) -> list[int]:
        text = self._text(observation, "observation")
        return _ids(self.tok, text) if text else []


class ChatTurns:
    """One episode's ids for a chat model: the conversation so far as messages, each observation's ids the
    difference of two renders (module docstring); ``tools`` offered in the model's own format, or in the
    system message ``tools_system`` where the template has none."""

    def __init__(self, tok, tools: list[dict] | None = None, tools_system: str | None = None):
        self.tok, self.messages, self.tools = tok, [], tools or None
        self.native = self.tools is not None and tool_format(tok).native
        self.system = None  # the system text that offers the tools on a template that does not render them
        if self.tools is not None and not self.native:
            self.system = tools_system if tools_system is not None else tools_system_message(self.tools)

    def render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        if self.system is not None:  # the tools in a system message (before the environment's own, if any)
            messages = with_tools_system(messages, self.system)
        tools = self.tools if self.native else None
        text = self.tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
        return _ids(self.tok, text)

    def first(self, first) -> list[int]:
        self.messages = list(first) if isinstance(first, list) else [{"role": "user", "content": first}]
        return self.render(self.messages, True)

    def observation(self, action: str, ended_with_eos: bool, observation) -> list[int]:
        said = [*self.messages, {"role": "assistant", "content": action}]
        new = observation if isinstance(observation, list) else []
        if isinstance(observation, str):
            new = [{"role": "user", "content": observation}]
        a, b = self.render(said, False), self.render(said + new, True)
        if b[: len(a)] != a:
            at = next(i for i, (x, y) in enumerate(zip(a, b + [None] * len(a))) if x != y)
            raise TemplateError(
                f"the chat template does not extend the conversation: rendered with the observation, token {at} "
                f"of the {len(a)} before it changes ({self.tok.decode(a[at : at + 8])!r} becomes "
                f"{self.tok.decode(b[at : at + 8])!r}), so appending ids would not be what the template says. Use a "
                "template whose earlier turns render the same whatever follows (e.g. ChatML)"
            )
        eos = self.tok.eos_token_id
        k = max((i for i, t in enumerate(a) if t == eos), default=-1)
        content = "".join(action.split())  # (compared without whitespace: decoders differ in spacing)
        if k < 0 or not "".join(self.tok.decode(a[:k]).split()).endswith(content):
            raise TemplateError(
                f"the chat template does not close an assistant message with EOS ({self.tok.eos_token!r}) right "
                "after its content, so the end of a turn cannot be found in it; use a template that does (ChatML: "
                "<|im_end|> is EOS)"
            )
        self.messages = said + new
        return a[k + 1 if ended_with_eos else k :] + b[len(a) :]


def turn_encoder(tok, chat: bool, env: object = None) -> PlainTurns | ChatTurns:
    """A fresh encoder for one episode: :class:`ChatTurns` when ``chat`` and the tokenizer has a template (with
    the tools the environment instance ``env`` offers, its ``tools`` and ``tools_system`` attributes)."""
    if not (chat and getattr(tok, "chat_template", None)):
        return PlainTurns(tok)
    return ChatTurns(tok, getattr(env, "tools", None), getattr(env, "tools_system", None))

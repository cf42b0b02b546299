"""Forced tool calls (``tool_choice: "required"`` or a named function) on the policy gateway, driven by the real
``openai`` client against real uvicorn servers and tiny real models: the call's opening follows the generation
prompt as read ids, the rest is sampled and parsed with it as a tool call, a session records the opening among
the read ids (never sampled), and the next call with the tool's result continues the same trajectory.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from test_gateway import QUESTION, TOOLS, chat_tokenizer, error_of, memorized_policy, recomputed  # noqa: E402

from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.models.tool_calls import call_opening, tool_format  # noqa: E402

NAMED = {"type": "function", "function": {"name": "calculator"}}
REST = ' {"expression": "2+3"}}</tool_call>'  # what the policy writes after the forced opening


@pytest.fixture(scope="module")
def forced():
    """A tiny GPT-2 that, after the opening of a forced calculator call, writes the call's arguments."""
    tok = chat_tokenizer()
    body = {"model": "policy", "messages": QUESTION, "tools": TOOLS, "tool_choice": NAMED}
    return memorized_policy(tok, body, REST), tok


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def forced_call(client, stream: bool) -> tuple[list[int], list[int], dict, str, str | None]:
    """A forced calculator call, streamed or not: (prompt ids, sampled ids, the call, finish, content)."""
    kw = {"model": "policy", "messages": QUESTION, "tools": TOOLS, "tool_choice": NAMED}
    kw["extra_body"] = {"return_token_ids": True}
    if not stream:
        out = client.chat.completions.create(**kw)
        choice = out.choices[0]
        (call,) = choice.message.tool_calls
        ids = choice.model_extra["token_ids"]
        return (
            out.model_extra["prompt_token_ids"],
            ids,
            call.model_dump(),
            choice.finish_reason,
            choice.message.content,
        )
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [ch.delta for c in chunks for ch in c.choices]
    ((call,),) = [d.tool_calls for d in deltas if d.tool_calls]
    call = call.model_dump(include={"id": True, "type": True, "function": {"name", "arguments"}})
    content = "".join(d.content for d in deltas if d.content) or None
    end = chunks[-1].choices[0]
    return (
        chunks[0].model_extra["prompt_token_ids"],
        end.model_extra["token_ids"],
        call,
        end.finish_reason,
        content,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_read_then_sampled_and_the_session_continues_it(forced, stream):
    model, tok = forced
    opening = call_opening(tok, tool_format(tok), "calculator")
    assert opening == '<tool_call>{"name": "calculator", "arguments":'
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=0, max_tokens=40)) as gw:
        key = gw.start_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        extra = {"return_token_ids": True}
        p1, s1, call, finish, content = forced_call(client, stream)
        assert finish == "tool_calls" and content is None
        assert call["function"]["name"] == "calculator"
        assert json.loads(call["function"]["arguments"]) == {"expression": "2+3"}
        turn = {"role": "assistant", "content": None, "tool_calls": [call]}
        follow = [
            *QUESTION,
            turn,
            {"role": "tool", "tool_call_id": call["id"], "content": "5", "name": "calculator"},
        ]
        second = client.chat.completions.create(
            model="policy", messages=follow, tools=TOOLS, max_tokens=3, extra_body=extra
        )
        plain = client.chat.completions.create(
            model="policy", messages=QUESTION, tools=TOOLS, extra_body=extra
        )
        rec = gw.end_session(key)
    p2, s2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    # the prompt is the plain one with the opening after it; only the rest was sampled
    assert p1 == plain.model_extra["prompt_token_ids"] + ids_of(tok, opening)
    assert tok.decode(s1, skip_special_tokens=True) == REST
    # the next prompt extends prompt + completion token for token: one trajectory, no fork
    assert p2[: len(p1) + len(s1)] == p1 + s1
    assert rec.forks == 1 and rec.calls == 3  # the plain call was a fork of its own
    (joined,) = [t for t in rec.trajectories if len(t.segments) == 2]
    one, two = joined.segments
    assert (one.read_ids, one.sampled_ids) == (p1, s1) and one.read_ids[
        -len(ids_of(tok, opening)) :
    ] == ids_of(tok, opening)
    assert (two.read_ids, two.sampled_ids) == (p2[len(p1) + len(s1) :], s2)
    for traj in rec.trajectories:  # faithfulness: the forced ids are read, the sampled ones recomputed
        at = 0
        for seg in traj.segments:
            at += len(seg.read_ids)
            want = recomputed(model, traj.ids[:at], seg.sampled_ids, 1.0)
            torch.testing.assert_close(torch.tensor(seg.log_probs), want, rtol=0, atol=1e-5)
            at += len(seg.sampled_ids)


def test_forced_calls_stream_and_required_reads_the_opening(forced):
    model, tok = forced
    with Gateway(model, tok, sampling=Sampling(temperature=0, max_tokens=40)) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="policy", messages=QUESTION, tools=TOOLS, tool_choice=NAMED, stream=True
            )
        )
        deltas = [ch.delta for c in chunks for ch in c.choices]
        assert not any(d.content for d in deltas)  # a forced call: nothing streams as text
        ((call,),) = [d.tool_calls for d in deltas if d.tool_calls]
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
            "expression": "2+3"
        }
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # required: the opening alone is read; this policy never learnt what follows it, and what it writes is
        # answered as text when it is no call
        out = client.chat.completions.create(
            model="policy",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=4,
            extra_body={"return_token_ids": True},
        )
        prompt = out.model_extra["prompt_token_ids"]
        assert prompt[-len(ids_of(tok, "<tool_call>")) :] == ids_of(tok, "<tool_call>")
        message = out.choices[0].message
        assert message.tool_calls or message.content.startswith("<tool_call>")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=QUESTION, tool_choice="required")
        assert error_of(e.value)["param"] == "tool_choice"

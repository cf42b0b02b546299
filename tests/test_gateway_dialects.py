"""The gateway's other two dialects, OpenAI's Responses API (``POST /v1/responses``) and Anthropic's Messages API
(``POST /v1/messages``), on real uvicorn servers and real tiny models, driven by the official ``openai`` and
``anthropic`` clients: plain answers, a tool round trip in each dialect (the call comes back as the dialect's
call item, its result goes back as the dialect's result item), ``previous_response_id``, refusals naming the
field (Anthropic's in its own error shape), ``x-api-key`` as the session key; and, recording, every dialect's
calls join one trajectory (one agent may mix dialects in one session) whose recorded log-probs are the trainer's
recomputation of every sampled token.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
anthropic = pytest.importorskip("anthropic", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from test_gateway import (  # noqa: E402
    CALL_TEXT,
    QUESTION,
    TOOLS,
    chat_tokenizer,
    memorized_policy,
    post,
    recomputed,
    tiny_policy,
)

from shifu.gateway import Gateway, Sampling  # noqa: E402

TOKEN = "dialects-token"
# a sampling temperature other than 1 (the recorded log-probs are under logits / T), low enough that the
# memorised policy writes its call whatever the draw: at 0.7 a Messages round trip once sampled no call
T = 0.3
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
MESSAGES_TOOLS = [
    {
        "name": "calculator",
        "description": TOOLS[0]["function"]["description"],
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
]


def fp32_floor(model, ids: list[int], at: int, n: int, temperature: float) -> torch.Tensor:
    """The bar for each of ``n`` tokens sampled at ``at``: 1e-5, or 4 float32 spacings of the largest scaled logit
    where that is coarser. This memorized policy's logits divided by a low temperature reach 40 and more, where
    float32 resolves steps of 3.8e-6 only: a decode and a full forward summing in another order differ there by a
    few spacings, which no implementation in float32 avoids."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, at - 1 : at - 1 + n].float() / temperature
    top = logits.abs().amax(dim=-1)
    spacing = torch.nextafter(top, torch.full_like(top, float("inf"))) - top
    return torch.clamp(4 * spacing, min=1e-5)


def assert_faithful(model, rec, temperature: float) -> int:
    """Every sampled token's recorded log-prob is the trainer's recomputation over its whole trajectory at
    ``temperature`` (|diff| <= 1e-5, or the float32 floor of :func:`fp32_floor` where coarser); returns how many
    tokens were checked."""
    checked = 0
    for traj in rec.trajectories:
        at = 0
        for seg in traj.segments:
            at += len(seg.read_ids)
            want = recomputed(model, traj.ids[:at], traj.ids[at : at + len(seg.sampled_ids)], temperature)
            assert len(seg.log_probs) == len(seg.sampled_ids)
            diff = (torch.tensor(seg.log_probs) - want).abs()
            assert (diff <= fp32_floor(model, traj.ids, at, len(seg.sampled_ids), temperature)).all(), (
                diff.max()
            )
            at += len(seg.sampled_ids)
            checked += len(seg.sampled_ids)
    return checked


@pytest.fixture(scope="module")
def calling():
    """A tiny policy that answers the question (with the calculator offered) with the Hermes call, then EOS."""
    tok = chat_tokenizer()
    model = memorized_policy(tok, {"model": "policy", "messages": QUESTION, "tools": TOOLS}, CALL_TEXT)
    return tok, model


@pytest.fixture(scope="module")
def served():
    tok = chat_tokenizer()
    model = tiny_policy(tok)
    with Gateway(model, tok, token=TOKEN, sampling=Sampling(max_tokens=8)) as gw:
        yield gw, tok


# -------------------------------------------------------------------------------------- Responses
def test_responses_answers_text_and_continues_a_previous_response(served):
    gw, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
    first = client.responses.create(
        model="policy", input="hello", instructions="Be brief.", max_output_tokens=5, temperature=0
    )
    assert first.object == "response" and first.id.startswith("resp_")
    (item,) = first.output
    assert item.type == "message" and item.role == "assistant" and first.output_text == item.content[0].text
    assert first.usage.output_tokens <= 5 and first.usage.total_tokens == (
        first.usage.input_tokens + first.usage.output_tokens
    )
    assert first.status == ("incomplete" if first.usage.output_tokens == 5 else "completed")
    assert first.model_extra["shifu"]["temperature"] == 0 and not first.model_extra["shifu"]["recorded"]
    # previous_response_id: the same prompt as sending the whole conversation (greedy: the same answer)
    chained = client.responses.create(
        model="policy", input="and?", previous_response_id=first.id, instructions="Be brief.", temperature=0
    )
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "and?"},
    ]
    whole = client.responses.create(model="policy", input=history, instructions="Be brief.", temperature=0)
    assert chained.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == whole.output_text and chained.previous_response_id == first.id
    unstored = client.responses.create(model="policy", input="hi", store=False, max_output_tokens=2)
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="policy", input="x", previous_response_id=missing)
        assert e.value.response.json()["error"]["param"] == "previous_response_id"
        assert e.value.code == "previous_response_not_found"


def test_responses_refusals_name_the_field(served):
    gw, _ = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
    cases = [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "x", "tool_choice": "sometimes", "tools": RESPONSES_TOOLS}, "tool_choice"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": 5}, "input"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "5", "extra": 1}]},
            "input[0].extra",
        ),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name"),  # the named member's fault
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="policy", **body)
        error = e.value.response.json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ": "), error
    with pytest.raises(openai.BadRequestError) as e:  # an unknown field: the fields of its object are listed
        client.responses.create(model="policy", input=[{"role": "user", "content": "x", "name": "me"}])
    assert e.value.code == "unknown_field" and "type, role, content, id, status" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # an empty list: not "expected a string"
        client.responses.create(model="policy", input=[])
    assert e.value.response.json()["error"]["message"].startswith("input: list should have at least 1 item")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base_url, api_key="wrong", max_retries=0).responses.create(
            model="policy", input="x"
        )


def test_fields_that_change_nothing_are_taken_and_change_nothing(served):
    gw, _ = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
    kw = {"model": "policy", "input": "hello", "temperature": 0, "max_output_tokens": 6}
    noops = {
        "store": False,
        "metadata": {"run": "7"},
        "user": "u",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "truncation": "disabled",
        "text": {"format": {"type": "text"}},
        "include": ["reasoning.encrypted_content"],
        "parallel_tool_calls": True,
    }
    plain, dressed = client.responses.create(**kw), client.responses.create(**kw, **noops)
    assert dressed.output_text == plain.output_text and dressed.usage == plain.usage
    assert dressed.metadata == {"run": "7"} and dressed.store is False
    claude = anthropic.Anthropic(base_url=gw.url, api_key=TOKEN, max_retries=0)
    kw = {"model": "policy", "max_tokens": 6, "messages": [{"role": "user", "content": "hello"}]}
    kw["extra_body"] = {"temperature": 0}
    cached = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    plain = claude.messages.create(**kw)
    dressed = claude.messages.create(
        **(kw | {"messages": cached}),
        metadata={"user_id": "u"},
        service_tier="auto",
        cache_control={"type": "ephemeral"},
    )
    assert dressed.content == plain.content and dressed.usage.output_tokens == plain.usage.output_tokens


# --------------------------------------------------------------------------------------- Messages
def test_messages_answers_with_content_blocks_and_anthropic_errors(served):
    gw, tok = served
    client = anthropic.Anthropic(base_url=gw.url, api_key=TOKEN, max_retries=0)  # sends x-api-key
    out = client.messages.create(
        model="policy",
        max_tokens=6,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hello"}],
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0},
    )
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert out.usage.output_tokens <= 6 and out.usage.input_tokens > 0
    assert out.stop_reason == ("max_tokens" if out.usage.output_tokens == 6 else "end_turn")
    assert all(b.type == "text" for b in out.content)
    # a stop sequence: the text stops before it
    text = out.content[0].text
    if len(text) >= 3:
        stopped = client.messages.create(
            model="policy",
            max_tokens=6,
            messages=[{"role": "user", "content": "hello"}],
            extra_body={"temperature": 0},
            system="Be brief.",
            stop_sequences=[text[1:3]],
        )
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == text[1:3]
        assert text[1:3] not in "".join(b.text for b in stopped.content)
    # refusals: Anthropic's shape, the message naming the field
    cases = [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "maybe"},
                "tools": MESSAGES_TOOLS,
            },
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "extra_body": {"top_k": 3}}, "top_k"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ]
    for body, field in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="policy", max_tokens=4, **body)
        err = e.value.response.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"].startswith(field + ": "), err
    with pytest.raises(anthropic.BadRequestError) as e:  # max_tokens is required, as in Anthropic's API
        client.post("/v1/messages", body={"model": "policy", "messages": []}, cast_to=object)
    assert e.value.response.json()["error"]["message"].startswith("max_tokens: missing")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0).messages.create(
            model="policy", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.response.json()["error"]["type"] == "authentication_error"
    # and the other routes take x-api-key as well
    models = openai.OpenAI(
        base_url=gw.base_url, api_key="x", default_headers={"x-api-key": TOKEN, "Authorization": ""}
    )
    assert [m.id for m in models.models.list().data] == ["policy"]


# ----------------------------------------------------------------------- tool round trips, recorded
def test_a_responses_tool_round_trip_is_recorded_as_one_faithful_trajectory(calling):
    tok, model = calling
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=T, max_tokens=100)) as gw:
        key = gw.start_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        question = [{"role": "user", "content": QUESTION[0]["content"]}]
        first = client.responses.create(model="policy", input=question, tools=RESPONSES_TOOLS)
        (call,) = first.output
        assert call.type == "function_call" and call.name == "calculator"
        assert json.loads(call.arguments) == {"expression": "2+3"} and first.status == "completed"
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
        second = client.responses.create(
            model="policy",
            input=[*question, *first.output, result],
            tools=RESPONSES_TOOLS,
            max_output_tokens=6,
        )
        assert second.output and second.model_extra["shifu"]["recorded"]
        rec = gw.end_session(key)
    assert (rec.calls, rec.forks, len(rec.trajectories)) == (2, 0, 1)
    one, two = rec.trajectories[0].segments
    assert CALL_TEXT in tok.decode(one.sampled_ids) and "\n5" in tok.decode(two.read_ids)
    assert assert_faithful(model, rec, T) == len(one.sampled_ids) + len(two.sampled_ids)


def test_a_messages_tool_round_trip_is_recorded_as_one_faithful_trajectory(calling):
    tok, model = calling
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=T, max_tokens=100)) as gw:
        key = gw.start_session()
        client = anthropic.Anthropic(
            base_url=gw.url, api_key=key, max_retries=0
        )  # x-api-key: the session key
        question = [{"role": "user", "content": QUESTION[0]["content"]}]
        first = client.messages.create(
            model="policy", max_tokens=100, messages=question, tools=MESSAGES_TOOLS
        )
        assert first.stop_reason == "tool_use"
        (use,) = first.content
        assert use.type == "tool_use" and use.name == "calculator" and use.input == {"expression": "2+3"}
        turns = [
            *question,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
        ]
        second = client.messages.create(model="policy", max_tokens=6, messages=turns, tools=MESSAGES_TOOLS)
        assert second.model_extra["shifu"]["recorded"]
        rec = gw.end_session(key)
    assert (rec.calls, rec.forks, len(rec.trajectories)) == (2, 0, 1)
    one, two = rec.trajectories[0].segments
    assert CALL_TEXT in tok.decode(one.sampled_ids) and "\n5" in tok.decode(two.read_ids)
    assert assert_faithful(model, rec, T) == len(one.sampled_ids) + len(two.sampled_ids)


def test_one_session_mixes_dialects_into_one_faithful_trajectory():
    """A chat call, then a Messages call and a Responses call that send its answers back: one trajectory of
    three segments, each call's prompt extending the last token for token."""
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=T, max_tokens=6)) as gw:
        key = gw.start_session(row_id=3)
        chat = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        claude = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
        first = chat.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        said = first.choices[0].message.content
        second = claude.messages.create(
            model="policy",
            max_tokens=6,
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": said}]},
                {"role": "user", "content": "go on"},
            ],
        )
        third = chat.responses.create(
            model="policy",
            input=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "output_text", "text": said}]},
                {"role": "user", "content": "go on"},
                {"role": "assistant", "content": "".join(b.text for b in second.content)},
                {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
            ],
        )
        assert post(gw.url, "/rl/set_reward", {"reward": 1.0, "call": third.id}, key)[0] == 200
        rec = gw.end_session(key)
    assert (rec.row_id, rec.calls, rec.forks, len(rec.trajectories)) == (3, 3, 0, 1)
    segments = rec.trajectories[0].segments
    assert len(segments) == 3 and [s.reward for s in segments] == [None, None, 1.0]
    assert all(len(s.read_ids) > 0 for s in segments)
    assert assert_faithful(model, rec, T) == sum(len(s.sampled_ids) for s in segments)


# ------------------------------------------------------------------ the Agents SDK's default model API
def taught(tok, pairs: list[tuple[list[int], str]]):
    """A tiny GPT-2 trained to answer each prompt (ids) with its text, then EOS."""
    import torch.nn.functional as F

    model = tiny_policy(tok, positions=1024).train()
    rows = [(p, tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for p, t in pairs]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(400):
        loss = sum(
            F.cross_entropy(model(torch.tensor([p + a])).logits[0, len(p) - 1 : -1], torch.tensor(a))
            for p, a in rows
        )
        if loss.item() < 0.01 * len(rows):
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.slow
def test_an_agents_sdk_agent_on_its_default_responses_model_runs_through_the_gateway():
    """The OpenAI Agents SDK's default model API (OpenAIResponsesModel) against a recording gateway, run and
    streamed: the agent calls its tool, reads the result and answers; both calls join one faithful trajectory."""
    import asyncio

    sdk = pytest.importorskip("agents", reason="pip install 'shifu-rlhf[agents]' (openai-agents)")
    sdk.set_tracing_disabled(True)

    @sdk.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    def episode(model, streamed: bool = False) -> tuple[object, object]:
        with Gateway(model, tok, recording=True, sampling=Sampling(temperature=T, max_tokens=96)) as gw:
            key = gw.start_session()
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
            agent = sdk.Agent(
                name="adder",
                instructions="Add numbers with the add tool.",
                model=sdk.OpenAIResponsesModel(model="policy", openai_client=client),
                tools=[add],
            )
            try:
                result = asyncio.run(run(agent, streamed)).final_output
            except sdk.AgentsException as e:  # an untrained policy runs out of tokens: its prompt is recorded
                result = e
            return result, gw.end_session(key)

    async def run(agent, streamed: bool):
        if not streamed:
            return await sdk.Runner.run(agent, "what is 2 plus 3?", max_turns=3)
        result = sdk.Runner.run_streamed(agent, "what is 2 plus 3?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    tok = chat_tokenizer()
    _, rec = episode(tiny_policy(tok, positions=1024))
    first_prompt = rec.trajectories[0].segments[0].read_ids
    _, rec = episode(taught(tok, [(first_prompt, call)]))
    one, two = rec.trajectories[0].segments
    assert call in tok.decode(one.sampled_ids)  # the SDK ran add and sent its result back
    second_prompt = first_prompt + one.sampled_ids + two.read_ids
    model = taught(tok, [(first_prompt, call), (second_prompt, "It is 5.")])
    for streamed in (False, True):  # Runner.run, and Runner.run_streamed on streamed Responses events
        answer, rec = episode(model, streamed)
        assert answer == "It is 5."
        assert (rec.calls, rec.forks, len(rec.trajectories)) == (2, 0, 1)
        assert "\n5" in tok.decode(rec.trajectories[0].segments[1].read_ids)
        assert assert_faithful(model, rec, T) > 0


# ---------------------------------------------------------------------------------------- streaming
def test_a_streamed_response_sends_the_events_of_the_same_answer(served):
    gw, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
    kw = {"model": "policy", "input": "hello", "instructions": "Be brief.", "temperature": 0}
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    # greedy: the same tokens as the plain call; the deltas join into its text
    assert "".join(deltas) == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_a_streamed_message_sends_the_events_of_the_same_answer(served):
    gw, tok = served
    client = anthropic.Anthropic(base_url=gw.url, api_key=TOKEN, max_retries=0)
    kw = {"model": "policy", "max_tokens": 6, "messages": [{"role": "user", "content": "hello"}]}
    kw["extra_body"] = {"temperature": 0}
    plain = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}  # as many as the event loop was woken for
    assert events[0].message.usage.input_tokens == plain.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "".join(b.text for b in plain.content)
    assert events[-2].delta.stop_reason == plain.stop_reason
    assert events[-2].usage.output_tokens == plain.usage.output_tokens
    with client.messages.stream(**kw) as stream:  # the client's own accumulation agrees
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]


def test_streamed_tool_round_trips_are_recorded_as_faithful_trajectories(calling):
    """Each dialect's streamed tool call comes as its call events; the result goes back; each session is one
    trajectory whose recorded log-probs are the trainer's recomputation."""
    tok, model = calling
    question = [{"role": "user", "content": QUESTION[0]["content"]}]
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=T, max_tokens=100)) as gw:
        key = gw.start_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        with client.responses.stream(model="policy", input=question, tools=RESPONSES_TOOLS) as stream:
            kinds = [e.type for e in stream]
            first = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        (call,) = first.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "2+3"}
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
        turn = [*question, *first.output, result]
        list(client.responses.create(model="policy", input=turn, tools=RESPONSES_TOOLS, stream=True))
        responses_rec = gw.end_session(key)

        key = gw.start_session()
        claude = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
        with claude.messages.stream(
            model="policy", max_tokens=100, messages=question, tools=MESSAGES_TOOLS
        ) as s:
            kinds = [e.type for e in s]
            first = s.get_final_message()
        assert "input_json" in kinds and first.stop_reason == "tool_use"
        (use,) = first.content
        assert use.input == {"expression": "2+3"}
        turns = [
            *question,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
        ]
        list(
            claude.messages.create(
                model="policy", max_tokens=6, messages=turns, tools=MESSAGES_TOOLS, stream=True
            )
        )
        messages_rec = gw.end_session(key)
    for rec in (responses_rec, messages_rec):
        assert (rec.calls, rec.forks, len(rec.trajectories)) == (2, 0, 1)
        one, two = rec.trajectories[0].segments
        assert CALL_TEXT in tok.decode(one.sampled_ids) and "\n5" in tok.decode(two.read_ids)
        assert assert_faithful(model, rec, T) == len(one.sampled_ids) + len(two.sampled_ids)


# ------------------------------------------------------------------------------------- forced calls
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_in_both_dialects_are_read_then_sampled_and_recorded_faithfully(stream):
    """Responses' named function tool_choice and Anthropic's {"type": "tool"}: the call's opening is read after
    the generation prompt (recorded among the read ids), the rest is sampled and parsed as the call."""
    from shifu.models.tool_calls import call_opening, tool_format

    tok = chat_tokenizer()
    named = {"type": "function", "function": {"name": "calculator"}}
    rest = ' {"expression": "2+3"}}</tool_call>'
    model = memorized_policy(
        tok, {"model": "policy", "messages": QUESTION, "tools": TOOLS, "tool_choice": named}, rest
    )
    opening = tok(call_opening(tok, tool_format(tok), "calculator"), add_special_tokens=False)["input_ids"]
    question = [{"role": "user", "content": QUESTION[0]["content"]}]
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=T, max_tokens=40)) as gw:
        key = gw.start_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        kw = {"model": "policy", "input": question, "tools": RESPONSES_TOOLS}
        kw["tool_choice"] = {"type": "function", "name": "calculator"}
        if stream:
            with client.responses.stream(**kw) as s:
                first = s.get_final_response()
        else:
            first = client.responses.create(**kw)
        (call,) = first.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "2+3"}
        assert first.tool_choice.name == "calculator"
        responses_rec = gw.end_session(key)

        key = gw.start_session()
        claude = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
        kw = {"model": "policy", "max_tokens": 40, "messages": question, "tools": MESSAGES_TOOLS}
        kw["tool_choice"] = {"type": "tool", "name": "calculator"}
        if stream:
            with claude.messages.stream(**kw) as s:
                first = s.get_final_message()
        else:
            first = claude.messages.create(**kw)
        (use,) = first.content
        assert first.stop_reason == "tool_use" and use.input == {"expression": "2+3"}
        messages_rec = gw.end_session(key)
        # forcing needs the tools, and a named one among them
        spare = gw.start_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=spare, max_retries=0)
        claude = anthropic.Anthropic(base_url=gw.url, api_key=spare, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="policy", input="x", tool_choice="required")
        assert e.value.code == "tool_not_offered"
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(
                model="policy",
                max_tokens=4,
                messages=question,
                tools=MESSAGES_TOOLS,
                tool_choice={"type": "tool", "name": "search"},
            )
        assert e.value.response.json()["error"]["message"].startswith("tool_choice: names the tool 'search'")
    for rec in (responses_rec, messages_rec):
        (traj,) = rec.trajectories
        (seg,) = traj.segments
        assert seg.read_ids[-len(opening) :] == opening and tok.decode(seg.sampled_ids).startswith(rest)
        assert assert_faithful(model, rec, T) == len(seg.sampled_ids)


def test_a_sessions_previous_responses_are_dropped_when_it_ends():
    """``previous_response_id`` state lives as long as the recording session that made it: once the session
    ends, its responses are forgotten (no leak across a trainer's many episodes), other sessions' stay."""
    tok = chat_tokenizer()
    with Gateway(tiny_policy(tok), tok, recording=True, sampling=Sampling(max_tokens=3)) as gw:
        (stored,) = [drop.__self__ for drop in gw.on_end]  # the Responses route's conversations
        keys = [gw.start_session(), gw.start_session()]
        made = []
        for key in keys:
            client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
            first = client.responses.create(model="policy", input="hi")
            chained = client.responses.create(model="policy", input="and?", previous_response_id=first.id)
            made.append((client, chained.id))
        assert len(stored) == 4
        gw.end_session(keys[0])
        assert len(stored) == 2  # the ended session's two responses are gone, the open one's kept
        client, last = made[1]
        assert client.responses.create(model="policy", input="more", previous_response_id=last).id
        status, _ = post(gw.url, "/rl/end_session", None, keys[1])
        assert status == 200 and len(stored) == 0

"""Streamed chat completions (``stream: true``) from the policy gateway, on real uvicorn servers and real tiny
models, read by the real ``openai`` client: chunks in OpenAI's shape whose deltas join into the non-streamed
answer (text held back while it may be a stop string or a tool call's opening, multi-byte characters whole),
tokens sent while the sampler is still sampling, the same tokens and log-probs as a non-streamed call with the
same seed, recorded the same way, and an OpenAI Agents SDK agent run with ``Runner.run_streamed``.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from test_gateway import (  # noqa: E402
    QUESTION,
    TOKEN,
    TOOLS,
    chat_tokenizer,
    memorized_policy,
    recomputed,
    relu_policy,
    tiny_policy,
)

from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.gateway.engine import Engine, IncrementalText, Job, Token  # noqa: E402
from shifu.gateway.streaming import Withheld  # noqa: E402

SAID = "Sure, café ☕ déjà."  # multi-byte characters, split over byte-level tokens
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def streamed(client, **kw) -> tuple[list, dict[int, str]]:
    """The chunks of a streamed completion and each choice's joined content."""
    chunks = list(client.chat.completions.create(model="policy", stream=True, **kw))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    return chunks, texts


@pytest.fixture(scope="module")
def served():
    tok = chat_tokenizer()
    model = tiny_policy(tok)
    gw = Gateway(model, tok, token=TOKEN, sampling=Sampling(max_tokens=16)).start()
    yield gw, model, tok
    gw.close()


# --------------------------------------------------------------------------------- pieces
@pytest.mark.unit
def test_incremental_text_joins_into_the_whole_text_and_never_splits_a_character():
    tok = chat_tokenizer()
    ids = tok(SAID + " ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(ids) > len(SAID.split())  # the accented and emoji characters take several tokens
    inc = IncrementalText(tok)
    pieces = [inc.add(t) for t in ids]
    assert "".join(pieces) == SAID + " ok"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.unit
def test_withheld_text_waits_while_it_may_be_a_stop_string_or_a_call():
    stops = Withheld(["END", "##"])
    assert stops.visible("the E") == "the " and stops.visible("the EN") == "the "
    assert stops.visible("the ENd") == "the ENd" and stops.visible("a END b") == "a "
    assert stops.visible("x #") == "x " and stops.visible("x ##") == "x "
    hermes = Withheld(syntax="hermes")
    assert hermes.visible("let me <tool") == "let me" and hermes.visible("let me <tool_call>{") == "let me"
    assert hermes.visible("a <b") == "a <b" and hermes.visible(" lead") == ""  # stripped before a call
    llama = Withheld(syntax="llama3_json")
    assert llama.visible(' {"name"') == "" and llama.visible("<|py") == "" and llama.visible("hi") == "hi"
    assert Withheld(forced=True).visible("anything") == ""


@pytest.mark.unit
def test_the_engine_hands_each_step_to_a_streaming_job_and_samples_the_same():
    tok = chat_tokenizer()
    engine = Engine(tiny_policy(tok), tok)
    prompt = tok("hello there", add_special_tokens=False)["input_ids"]
    seen: list[tuple[int, Token, str]] = []

    def job(**kw) -> Job:
        return Job(prompt_ids=prompt, n=2, budget=9, stops=[], temperature=1.0, seed=5, top_logprobs=2, **kw)

    plain = engine.run([job()])[0]
    heard = engine.run([job(on_text=lambda *a: seen.append(a))])[0]
    assert [c.ids for c in heard] == [c.ids for c in plain]
    assert [c.log_probs for c in heard] == [c.log_probs for c in plain]
    assert [c.top for c in heard] == [c.top for c in plain]
    for i, choice in enumerate(heard):  # every sampled id, in order, the ending one included
        told = [t for c, t, _ in seen if c == i]
        assert [t.id for t in told] == choice.ids
        # the very log-probs and alternatives the choice returns, as they are sampled
        assert [t.log_prob for t in told] == choice.log_probs
        assert [[(a, lp) for a, _, lp in t.top] for t in told] == choice.top
        assert [t.text for t in told] == [tok.decode([a]) for a in choice.ids]
        for t in (
            told
        ):  # read off the step that sampled the token: among the best with its very log-prob, or below
            best = {a: lp for a, _, lp in t.top}
            assert list(best.values()) == sorted(best.values(), reverse=True)
            assert best[t.id] == t.log_prob if t.id in best else t.log_prob <= min(best.values())
        text_ids = choice.ids[:-1] if choice.ended == "eos" else choice.ids
        text, joined = (
            tok.decode(text_ids, skip_special_tokens=True),
            "".join(s for c, _, s in seen if c == i),
        )
        # all of it, but an incomplete character at the very end (the stream's finish sends it)
        assert text.startswith(joined) and set(text[len(joined) :]) <= {"\ufffd"}


# ---------------------------------------------------------------------------- the chat dialect
@pytest.mark.integration
def test_streamed_chunks_join_into_the_answer_of_the_same_seed(served):
    gw, model, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN)
    kw = {
        "messages": QUESTION,
        "seed": 11,
        "n": 2,
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
    }
    chunks, texts = streamed(client, stream_options={"include_usage": True}, **kw)
    plain = client.chat.completions.create(model="policy", **kw)
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    prompt = chunks[0].model_extra["prompt_token_ids"]
    assert prompt == plain.model_extra["prompt_token_ids"]
    for i, want in enumerate(plain.choices):
        mine = [ch for c in chunks for ch in c.choices if ch.index == i]
        assert mine[0].delta.role == "assistant" and all(ch.delta.role is None for ch in mine[1:])
        assert [ch.finish_reason for ch in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == want.finish_reason and texts[i] == want.message.content
        assert sum(1 for ch in mine if ch.delta.content) > 1  # sent a piece at a time
        # the same tokens and log-probs, which the trainer recomputes
        ids = mine[-1].model_extra["token_ids"]
        assert ids == want.model_extra["token_ids"]
        got = [t.logprob for ch in mine if ch.logprobs for t in ch.logprobs.content]
        assert got == [t.logprob for t in want.logprobs.content]
        torch.testing.assert_close(torch.tensor(got), recomputed(model, prompt, ids, 1.0), rtol=0, atol=1e-5)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage: no usage chunk
    chunks, _ = streamed(client, messages=QUESTION, seed=11)
    assert all(c.choices for c in chunks) and chunks[-1].choices[0].finish_reason is not None


def entries(chunks, i: int) -> list[list]:
    """Per chunk of choice ``i`` that carries log-probs: its delta's content and its entries."""
    return [
        (ch.delta.content or "", ch.logprobs.content)
        for c in chunks
        for ch in c.choices
        if ch.index == i and ch.logprobs is not None
    ]


def texts_of_entries(tok, carried: list, ids: list[int]) -> list[tuple[str, str]]:
    """Per chunk in ``carried`` (:func:`entries`): its delta's content and the text of the sampled ids its
    entries stand for (``ids``: the choice's, in order; the entries are one per id)."""
    out, at = [], 0
    for text, got in carried:
        out.append((text, tok.decode(ids[at : at + len(got)], skip_special_tokens=True)))
        at += len(got)
    assert at == len(ids)
    return out


@pytest.mark.integration
def test_each_content_delta_carries_the_log_probs_of_its_tokens(served):
    gw, model, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN)
    kw = {"messages": QUESTION, "seed": 7, "n": 2, "logprobs": True, "top_logprobs": 2}
    for extra in ({}, {"stop": ["the", "a"]}):  # a stop string cuts the text: its tokens' entries come last
        chunks, _ = streamed(client, extra_body={"return_token_ids": True}, **kw, **extra)
        plain = client.chat.completions.create(
            model="policy", extra_body={"return_token_ids": True}, **kw, **extra
        )
        for i, want in enumerate(plain.choices):
            carried = entries(chunks, i)
            assert sum(1 for text, _ in carried if text) > 1  # with the deltas, not all on the finish chunk
            joined = [e.model_dump() for _, got in carried for e in got]
            assert joined == [e.model_dump() for e in want.logprobs.content]  # token, logprob, bytes, top 2
            assert all(len(e["top_logprobs"]) == 2 for e in joined)
            # each delta's tokens are its text (the bytes of a character together), the last delta's may go on
            # past it (a token the stop string cuts); the finish chunk's never showed (EOS, the stop's)
            deltas = texts_of_entries(tok, carried, want.model_extra["token_ids"])
            for text, said in deltas[:-2]:
                assert said == text
            assert deltas[-2][1].startswith(deltas[-2][0]) and not deltas[-1][0]
            if not extra:  # no stop: the text is its tokens' to the end, the finish chunk's is the EOS only
                assert deltas[-2][1] == deltas[-2][0] and deltas[-1][1] == ""
    # the admitting loop (no seed): the same per delta, log-probs the trainer recomputes
    chunks, texts = streamed(client, messages=QUESTION, logprobs=True, extra_body={"return_token_ids": True})
    carried = entries(chunks, 0)
    (finish,) = [ch for c in chunks for ch in c.choices if ch.finish_reason]
    ids = finish.model_extra["token_ids"]
    joined = [e for _, got in carried for e in got]
    assert [e.token for e in joined] == [tok.decode([t]) for t in ids] and sum(1 for t, _ in carried if t) > 1
    assert all(text == said for text, said in texts_of_entries(tok, carried, ids)[:-1])
    prompt = chunks[0].model_extra["prompt_token_ids"]
    want = recomputed(model, prompt, ids, 1.0)
    torch.testing.assert_close(torch.tensor([e.logprob for e in joined]), want, rtol=0, atol=1e-5)


@pytest.mark.integration
def test_stop_strings_never_show_in_the_stream(served):
    gw, _, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN)
    greedy = client.chat.completions.create(model="policy", messages=QUESTION, temperature=0)
    text = greedy.choices[0].message.content
    assert len(text) >= 6
    for stop in (text[3:6], text[-2:]):
        _, texts = streamed(client, messages=QUESTION, temperature=0, stop=[stop])
        plain = client.chat.completions.create(model="policy", messages=QUESTION, temperature=0, stop=[stop])
        assert texts[0] == plain.choices[0].message.content and stop not in texts[0]


@pytest.mark.integration
def test_the_async_client_streams_while_the_sampler_is_still_sampling():
    """A gate in the model's forward holds the sampler after a few steps: the first text arrives while the
    sampler call has not returned (the engine counts a call once it has)."""
    tok = chat_tokenizer()
    model = relu_policy(tok)  # sampled through the HF forward, where a hook can wait
    gate, forwards = threading.Event(), []

    def hold(module, args, kwargs):
        forwards.append(1)
        if len(forwards) == 6:  # the prompt's forward, then four decode steps ran
            assert gate.wait(60), "the test never opened the gate"

    model.register_forward_pre_hook(hold, with_kwargs=True)
    with Gateway(model, tok, sampling=Sampling(temperature=0, max_tokens=20)) as gw:

        async def main():
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none")
            stream = await client.chat.completions.create(
                model="policy", messages=QUESTION, stream=True, stream_options={"include_usage": True}
            )
            early, text = None, ""
            async for chunk in stream:
                for ch in chunk.choices:
                    if ch.delta.content and early is None:
                        early = (gw.engine.calls, len(forwards))
                        gate.set()
                    text += ch.delta.content or ""
            return early, text

        early, text = asyncio.run(main())
        gate.set()
        # text out while the sampler's call still ran (it waits at the gate until the text arrived)
        assert early[0] == 0 and 1 <= early[1] <= 6
        plain = openai.OpenAI(base_url=gw.base_url, api_key="none").chat.completions.create(
            model="policy", messages=QUESTION
        )
        assert text == plain.choices[0].message.content and gw.engine.calls == 2


@pytest.fixture(scope="module")
def caller():
    """A tiny GPT-2 that answers QUESTION with tools offered by SAID then the calculator's call."""
    tok = chat_tokenizer()
    body = {"model": "policy", "messages": QUESTION, "tools": TOOLS}
    return memorized_policy(tok, body, f"{SAID} {CALL}"), tok


@pytest.mark.integration
def test_a_tool_call_streams_once_complete_and_the_text_before_it_as_typed(caller):
    model, tok = caller
    with Gateway(model, tok, sampling=Sampling(temperature=0, max_tokens=100)) as gw:
        client = openai.OpenAI(base_url=gw.base_url, api_key="none")
        chunks, texts = streamed(client, messages=QUESTION, tools=TOOLS)
        plain = client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
        deltas = [ch.delta for c in chunks for ch in c.choices]
        assert texts[0] == SAID == plain.choices[0].message.content
        assert sum(1 for d in deltas if d.content) > 3  # typed, a piece at a time
        assert not any("<" in (d.content or "") or "\ufffd" in (d.content or "") for d in deltas)
        (calls,) = [d.tool_calls for d in deltas if d.tool_calls]
        (call,) = calls
        assert (call.index, call.type, call.function.name) == (0, "function", "calculator")
        assert call.id.startswith("call_") and json.loads(call.function.arguments) == {"expression": "2+3"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # with logprobs: the text's tokens with its deltas, the call's (and the end's) on the finish chunk
        kw = {
            "messages": QUESTION,
            "tools": TOOLS,
            "logprobs": True,
            "extra_body": {"return_token_ids": True},
        }
        chunks, _ = streamed(client, **kw)
        want = client.chat.completions.create(model="policy", **kw).choices[0]
        carried = entries(chunks, 0)
        got = [e.model_dump() for _, lps in carried for e in lps]
        assert got == [e.model_dump() for e in want.logprobs.content]
        (*typed, (_, call_text)) = texts_of_entries(tok, carried, want.model_extra["token_ids"])
        assert all(text == said for text, said in typed) and "".join(t for t, _ in typed) == SAID
        assert call_text.strip() == CALL  # (the space before the call is stripped from the content)
        # the client's own stream helper accumulates the same message as the plain answer
        with client.chat.completions.stream(model="policy", messages=QUESTION, tools=TOOLS) as stream:
            final = stream.get_final_completion()
        got, want = final.choices[0], plain.choices[0]
        assert got.finish_reason == want.finish_reason and got.message.content == want.message.content
        assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in want.message.tool_calls
        ]
        # the streamed call is remembered like a plain one: sent back, it is the sampled ids again
        said = got.message
        turn = {
            "role": "assistant",
            "content": said.content,
            "tool_calls": [
                c.model_dump(include={"id": True, "type": True, "function": {"name", "arguments"}})
                for c in said.tool_calls
            ],
        }
        follow = [*QUESTION, turn, {"role": "tool", "tool_call_id": said.tool_calls[0].id, "content": "5"}]
        nxt = client.chat.completions.create(
            model="policy", messages=follow, tools=TOOLS, max_tokens=1, extra_body={"return_token_ids": True}
        )
        first = client.chat.completions.create(
            model="policy", messages=QUESTION, tools=TOOLS, extra_body={"return_token_ids": True}
        )
        head = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"][:-1]
        assert nxt.model_extra["prompt_token_ids"][: len(head)] == head


@pytest.mark.integration
def test_a_streamed_call_is_recorded_as_a_plain_one():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    T = 0.8
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=T, max_tokens=10)) as gw:
        key = gw.start_session(row_id=1)
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        chunks, texts = streamed(
            client, messages=QUESTION, n=2, logprobs=True, extra_body={"return_token_ids": True}
        )
        rec = gw.end_session(key)
        gw.set_sampling(temperature=0)  # greedy: a streamed and a plain call sample the same
        keys = [gw.start_session(), gw.start_session()]
        clients = [openai.OpenAI(base_url=gw.base_url, api_key=k, max_retries=0) for k in keys]
        streamed(clients[0], messages=QUESTION)
        clients[1].chat.completions.create(model="policy", messages=QUESTION)
        greedy = [gw.end_session(k).trajectories[0].segments[0] for k in keys]
    assert rec.calls == 1 and len(rec.trajectories) == 2
    prompt = chunks[0].model_extra["prompt_token_ids"]
    for traj in rec.trajectories:
        (seg,) = traj.segments
        (finish,) = [
            ch
            for c in chunks
            for ch in c.choices
            if ch.finish_reason and ch.model_extra["token_ids"] == seg.sampled_ids
        ]
        assert seg.read_ids == prompt and seg.finish_reason == finish.finish_reason
        mine = [ch for c in chunks for ch in c.choices if ch.index == finish.index]
        assert seg.log_probs == [t.logprob for ch in mine if ch.logprobs for t in ch.logprobs.content]
        want = recomputed(model, prompt, seg.sampled_ids, T)
        torch.testing.assert_close(torch.tensor(seg.log_probs), want, rtol=0, atol=1e-5)
    a, b = greedy
    assert (a.read_ids, a.sampled_ids, a.log_probs) == (b.read_ids, b.sampled_ids, b.log_probs)


@pytest.mark.integration
@pytest.mark.slow
def test_an_agents_sdk_agent_streams_through_the_gateway(served):
    sdk = pytest.importorskip("agents", reason="pip install 'shifu-rlhf[agents]' (openai-agents)")
    from openai.types.responses import ResponseTextDeltaEvent

    sdk.set_tracing_disabled(True)
    gw, _, _ = served

    async def main():
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=TOKEN)
        model = sdk.OpenAIChatCompletionsModel(model="policy", openai_client=client)
        agent = sdk.Agent(name="helper", instructions="Answer briefly.", model=model)
        result = sdk.Runner.run_streamed(agent, "what is two plus three?", max_turns=1)
        deltas = [
            e.data.delta
            async for e in result.stream_events()
            if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)
        ]
        return deltas, result

    deltas, result = asyncio.run(main())
    assert len(deltas) > 1 and "".join(deltas) == result.final_output
    assert isinstance(result.final_output, str) and result.final_output


@pytest.mark.integration
def test_a_client_that_goes_away_mid_stream_still_gets_its_call_recorded():
    import time

    import httpx

    tok = chat_tokenizer()
    model = tiny_policy(tok)
    with Gateway(model, tok, recording=True, sampling=Sampling(max_tokens=40)) as gw:
        key = gw.start_session()
        body = {"model": "policy", "messages": QUESTION, "stream": True}
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, headers=headers) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        completion_id = json.loads(first[len("data: ") :])["id"]
        for _ in range(600):  # the call is recorded once its sampling ends, though no one reads it
            try:
                gw.set_reward(key, 1.0, completion_id)
                break
            except KeyError:
                time.sleep(0.05)
        rec = gw.end_session(key)
        assert httpx.get(gw.url + "/health").json()["pending"] == 0
    (traj,) = rec.trajectories
    assert rec.calls == 1 and traj.segments[0].reward == 1.0 and traj.segments[0].sampled_ids


@pytest.mark.integration
def test_concurrent_streams_share_sampler_calls_and_each_gets_its_own_rows(served):
    gw, _, tok = served
    questions = [[{"role": "user", "content": f"question {i}: what is {i} plus {i}?"}] for i in range(6)]

    async def one(client, messages):
        stream = await client.chat.completions.create(
            model="policy",
            messages=messages,
            n=2,
            stream=True,
            max_tokens=12,
            extra_body={"return_token_ids": True},
            stop=["the"],
        )
        texts, ids, prompt = {0: "", 1: ""}, {}, None
        async for chunk in stream:
            prompt = prompt or chunk.model_extra.get("prompt_token_ids")
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    ids[ch.index] = (ch.model_extra["token_ids"], ch.finish_reason)
        return prompt, texts, ids

    async def main():
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=TOKEN)
        return await asyncio.gather(*[one(client, q) for q in questions])

    before = gw.engine.calls
    results = asyncio.run(main())
    assert gw.engine.calls - before < len(questions)  # streams merged into shared sampler calls
    for k, (prompt, texts, ids) in enumerate(results):
        asked = f"question {k}: what is {k} plus {k}?<|endoftext|>\n<|im_start|>assistant\n"
        assert tok.decode(prompt).endswith(asked)  # each stream answers its own request
        for i in (0, 1):  # each choice's streamed text is the text of its own sampled ids
            sampled, finish = ids[i]
            text_ids = sampled[:-1] if sampled[-1] == tok.eos_token_id else sampled
            whole = tok.decode(text_ids, skip_special_tokens=True)
            assert texts[i] == (whole[: whole.index("the")] if finish == "stop" and "the" in whole else whole)


async def solve_streamed(client, row: dict) -> float:
    """An OpenAI Agents SDK agent with a function tool, run with ``Runner.run_streamed``: 1.0 when it says 5."""
    sdk = pytest.importorskip("agents")
    from test_agents_sdk import RESULT, add

    model = sdk.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = sdk.Agent(name="adder", instructions="Add numbers with the add tool.", model=model, tools=[add])
    result = sdk.Runner.run_streamed(agent, row["prompt"], max_turns=4)
    async for _ in result.stream_events():
        pass
    return float(RESULT in str(result.final_output))


@pytest.mark.integration
@pytest.mark.slow
def test_streamed_agents_sdk_episodes_call_their_tool_and_are_recorded_joined():
    pytest.importorskip("agents", reason="pip install 'shifu-rlhf[agents]' (openai-agents)")
    from test_agent import batch_of
    from test_agents_sdk import CALL, QUESTION, RESULT, calling_policy

    from shifu.generation.rollout import SamplingParams
    from shifu.rollout.agent import AgentEpisodes
    from shifu.rollout.episodes import EpisodeLimits
    from shifu.rollout.sources import Policy

    def collect(model, n: int):
        source = AgentEpisodes(
            solve_streamed, "test_gateway_stream:solve_streamed", EpisodeLimits(4, 96, 512)
        )
        policy = Policy(model, tok, with_log_probs=True)
        rows = batch_of([{"prompt": QUESTION} for _ in range(n)])
        return source.collect(policy, rows, SamplingParams(96, 0.7), torch.Generator().manual_seed(0))

    tok = chat_tokenizer()
    first = collect(tiny_policy(tok, positions=1024), 1)  # the SDK's first prompt, as the gateway rendered it
    model = calling_policy(tok, first.prompt_ids[0][first.prompt_mask[0].bool()].tolist())
    t = collect(model, 4)
    m = t.metrics
    assert m["agent/errors"] == 0 and m["agent/forks"] == 0 and m["agent/calls"] == m["agent/turns"]
    assert m["agent/tool_use"] >= 0.5  # the streamed call reached the SDK, which ran the tool
    for i in range(len(t)):
        if t.counts["tool_calls"][i]:  # the tool's result was read between the calls, never trained
            read = t.ids[i][t.attention[i] & ~t.trainable[i]]
            assert f"\n{RESULT}" in tok.decode(read) and CALL in tok.decode(t.ids[i][t.trainable[i]])


def raw_events(url: str, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed completion, read off the wire."""
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.integration
def test_every_chunk_is_what_the_openapi_document_says(served, caller):
    import jsonschema

    from shifu.gateway.app import openapi_document

    gw, _, _ = served
    doc = openapi_document(gw)
    chunk_schema = doc | {"$ref": "#/components/schemas/ChatCompletionChunk"}
    validator = jsonschema.Draft202012Validator(chunk_schema)
    body = {"model": "policy", "messages": QUESTION, "stream": True, "n": 2, "logprobs": True, "seed": 2}
    body |= {"return_token_ids": True, "stream_options": {"include_usage": True}, "stop": ["the"]}
    events = raw_events(gw.url, body)
    model, tok = caller
    with Gateway(model, tok, token=TOKEN, sampling=Sampling(temperature=0, max_tokens=100)) as calling:
        events += raw_events(
            calling.url, {"model": "policy", "messages": QUESTION, "tools": TOOLS, "stream": True}
        )
    assert events.count("[DONE]") == 2
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    for chunk in chunks:
        validator.validate(chunk)
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    assert any("tool_calls" in d for d in deltas) and any(c["choices"] == [] and c["usage"] for c in chunks)

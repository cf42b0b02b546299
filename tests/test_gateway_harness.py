"""What real harnesses do to a recording gateway, on real uvicorn servers and real tiny models: a request sent
again after a timeout or a dropped connection (the ``openai`` client's own retries, raw HTTP re-sends, streamed
or not, in every dialect) is answered once and recorded once; calls sent with another system prompt are side
calls; a request refused for the context limit is noted in the session.
"""

from __future__ import annotations

import json
import threading

import pytest

openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from test_gateway import QUESTION, chat_tokenizer, relu_policy, tiny_policy  # noqa: E402

from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.gateway.retries import Answer, fingerprint  # noqa: E402
from shifu.gateway.sessions import Call, Segment, SessionStore  # noqa: E402


def post(gw, key: str, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(gw.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"} | headers)


def sse_lines(gw, key: str, path: str, body: dict, stop_after: int | None = None) -> list[str]:
    """The ``data:`` lines of a streamed answer; with ``stop_after``, the connection dropped after that many."""
    lines = []
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", gw.base_url + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if stop_after is not None and len(lines) == stop_after:
                    break
    return lines


def gated_policy(tok, gate: threading.Event):
    """A tiny GPT-2 whose forward waits at ``gate`` (:func:`test_gateway.relu_policy`)."""
    model = relu_policy(tok)

    def hold(module, args, kwargs):
        assert gate.wait(120), "the gate never opened"

    model.register_forward_pre_hook(hold, with_kwargs=True)
    return model


@pytest.mark.unit
def test_the_same_request_is_the_same_body_on_the_same_route_whatever_its_key_order():
    body = {"model": "policy", "messages": QUESTION, "max_tokens": 5}
    same = {"max_tokens": 5, "messages": QUESTION, "model": "policy"}
    assert fingerprint("/v1/chat/completions", body, None) == fingerprint("/v1/chat/completions", same, None)
    assert fingerprint("/v1/chat/completions", body, None) != fingerprint("/v1/responses", body, None)
    assert fingerprint("/v1/chat/completions", body, None) != fingerprint("/v1/chat/completions", body, "k1")
    assert fingerprint("/v1/chat/completions", body, None) != fingerprint(
        "/v1/chat/completions", body | {"max_tokens": 6}, None
    )


@pytest.mark.integration
@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_a_clients_retry_after_a_timeout_waits_for_the_first_answer_and_records_one_call(client, monkeypatch):
    """The sampler is held at a gate until the retry has arrived and waits for the first answer: the client's
    first try times out, its retry gets the answer of the first, and the session records one call (the
    ``openai`` client on chat completions, the ``anthropic`` client on Messages, each retrying on its own)."""
    tok = chat_tokenizer()
    gate, requesters = threading.Event(), []
    model = gated_policy(tok, gate)
    answer_of = Answer.response

    async def counted(self):  # (the real method, counting its requesters: the second is the retry)
        requesters.append(self)
        if len(requesters) == 2:
            gate.set()
        return await answer_of(self)

    monkeypatch.setattr(Answer, "response", counted)
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=1.0, max_tokens=8)) as gw:
        key = gw.start_session()
        if client == "openai":
            out = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=3, timeout=1.0)
            said = out.chat.completions.create(model="policy", messages=QUESTION).choices[0].message.content
        else:
            anthropic = pytest.importorskip("anthropic", reason="pip install anthropic")
            out = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=3, timeout=1.0)
            message = out.messages.create(model="policy", max_tokens=8, messages=QUESTION)
            said = "".join(b.text for b in message.content if b.type == "text")
        sampler_calls = gw.engine.calls
        rec = gw.end_session(key)
    assert len(requesters) >= 2 and requesters[0] is requesters[1]  # the retry read the first's answer
    (traj,) = rec.trajectories
    assert rec.calls == 1 and rec.forks == 0 and sampler_calls == 1
    assert tok.decode(traj.segments[0].sampled_ids, skip_special_tokens=True).strip() == said.strip()


@pytest.mark.integration
def test_a_resent_request_gets_the_same_answer_until_the_agent_goes_on_from_it():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=512)
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=1.0, max_tokens=8)) as gw:
        key = gw.start_session()
        body = {"model": "policy", "messages": QUESTION, "return_token_ids": True}
        first, again = post(gw, key, "/chat/completions", body), post(gw, key, "/chat/completions", body)
        assert first.status_code == 200 and again.content == first.content and gw.engine.calls == 1
        said = first.json()["choices"][0]["message"]
        turn = [
            *QUESTION,
            {"role": "assistant", "content": said["content"]},
            {"role": "user", "content": "more"},
        ]
        nxt = post(gw, key, "/chat/completions", {"model": "policy", "messages": turn})
        assert nxt.status_code == 200 and gw.engine.calls == 2
        # the agent went on from the first answer: the first request again is a new call (a fork)
        restart = post(gw, key, "/chat/completions", body)
        assert restart.json()["id"] != first.json()["id"] and gw.engine.calls == 3
        # a client that names its requests draws a sample per name, and a retry under a name gets its answer
        named = [post(gw, key, "/chat/completions", body, **{"Idempotency-Key": k}) for k in ("a", "b", "a")]
        assert named[2].content == named[0].content and named[1].json()["id"] != named[0].json()["id"]
        # a refusal is not kept: asked again, it is refused again (and nothing is recorded)
        bad = body | {"max_tokens": 0}
        assert post(gw, key, "/chat/completions", bad).status_code == 400
        assert post(gw, key, "/chat/completions", bad).status_code == 400
        rec = gw.end_session(key)
    assert rec.calls == 5 and gw.engine.calls == 5 and rec.forks == 3
    assert sorted(len(t.segments) for t in rec.trajectories) == [1, 1, 1, 2]


@pytest.mark.integration
def test_a_retry_takes_no_call_index_so_the_calls_after_it_sample_as_without_it():
    """Completions sample from generators seeded by (row, the call's index in the session): a session with a
    retried first call and one without sample the same second call."""
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=512)
    first = {"model": "policy", "messages": QUESTION}
    second = {"model": "policy", "messages": [{"role": "user", "content": "and what is four plus four?"}]}
    sampled = []
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=1.0, max_tokens=8)) as gw:
        for retried in (True, False):
            key = gw.start_session(row_id=7)
            for body in [first, first, second] if retried else [first, second]:
                assert post(gw, key, "/chat/completions", body).status_code == 200
            rec = gw.end_session(key)
            sampled.append(sorted(tuple(t.segments[0].sampled_ids) for t in rec.trajectories))
            assert rec.calls == 2
    assert sampled[0] == sampled[1]


@pytest.mark.integration
def test_a_stream_dropped_midway_and_sent_again_is_replayed_whole_and_recorded_once():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=512)
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=1.0, max_tokens=12)) as gw:
        key = gw.start_session()
        body = {"model": "policy", "messages": QUESTION, "stream": True, "return_token_ids": True}
        dropped = sse_lines(gw, key, "/chat/completions", body, stop_after=1)
        whole = sse_lines(gw, key, "/chat/completions", body)
        replayed = sse_lines(gw, key, "/chat/completions", body)
        rec = gw.end_session(key)
    assert whole[: len(dropped)] == dropped and replayed == whole and whole[-1] == "data: [DONE]"
    (traj,) = rec.trajectories
    (finish,) = [c for line in whole[:-1] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    assert rec.calls == 1 and gw.engine.calls == 1 and traj.segments[0].sampled_ids == finish["token_ids"]


@pytest.mark.integration
@pytest.mark.parametrize("path", ["/responses", "/messages"])
def test_every_dialect_answers_a_resent_request_once(path):
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=512)
    if path == "/responses":
        body = {"model": "policy", "input": "what is two plus three?", "max_output_tokens": 8}
    else:
        body = {"model": "policy", "max_tokens": 8, "messages": QUESTION}
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=1.0, max_tokens=8)) as gw:
        key = gw.start_session()
        plain = [post(gw, key, path, body, **{"x-api-key": key}) for _ in range(2)]
        streamed = [sse_lines(gw, key, path, body | {"stream": True}) for _ in range(2)]
        rec = gw.end_session(key)
    assert plain[0].status_code == 200 and plain[1].content == plain[0].content
    assert streamed[1] == streamed[0] and streamed[0]
    # a streamed and a plain request are two requests: two calls, each recorded once
    assert rec.calls == 2 and gw.engine.calls == 2


@pytest.mark.integration
def test_side_calls_are_the_calls_sent_with_another_system_prompt():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=512)
    agent = [{"role": "system", "content": "You solve sums."}, *QUESTION]
    title = [{"role": "system", "content": "Write a title."}, *QUESTION]
    with Gateway(model, tok, recording=True, sampling=Sampling(temperature=1.0, max_tokens=6)) as gw:
        key = gw.start_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        first = client.chat.completions.create(model="policy", messages=agent)
        client.chat.completions.create(model="policy", messages=title)  # the harness's title
        turn = {"role": "assistant", "content": first.choices[0].message.content}
        client.chat.completions.create(
            model="policy", messages=[*agent, turn, {"role": "user", "content": "ok?"}]
        )
        rec = gw.end_session(key)
    assert rec.calls == 3 and rec.forks == 1 and rec.side_calls == 1
    assert sorted((t.side, len(t.segments)) for t in rec.trajectories) == [(False, 2), (True, 1)]


@pytest.mark.integration
def test_a_request_refused_for_the_context_limit_is_noted_until_a_call_is_recorded():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=64)
    long = [{"role": "user", "content": "two plus three " * 40}]
    with Gateway(model, tok, recording=True, sampling=Sampling(max_tokens=4)) as gw:
        keys = [gw.start_session(), gw.start_session()]
        client = openai.OpenAI(base_url=gw.base_url, api_key=keys[0], max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=long)
        assert e.value.code == "context_length_exceeded"
        other = openai.OpenAI(base_url=gw.base_url, api_key=keys[1], max_retries=0)
        with pytest.raises(openai.BadRequestError):
            other.chat.completions.create(model="policy", messages=long)
        other.chat.completions.create(model="policy", messages=QUESTION)  # went on: not ended on the limit
        summary = httpx.post(
            gw.url + "/rl/end_session", headers={"Authorization": f"Bearer {keys[0]}"}
        ).json()
        (ended,), went_on = gw.ended_sessions(), gw.end_session(keys[1])
    assert summary["context_exceeded"] is True and summary["side_calls"] == 0 and summary["calls"] == 0
    assert ended.context_exceeded and ended.calls == 0
    assert not went_on.context_exceeded and went_on.calls == 1


def segment(sampled: list[int]) -> Segment:
    return Segment([], sampled, [0.0] * len(sampled), None, "stop", 0)


@pytest.mark.unit
def test_a_kept_request_is_retried_until_a_later_call_goes_on_from_its_call():
    store = SessionStore()
    key = store.start()
    answer = object()
    store.keep(key, "r1", answer)
    assert store.retry_of(key, "r1") is answer  # still being answered
    store.record(key, Call("c1", [1, 2], [segment([3])], None, "r1"))
    store.settle(key, "r1", answer)
    assert store.retry_of(key, "r1") is answer  # answered, its call a leaf
    store.record(key, Call("side", [9, 9], [segment([8])], "title"))  # another branch: changes nothing
    assert store.retry_of(key, "r1") is answer
    store.record(key, Call("c2", [1, 2, 3, 4], [segment([5])]))  # goes on from c1
    assert store.retry_of(key, "r1") is None
    refused = object()
    store.keep(key, "r2", refused)
    store.settle(key, "r2", refused)  # recorded nothing: not kept
    assert store.retry_of(key, "r2") is None
    rec = store.end(key)
    assert (rec.calls, rec.forks, rec.side_calls) == (3, 1, 1)


@pytest.mark.unit
def test_the_agents_system_prompt_is_the_one_most_calls_were_sent_with_a_tie_to_the_first_recorded():
    store = SessionStore()
    key = store.start()
    store.record(key, Call("t", [7], [segment([1])], "title"))  # the title first, then the agent's two turns
    store.record(key, Call("a1", [5], [segment([2])], "agent"))
    store.record(key, Call("a2", [5, 2, 6], [segment([3])], "agent"))
    rec = store.end(key)
    assert sorted((t.side, len(t.segments)) for t in rec.trajectories) == [(False, 2), (True, 1)]
    key = store.start()
    store.record(key, Call("a", [5], [segment([2])], None))  # one each: the first recorded is the agent's
    store.record(key, Call("t", [7], [segment([1])], "title"))
    rec = store.end(key)
    assert [t.side for t in rec.trajectories] == [False, True] and rec.side_calls == 1

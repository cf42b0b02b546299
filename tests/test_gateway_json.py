"""JSON answers (``response_format`` ``json_object`` / ``json_schema``) from the policy gateway, constrained by
llguidance's grammar masks, on a real uvicorn server with a tiny random policy and the real ``openai`` client:
every choice follows the schema, its log-probs are those of the constrained distribution it was drawn from
(recomputed here from the policy's own forward and the grammar's masks), a streamed answer is the plain one,
and a recording gateway refuses them with the reason.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")
llguidance = pytest.importorskip("llguidance", reason="pip install 'shifu-rlhf[serve]'")

from test_gateway import QUESTION, TOOLS, chat_tokenizer, error_of, tiny_policy  # noqa: E402

from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.generation.rollout import policy_forward  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def served():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    with Gateway(model, tok, sampling=Sampling(max_tokens=40)) as gw:
        yield gw, model, tok


def constrained_log_probs(model, tok, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """The log-prob of each of ``ids`` under the policy's ``logits / T`` restricted to what the grammar of
    SCHEMA allows at that point (renormalised over the allowed ids)."""
    from llguidance.hf import from_tokenizer
    from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        *_, dist = policy_forward(
            model, full, torch.ones_like(full), len(prompt), temperature, log_softmax=True
        )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    vocab = dist.shape[-1]
    matcher = llguidance.LLMatcher(from_tokenizer(tok, n_vocab=vocab, eos_token=[tok.eos_token_id]), grammar)
    mask = allocate_token_bitmask(1, vocab)
    out = []
    for k, t in enumerate(ids):
        fill_next_token_bitmask(matcher, mask, 0)
        row = dist[0, k : k + 1].clone()
        apply_token_bitmask_inplace(row, mask)
        out.append(row[0, t] - torch.logsumexp(row[0], -1))
        assert matcher.consume_token(t)
    return torch.stack(out)


def test_json_schema_answers_follow_it_with_the_constrained_log_probs(served):
    gw, model, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key="none")
    out = client.chat.completions.create(
        model="policy",
        messages=QUESTION,
        n=4,
        temperature=1.0,
        logprobs=True,
        response_format=FORMAT,
        extra_body={"return_token_ids": True},
    )
    prompt = out.model_extra["prompt_token_ids"]
    for choice in out.choices:
        answer = json.loads(choice.message.content)
        assert (
            set(answer) == {"answer", "n"} and isinstance(answer["answer"], bool) and answer["n"] in (1, 2, 3)
        )
        ids = choice.model_extra["token_ids"]
        assert choice.finish_reason == "stop" and ids[-1] == tok.eos_token_id  # the grammar's end, then EOS
        got = torch.tensor([t.logprob for t in choice.logprobs.content])
        want = constrained_log_probs(model, tok, prompt, ids, 1.0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # json_object: an object; the streamed answer is the plain one of the same seed
    kw = {"messages": QUESTION, "seed": 3, "response_format": {"type": "json_object"}, "max_tokens": 24}
    plain = client.chat.completions.create(model="policy", **kw)
    chunks = list(client.chat.completions.create(model="policy", stream=True, **kw))
    assert plain.choices[0].message.content.startswith("{")
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == plain.choices[0].message.content
    )


def test_json_answers_are_refused_where_they_cannot_be_recorded_or_followed(served):
    gw, model, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
    cases = [
        (
            {"response_format": FORMAT, "logprobs": True, "top_logprobs": 2},
            "top_logprobs",
            "constrained_decoding",
        ),
        (
            {"response_format": FORMAT, "tools": TOOLS, "tool_choice": "required"},
            "response_format",
            "constrained_decoding",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format.json_schema.schema",
            "invalid_json_schema",
        ),
    ]
    for kw, param, code in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=QUESTION, **kw)
        assert (error_of(e.value)["param"], error_of(e.value)["code"]) == (param, code)
    with Gateway(model, tok, recording=True) as recording:
        key = recording.start_session()
        client = openai.OpenAI(base_url=recording.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=QUESTION, response_format=FORMAT)
        err = error_of(e.value)
        assert (err["param"], err["code"]) == ("response_format", "constrained_decoding")
        assert "recomputation" in err["message"]
        assert recording.end_session(key).calls == 0


def test_the_responses_and_messages_json_formats_are_response_format_under_their_own_names(served):
    """The Responses API's ``text.format`` (json_schema, json_object) and the Messages API's
    ``output_config.format`` constrain the answer as chat's ``response_format`` does, and are refused by the
    same rules, each naming its own field."""
    anthropic = pytest.importorskip("anthropic", reason="pip install 'shifu-rlhf[agents]'")
    gw, model, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
    claude = anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "name": "reply", "schema": SCHEMA, "strict": True}
    out = client.responses.create(model="policy", input=QUESTION[0]["content"], text={"format": fmt})
    answer = json.loads(out.output_text)
    assert out.status == "completed" and set(answer) == {"answer", "n"} and answer["n"] in (1, 2, 3)
    assert out.text.format.type == "json_schema" and out.text.format.name == "reply"  # echoed
    loose = client.responses.create(
        model="policy", input="hi", text={"format": {"type": "json_object"}}, max_output_tokens=24
    )
    assert loose.output_text.startswith("{")
    said = claude.messages.create(
        model="policy",
        max_tokens=40,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert said.stop_reason == "end_turn" and set(json.loads(said.content[0].text)) == {"answer", "n"}
    bogus = {"type": "bogus"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="policy", input="x", text={"format": fmt | {"schema": bogus}})
    assert (e.value.response.json()["error"]["param"], e.value.code) == (
        "text.format.schema",
        "invalid_json_schema",
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="policy",
            max_tokens=4,
            messages=QUESTION,
            output_config={"format": {"type": "json_schema", "schema": bogus}},
        )
    assert e.value.body["error"]["message"].startswith(
        "output_config.format.schema: llguidance cannot follow it"
    )
    with Gateway(model, tok, recording=True) as recording:
        key = recording.start_session()
        client = openai.OpenAI(base_url=recording.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="policy", input="x", text={"format": {"type": "json_object"}})
        err = e.value.response.json()["error"]
        assert (err["param"], err["code"]) == ("text.format", "constrained_decoding")
        assert err["message"].startswith("text.format: ") and "recomputation" in err["message"]
        claude = anthropic.Anthropic(base_url=recording.url, api_key=key, max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(
                model="policy",
                max_tokens=4,
                messages=QUESTION,
                output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
            )
        assert e.value.body["error"]["message"].startswith("output_config.format: a recording gateway")
        assert recording.end_session(key).calls == 0

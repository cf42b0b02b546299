"""The policy gateway (shifu.gateway) on real uvicorn servers and real tiny models, driven by the real ``openai``
client: answers carry the ids the server rendered and sampled, whose log-probs are the trainer's recomputation;
concurrent requests merge into one sampler call; tool calls come back as OpenAI tool_calls; recording sessions
join the calls that extend each other, count the forks, and put each reward on its segment.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_tokenizer

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.gateway.chat.translate import parse_chat_request  # noqa: E402
from shifu.gateway.completions import prompt_ids  # noqa: E402
from shifu.gateway.engine import Engine, Job  # noqa: E402
from shifu.gateway.sessions import CompletionMemory  # noqa: E402
from shifu.generation.rollout import policy_forward  # noqa: E402
from shifu.http.batching import BatchQueue  # noqa: E402
from shifu.models.loading import build_tiny_gpt2  # noqa: E402
from shifu.models.tool_calls import tool_format  # noqa: E402

TOKEN = "gateway-token"
# ChatML whose end of turn is the tiny tokenizer's EOS: a turn the policy ends with EOS is closed by it
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|endoftext|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "what is two plus three?"}]
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def chat_tokenizer(template: str = CHATML):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok


def tiny_policy(tok, seed: int = 0, positions: int = 256):
    return build_tiny_gpt2(tok, n_layer=2, n_embd=64, n_head=2, n_positions=positions, seed=seed).eval()


def relu_policy(tok):
    """A random tiny GPT-2 with relu activations: sampled through the HF forward (not shifu's own decoder), where a
    forward hook can hold the sampler."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=256,
        n_embd=64,
        n_layer=2,
        n_head=2,
        activation_function="relu",
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return GPT2LMHeadModel(cfg).eval()


def memorized_policy(tok, body: dict, target: str):
    """A tiny GPT-2 trained to answer the request ``body`` (rendered as the gateway renders it) with
    ``target`` then EOS: greedy sampling then writes exactly that (a real model emitting a tool call)."""
    req = parse_chat_request(body)
    prompt = prompt_ids(tok, req, tool_format(tok), CompletionMemory())
    answer = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    model = tiny_policy(tok, seed=1, positions=1024).train()
    ids = torch.tensor([prompt + answer])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # until the answer is learnt by heart (Adam at this rate can spike again later, by how much depends on the
    # CPU's float kernels: a fixed step count left the model half-trained on some CPUs)
    for _ in range(500):
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        loss = F.cross_entropy(logits, ids[0, len(prompt) :])
        if loss.item() < 0.01:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.01, f"the tiny model did not learn its answer (loss {loss.item():.3f})"
    return model.eval()


def recomputed(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-probs of ``completion`` after ``prompt`` (policy_forward, float32)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp, _, _ = policy_forward(model, ids, torch.ones_like(ids), len(prompt), temperature)
    return lp[0]


def error_of(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------ one served policy
@pytest.fixture(scope="module")
def served():
    tok = chat_tokenizer()
    model = tiny_policy(tok)
    gw = Gateway(model, tok, token=TOKEN, sampling=Sampling(max_tokens=12)).start()
    yield gw, model, tok
    gw.close()


def test_answers_carry_rendered_and_sampled_ids_whose_log_probs_the_trainer_recomputes(served):
    gw, model, tok = served

    async def main():
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=TOKEN)
        models = await client.models.list()
        answer = await client.chat.completions.create(
            model="policy",
            messages=QUESTION,
            n=2,
            temperature=0.7,
            max_tokens=10,
            logprobs=True,
            top_logprobs=3,
            extra_body={"return_token_ids": True},
        )
        return models, answer

    models, answer = run(main())
    assert [m.id for m in models.data] == ["policy"]
    extra = answer.model_extra
    rendered = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert extra["prompt_token_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert extra["shifu"]["temperature"] == 0.7 and not extra["shifu"]["recorded"]
    assert len(answer.choices) == 2
    for choice in answer.choices:
        ids = choice.model_extra["token_ids"]
        assert 1 <= len(ids) <= 10
        ended = ids[-1] == tok.eos_token_id
        assert choice.finish_reason == ("stop" if ended else "length")
        text_ids = ids[:-1] if ended else ids
        assert choice.message.content == tok.decode(text_ids, skip_special_tokens=True)
        got = torch.tensor([t.logprob for t in choice.logprobs.content])
        assert len(got) == len(ids)
        want = recomputed(model, extra["prompt_token_ids"], ids, 0.7)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for t in choice.logprobs.content:  # the alternatives are the most likely tokens, best first
            tops = [a.logprob for a in t.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-5
    assert answer.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in answer.choices)


def test_seeds_greedy_stops_and_budgets(served):
    gw, model, tok = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN)

    def ids(**kw) -> list[list[int]]:
        kw.setdefault("extra_body", {"return_token_ids": True})
        out = client.chat.completions.create(model="policy", messages=QUESTION, **kw)
        return [c.model_extra["token_ids"] for c in out.choices], out

    a, _ = ids(seed=7, n=3)
    b, _ = ids(seed=7, n=3)
    assert a == b  # a seeded request is sampled alone with its own generator
    g1, out = ids(temperature=0)
    g2, _ = ids(temperature=0)
    assert g1 == g2 and out.model_extra["shifu"]["temperature"] == 0
    # greedy log-probs are under T = 1
    assert out.choices[0].finish_reason in ("stop", "length")
    short, out = ids(max_completion_tokens=3, max_tokens=50)  # the new name wins
    assert len(short[0]) <= 3 and out.model_extra["shifu"]["max_tokens"] == 3
    capped, out = ids(max_tokens=10_000)  # capped by the gateway's --max-tokens
    assert out.model_extra["shifu"]["max_tokens"] == 12 and len(capped[0]) <= 12
    # a stop string: the content stops before it, the token ids keep every sampled token
    text = tok.decode(g1[0], skip_special_tokens=True)
    assert len(text) >= 4  # the greedy answer of this model: 12 tokens of text
    stop = text[2:4]
    stopped, out = ids(temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and stop not in out.choices[0].message.content
    assert stop in tok.decode(stopped[0]) and stopped[0] == g1[0][: len(stopped[0])]


def test_refusals_name_the_field(served):
    gw, _, _ = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="policy", messages=QUESTION, extra_body={"frequency_penalty": 0.5}
        )
    assert (
        error_of(e.value)["param"] == "frequency_penalty" and error_of(e.value)["code"] == "unsupported_value"
    )
    assert "frequency_penalty" in e.value.message and "log-probs" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="policy",
            messages=QUESTION,
            tool_choice={"type": "function", "function": {"name": "search"}},
            tools=TOOLS,
        )
    assert error_of(e.value)["param"] == "tool_choice" and "calculator" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": 5}])
    assert error_of(e.value)["param"] == "messages[0].content"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert error_of(e.value)["code"] == "model_not_found"
    for key in (None, "wrong"):
        anonymous = openai.OpenAI(base_url=gw.base_url, api_key=key or "x", max_retries=0)
        if key is None:
            anonymous = anonymous.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as e:
            anonymous.chat.completions.create(model="policy", messages=QUESTION)
        assert error_of(e.value)["param"] == "Authorization"
    long = [{"role": "user", "content": "the movie was great " * 200}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="policy", messages=long)
    assert error_of(e.value)["code"] == "context_length_exceeded"


# ------------------------------------------------------------------------------------ batching
def test_pending_completions_of_one_setting_merge_into_one_sampler_call():
    tok = chat_tokenizer()
    engine = Engine(tiny_policy(tok), tok)
    prompts = [
        tok(t, add_special_tokens=False)["input_ids"] for t in ("hello there", "the movie", "a cat and")
    ]

    def job(p, budget, **kw) -> Job:
        return Job(prompt_ids=p, n=2, budget=budget, stops=[], temperature=1.0, **kw)

    async def submit(jobs):
        with ThreadPoolExecutor(1) as ex:
            q = BatchQueue(engine.run, ex, engine.joins)
            out = await asyncio.gather(*[q.submit(j) for j in jobs])  # all queued before the loop runs
            await q.close()
            return out

    before = engine.calls
    out = run(submit([job(p, b) for p, b in zip(prompts, (3, 7, 5))]))
    assert engine.calls - before == 1  # three requests, six rows, one call
    for choices, budget in zip(out, (3, 7, 5)):
        assert len(choices) == 2 and all(1 <= len(c.ids) <= budget for c in choices)
        assert all(c.ended == "length" or c.ids[-1] == tok.eos_token_id for c in choices)
    before = engine.calls
    jobs = [job(prompts[0], 4), job(prompts[1], 4)]
    jobs += [job(prompts[2], 4, top_p=0.9), job(prompts[0], 4, seed=3), job(prompts[1], 4, seed=3)]
    run(submit(jobs))
    assert engine.calls - before == 4  # one setting together, top-p apart, each seeded request alone
    # merged rows sample what they sample alone (greedy: the same tokens)
    greedy = [job(p, 6, greedy=True) for p in prompts]
    merged = run(submit(greedy))
    alone = [run(submit([j]))[0] for j in greedy]
    assert [[c.ids for c in m] for m in merged] == [[c.ids for c in a] for a in alone]


def test_concurrent_http_requests_share_sampler_calls(served):
    gw, _, _ = served

    async def main():
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=TOKEN)
        calls = [client.chat.completions.create(model="policy", messages=QUESTION) for _ in range(8)]
        return await asyncio.gather(*calls)

    before = gw.engine.calls
    answers = run(main())
    assert len(answers) == 8 and gw.engine.calls - before < 8


# ----------------------------------------------------------------------------------- tool calls
@pytest.mark.parametrize("template", ["chatml", "qwen_style"])
def test_tool_calls_in_the_models_text_come_back_as_openai_tool_calls(template):
    from test_tool_calls import QWEN_STYLE

    tok = chat_tokenizer(CHATML if template == "chatml" else QWEN_STYLE)
    body = {"model": "policy", "messages": QUESTION, "tools": TOOLS}
    target = CALL_TEXT if template == "chatml" else CALL_TEXT.replace("{", "\n{", 1).replace("}</", "}\n</")
    model = memorized_policy(tok, body, target)
    with Gateway(model, tok, sampling=Sampling(temperature=0, max_tokens=100)) as gw:
        assert gw.format.native == (template == "qwen_style")
        client = openai.OpenAI(base_url=gw.base_url, api_key="none")
        out = client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
            "expression": "2+3"
        }
        # tool_choice none: the tools are not offered, and nothing is parsed
        out = client.chat.completions.create(
            model="policy", messages=QUESTION, tools=TOOLS, tool_choice="none"
        )
        assert out.choices[0].message.tool_calls is None


# ---------------------------------------------------------------------------------- sessions
def smollm2_tokenizer():
    from shifu.errors import ShifuError
    from shifu.models.loading import load_tokenizer
    from shifu.tasks.assets import converted_smollm2

    try:
        return load_tokenizer(converted_smollm2())
    except ShifuError as e:
        pytest.skip(f"SmolLM2 assets not installed: {e}")


def tiny_llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(cfg).eval()


def agent_turns(client, key_client, messages: list[dict], tools):
    """Two calls of an agent that sends the first answer back with a tool result, then one that rewrites
    the first user message (a fork). Returns the three answers."""
    first = client.chat.completions.create(
        model="policy", messages=messages, tools=tools, temperature=1.9, extra_body={"return_token_ids": True}
    )
    said = first.choices[0].message
    turn = {"role": "assistant", "content": said.content}
    if said.tool_calls:
        turn["tool_calls"] = [c.model_dump() for c in said.tool_calls]
    follow = [*messages, turn, {"role": "tool", "tool_call_id": "call_x", "content": "5"}]
    second = client.chat.completions.create(
        model="policy", messages=follow, tools=tools, extra_body={"return_token_ids": True}
    )
    key_client("/rl/set_reward", {"reward": 0.25, "call": "last"})
    rewritten = [{"role": "user", "content": "what is one plus one?"}, *follow[1:]]
    third = client.chat.completions.create(
        model="policy", messages=rewritten, tools=tools, extra_body={"return_token_ids": True}
    )
    return first, second, third


def post(url: str, path: str, body: dict | None, key: str) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method="POST")
    req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("setup", ["tiny_chatml", "smollm2_template"])
def test_sessions_join_extending_calls_count_forks_and_place_rewards(setup):
    if setup == "smollm2_template":
        tok = smollm2_tokenizer()
        model = tiny_llama(tok)
    else:
        tok = chat_tokenizer()
        model = tiny_policy(tok, positions=1024)
    T = 0.8
    with Gateway(
        model, tok, recording=True, token=TOKEN, sampling=Sampling(temperature=T, max_tokens=8)
    ) as gw:
        gw.set_policy(model, 3)
        key = gw.start_session(row_id=17)
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        first, second, third = agent_turns(client, lambda p, b: post(gw.url, p, b, key), QUESTION, TOOLS)
        assert post(gw.url, "/rl/set_reward", {"reward": 1.5}, key)[0] == 200
        rec = gw.end_session(key)
        # calls after the end: the key is no longer a session
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="policy", messages=QUESTION)
    # the request's temperature 1.9 was ignored: the trainer's T sampled
    assert first.model_extra["shifu"]["temperature"] == T and first.model_extra["shifu"]["recorded"]
    assert (rec.row_id, rec.calls, rec.forks, rec.reward) == (17, 3, 1, 1.5)
    joined, forked = rec.trajectories
    assert [len(joined.segments), len(forked.segments)] == [2, 1]
    one, two = joined.segments
    p1, s1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    p2, s2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    # the second prompt extends the first call token for token: prompt, what was sampled, what was read
    assert p2[: len(p1) + len(s1)] == p1 + s1
    assert (one.read_ids, one.sampled_ids, two.read_ids, two.sampled_ids) == (
        p1,
        s1,
        p2[len(p1) + len(s1) :],
        s2,
    )
    assert joined.ids == p2 + s2 and len(two.read_ids) > 0
    assert forked.segments[0].read_ids == third.model_extra["prompt_token_ids"]
    # the reward of the second call is on its segment only; the session's reward on the session
    assert (one.reward, two.reward, forked.segments[0].reward) == (None, 0.25, None)
    assert {s.version for t in rec.trajectories for s in t.segments} == {3}
    # faithfulness: every sampled token's recorded log-prob is the trainer's recomputation over the whole
    # trajectory at the trainer's temperature; what was read has none
    for traj in rec.trajectories:
        at = 0
        for seg in traj.segments:
            at += len(seg.read_ids)
            want = recomputed(model, traj.ids[:at], traj.ids[at : at + len(seg.sampled_ids)], T)
            torch.testing.assert_close(torch.tensor(seg.log_probs), want, rtol=0, atol=1e-5)
            assert len(seg.log_probs) == len(seg.sampled_ids)
            at += len(seg.sampled_ids)


def test_an_outside_harness_drives_sessions_over_http():
    tok = chat_tokenizer()
    model = tiny_policy(tok)
    with Gateway(model, tok, recording=True, token=TOKEN, sampling=Sampling(max_tokens=6)) as gw:
        assert post(gw.url, "/rl/start_session", {}, "wrong")[0] == 401
        status, started = post(gw.url, "/rl/start_session", {"row_id": "task-9"}, TOKEN)
        assert status == 200 and started["row_id"] == "task-9"
        key = started["session_key"]
        body = {"model": "policy", "messages": QUESTION}
        assert post(gw.url, "/v1/chat/completions", body, TOKEN)[0] == 401  # completions need a session key
        status, answer = post(gw.url, "/v1/chat/completions", body, key)
        assert status == 200 and answer["shifu"]["recorded"]
        status, err = post(gw.url, "/rl/set_reward", {"reward": 1.0, "call": "chatcmpl-nope"}, key)
        assert status == 409 and err["error"]["param"] == "call"
        assert post(gw.url, "/rl/set_reward", {"reward": 2.0, "call": answer["id"]}, key)[0] == 200
        status, summary = post(gw.url, "/rl/end_session", None, key)
        assert status == 200 and (summary["calls"], summary["trajectories"], summary["forks"]) == (1, 1, 0)
        (rec,) = gw.ended_sessions()
        assert rec.row_id == "task-9" and rec.trajectories[0].segments[0].reward == 2.0
        assert post(gw.url, "/rl/end_session", None, key)[0] == 401
    with Gateway(model, tok, sampling=Sampling(max_tokens=4)) as plain:  # no recording: no /rl routes
        status, err = post(plain.url, "/rl/start_session", {}, "x")
        assert status == 404 and err["error"]["param"] == "path"


def test_fields_that_change_nothing_are_accepted_and_those_that_would_are_refused_by_name(served):
    gw, _, _ = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
    assert client.models.retrieve("policy").id == "policy"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert error_of(e.value)["code"] == "model_not_found"
    history = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "add", "cache_control": {"type": "ephemeral"}}],
        },
        {
            "role": "assistant",
            "content": None,
            "function_call": None,
            "audio": None,
            "annotations": [],
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5", "name": "calculator"},
    ]
    no_ops = {
        "store": False,
        "metadata": {"run": "a"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "modalities": ["text"],
        "response_format": {"type": "text"},
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "user": "u",
        "stream_options": {"include_usage": True},  # (without stream: nothing to stream)
    }
    plain = client.chat.completions.create(model="policy", messages=history, seed=4)
    with_all = client.chat.completions.create(model="policy", messages=history, seed=4, **no_ops)
    assert with_all.choices[0].message == plain.choices[0].message  # the same sampling
    # the client's own dump of an answer goes back as it is (null audio, function_call, annotations)
    again = [*QUESTION, plain.choices[0].message.model_dump(), {"role": "user", "content": "and?"}]
    assert client.chat.completions.create(model="policy", messages=again, max_tokens=2).choices
    refused = {
        "presence_penalty": 0.3,
        "logit_bias": {"5": 10},
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "reasoning_effort": "low",
        "response_format": {"type": "grammar"},
        "modalities": ["text", "audio"],
    }
    for name, value in refused.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=QUESTION, extra_body={name: value})
        assert error_of(e.value)["param"] == name and error_of(e.value)["code"] == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="policy", messages=QUESTION, extra_body={"verbosity": "low"})
    err = error_of(e.value)
    assert err["param"] == "verbosity" and err["code"] == "unknown_field"
    assert "stream_options" in err["message"] and "store" in err["message"]


# ------------------------------------------------------------------------------ the typed dialects
def test_the_checked_in_openapi_document_is_the_one_the_models_make():
    """shifu/gateway/openapi.json is a copy of the document made from the dialects' typed models; after a
    model changes, write it again: python -m shifu.gateway.openapi."""
    from shifu.gateway import openapi

    assert openapi.FILE.read_text(encoding="utf-8") == openapi.text(), "run: python -m shifu.gateway.openapi"
    doc = openapi.build()
    post = doc["paths"]["/v1/chat/completions"]["post"]
    assert post["parameters"][0]["name"] == "Idempotency-Key"
    assert all(
        doc["paths"][p]["post"]["parameters"] == post["parameters"] for p in ("/v1/responses", "/v1/messages")
    )
    request = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert (
        request["frequency_penalty"]["enum"] == [0, None]
        and "unsupported_value" in request["top_k"]["description"]
    )


def test_answers_are_what_their_models_say(served):
    """Every chat answer, plain or streamed, with token fields and log-probs, validates as the dialect's own
    answer models (strict: no field they do not declare)."""
    from shifu.gateway.chat.protocol import ChatCompletion, ChatCompletionChunk

    gw, _, _ = served
    client = openai.OpenAI(base_url=gw.base_url, api_key=TOKEN, max_retries=0)
    kw = {"model": "policy", "messages": QUESTION, "n": 2, "logprobs": True, "top_logprobs": 2, "seed": 1}
    kw["extra_body"] = {"return_token_ids": True}
    plain = client.chat.completions.with_raw_response.create(**kw)
    ChatCompletion.model_validate(json.loads(plain.text))
    streamed = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = [ChatCompletionChunk.model_validate(c.model_dump(exclude_unset=True)) for c in streamed]
    assert chunks[-1].usage is not None and any(c.choices and c.choices[0].logprobs for c in chunks)


def test_a_recording_gateway_keeps_an_idle_connection_past_uvicorns_default():
    """An agent pauses between its calls (its tools); a server that closes the idle connection just as the next
    request goes out leaves it unanswered (the client sees a connection error). A recording gateway keeps idle
    connections open (RECORDING_KEEP_ALIVE_S); a plain one closes them after uvicorn's 5 s."""
    import http.client
    import time
    from urllib.parse import urlparse

    tok = chat_tokenizer()
    model = tiny_policy(tok)
    with (
        Gateway(model, tok, recording=True, token=TOKEN) as recording,
        Gateway(model, tok) as plain,
    ):
        conns = {}
        for name, gw in (("recording", recording), ("plain", plain)):
            url = urlparse(gw.url)
            conns[name] = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
            conns[name].request("GET", "/health")
            assert conns[name].getresponse().read()
        time.sleep(6)
        for conn in conns.values():
            conn.sock.setblocking(False)
        try:
            conns["plain"].sock.recv(1)  # b"": the server closed it
            plain_closed = True
        except BlockingIOError:
            plain_closed = False
        with pytest.raises(BlockingIOError):  # still open, nothing to read
            conns["recording"].sock.recv(1)
        assert plain_closed
        conns["recording"].sock.setblocking(True)
        conns["recording"].request("GET", "/health")  # the same connection answers
        assert json.loads(conns["recording"].getresponse().read())["status"] == "ok"

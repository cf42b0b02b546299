"""SFT demonstrations from an agent itself (shifu.rollout.teacher, shifu.gateway.teacher): an agent with its own
tool name and argument schema runs against the task's teacher through the gateway; the rows are the ids the
gateway rendered, trained on the teacher's answers; SFT on them teaches a tiny policy the agent's own calls."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gateway import chat_tokenizer, tiny_policy  # noqa: E402

from shifu.data.demonstrations import encode_demonstration  # noqa: E402
from shifu.data.rows import validate_row  # noqa: E402
from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.gateway.chat.translate import parse_chat_request  # noqa: E402
from shifu.gateway.completions import prompt_ids  # noqa: E402
from shifu.gateway.sessions import CompletionMemory  # noqa: E402
from shifu.models.tool_calls import parse_tool_calls, tool_format  # noqa: E402
from shifu.rollout.teacher import check_demonstrations, demonstrations, load_teacher  # noqa: E402
from shifu.tasks.arith_tool import teacher  # noqa: E402

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
SHORT_TOOLS = [  # the agent's own tool, with a schema shorter than math_agent's (fewer ids for the tiny model)
    {
        "type": "function",
        "function": {
            "name": "evaluate_math",
            "description": "compute",
            "parameters": {"type": "object", "properties": {"formula": {"type": "string"}}},
        },
    }
]
FIRST_CALLS: list[dict] = []


async def own_schema_agent(client, row: dict) -> float:
    """No system prompt, its own tool ``evaluate_math(formula)``; the tool's answer sent back; reward: exact."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        if len(messages) == 1:
            FIRST_CALLS.append({"model": "policy", "messages": list(messages), "tools": SHORT_TOOLS})
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=SHORT_TOOLS, max_tokens=128
        )
        m = r.choices[0].message
        if not m.tool_calls:
            return float((m.content or "").strip() == row["answer"])
        messages.append(
            {"role": "assistant", "content": m.content, "tool_calls": [c.model_dump() for c in m.tool_calls]}
        )
        for c in m.tool_calls:
            a, b = json.loads(c.function.arguments).get("formula", "0*0").split("*")
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(int(a) * int(b))})
    return 0.0


def rows_of(pairs) -> list[dict]:
    return [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a, b in pairs]


PAIRS = [(a, b) for a in (123, 456, 789, 321) for b in (12, 34, 56, 78)]


def test_the_arith_tool_teacher_reads_the_offered_schema():
    ask = [{"role": "user", "content": "What is 347*29?"}]
    call = teacher(ask, SHORT_TOOLS)["tool_calls"][0]["function"]
    assert call == {"name": "evaluate_math", "arguments": {"formula": "347*29"}}
    done = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "10063"},
    ]
    assert teacher(done, SHORT_TOOLS) == {"content": "10063", "tool_calls": []}
    assert teacher(ask, None) == {"content": "10063", "tool_calls": []}  # no tool: it answers itself
    unrelated = [{"type": "function", "function": {"name": "weather", "description": "the forecast"}}]
    assert teacher(ask, unrelated)["content"] == "10063"


def test_an_agents_demonstrations_are_the_ids_the_gateway_renders_for_it():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    FIRST_CALLS.clear()
    made = demonstrations(
        own_schema_agent, rows_of(PAIRS[:4]), model, tok, teacher, "arith_tool teacher", max_tokens=128
    )
    check_demonstrations(made, "own_schema_agent", "arith_tool teacher")
    assert made.summary() | {"longest_prompt": 0, "longest": 0} == {
        "episodes": 4,
        "faults": 0,
        "unrewarded": 0,
        "unfinished": 0,
        "unencodable": 0,
        "capped": 0,
        "first_fault": None,
        "demonstrations": 4,
        "longest_prompt": 0,
        "longest": 0,
    }
    assert max(
        len(encode_demonstration(tok, validate_row(r, "sft", ("t", None)), False)[0]) for r in made.rows
    ) == (made.longest_prompt)
    fmt = tool_format(tok)
    for row, first in zip(made.rows, FIRST_CALLS):
        prompt, response, mask = encode_demonstration(tok, validate_row(row, "sft", ("t", None)), False)
        # the first input: exactly what the gateway renders for the agent's first call
        assert prompt == prompt_ids(tok, parse_chat_request(first), fmt, CompletionMemory())
        trained = [t for t, m in zip(response, mask) if m]
        # what trains: the call in the agent's own schema then EOS, and the answer then EOS
        text = tok.decode(trained, skip_special_tokens=False)
        call, answer = text.split(tok.eos_token)[:2]
        content, calls = parse_tool_calls(call, fmt.syntax)
        a, b = first["messages"][0]["content"].removeprefix("What is ").removesuffix("?").split("*")
        assert content is None and calls[0]["function"]["name"] == "evaluate_math"
        assert json.loads(calls[0]["function"]["arguments"]) == {"formula": f"{a}*{b}"}
        assert answer == str(int(a) * int(b)) and text.count(tok.eos_token) == 2
        read = tok.decode([t for t, m in zip(response, mask) if not m])
        assert read.count(str(int(a) * int(b))) == 1  # the tool's result is read, not trained


def test_faults_and_unrewarded_episodes_are_left_out_and_named():
    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)

    async def wrong(client, row):
        await own_schema_agent(client, row)
        return 0.0

    made = demonstrations(wrong, rows_of(PAIRS[:2]), model, tok, teacher, max_tokens=128)
    assert made.unrewarded == 2 and not made.rows
    with pytest.raises(Exception, match="were rewarded 0"):
        check_demonstrations(made, "wrong", "arith_tool teacher")

    def broken(messages, tools):
        return {"tool_calls": [{"function": {"name": ""}}]}

    made = demonstrations(own_schema_agent, rows_of(PAIRS[:1]), model, tok, broken, "broken", max_tokens=128)
    assert made.faults == 1 and "the teacher broken returned the tool call" in made.first_fault


def test_an_endpoint_teacher_answers_as_the_function_does():
    """A teacher behind any OpenAI-compatible endpoint: here a shifu gateway that answers from the function."""
    from shifu.gateway.teacher import TeacherGateway

    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    sampling = Sampling(temperature=0.0, max_tokens=128)
    with TeacherGateway(teacher, model, tok, recording=False, sampling=sampling) as served:
        fn, who = load_teacher(None, served.base_url, "policy")
        assert "policy" in who
        made = fn([{"role": "user", "content": "What is 347*29?"}], SHORT_TOOLS)
    call = made["tool_calls"][0]["function"]
    assert call["name"] == "evaluate_math" and json.loads(call["arguments"]) == {"formula": "347*29"}


def tool_call_share(model, tok, rows: list[dict]) -> float:
    """Of the policy's first calls through the gateway (greedy), the share that parse as a call of the agent's
    own tool with its own argument."""

    async def first_call(client, row):
        r = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": row["prompt"]}],
            tools=SHORT_TOOLS,
            max_tokens=128,
        )
        calls = r.choices[0].message.tool_calls or []
        return (
            bool(calls)
            and calls[0].function.name == "evaluate_math"
            and "formula" in json.loads(calls[0].function.arguments)
        )

    import openai

    with Gateway(model, tok, sampling=Sampling(temperature=0.0, max_tokens=128)) as gw:

        async def all_rows():
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
            return await asyncio.gather(*[first_call(client, row) for row in rows])

        return sum(asyncio.run(all_rows())) / len(rows)


def test_sft_on_the_teachers_demonstrations_teaches_the_agents_own_calls(tmp_path):
    from shifu.models.loading import load_causal_lm, load_tokenizer
    from shifu.pipelines.stages import train_stage
    from shifu.runs.jsonfile import write_jsonl

    tok = chat_tokenizer()
    model = tiny_policy(tok, positions=1024)
    base = tmp_path / "base"
    tok.save_pretrained(str(base))
    model.save_pretrained(str(base))
    made = demonstrations(own_schema_agent, rows_of(PAIRS), model, tok, teacher, max_tokens=128)
    write_jsonl(tmp_path / "demos.jsonl", made.rows)
    held_out = rows_of([(a, b) for a in (234, 567) for b in (23, 45, 67)])
    before = tool_call_share(model, tok, held_out)
    overrides = {
        "model": {"path": str(base)},
        "data": {
            "train": str(tmp_path / "demos.jsonl"),
            "eval": str(tmp_path / "demos.jsonl"),
            "chat_template": False,
            "max_prompt_len": 900,
            "max_len": 1000,
        },
        "max_steps": 60,
        "batch_size": 8,
        "log_every": 20,
        "eval": {"every": 0},
        "optim": {"lr": 3.0e-3, "warmup_steps": 5, "schedule": "constant"},
    }
    train_stage("shifu.trainers.sft", tmp_path / "sft", overrides)
    final = tmp_path / "sft" / "final"
    after = tool_call_share(load_causal_lm(final), load_tokenizer(final), held_out)
    assert before == 0.0 and after >= 0.8, (before, after)


def test_a_quickstart_plan_with_an_agent_starts_sft_from_the_agents_calls(tmp_path, monkeypatch):
    """The arith_tool smollm2 plan with an agent of its own schema (examples/agents/math_agent.py): the teacher
    stage runs the agent against the task's teacher, and SFT reads those rows as rendered; without an agent, or
    with teacher.enabled=false, SFT keeps the task's demonstrations."""
    from shifu.pipelines.quickstart import _plan, agent_start
    from shifu.pipelines.stages import Stages
    from shifu.runs.jsonfile import write_jsonl

    monkeypatch.syspath_prepend(str(EXAMPLES))
    out = tmp_path / "run"
    base = out / "data" / "base"
    tok = chat_tokenizer()
    tok.save_pretrained(str(base))
    tiny_policy(tok, positions=1024).save_pretrained(str(base))
    files = {"sft_train": "task_sft.jsonl", "sft_eval": "task_sft_eval.jsonl"}
    for name, pairs in (("prompts_train", PAIRS[:3]), ("prompts_val", PAIRS[3:5])):
        files[name] = str(out / "data" / f"{name}.jsonl")
        write_jsonl(Path(files[name]), rows_of(pairs))
    agent = [
        "ppo.env.factory=null",
        "ppo.generation.stop=[]",
        "ppo.generation.max_new_tokens=128",
        "ppo.generation.max_total_tokens=400",
    ]
    agent += ["ppo.agent.factory=math_agent:solve", "teacher.num_rows=2"]
    sft, got = agent_start(Stages(out, 0, "test"), _plan("arith_tool", "smollm2", agent), files)
    assert got["sft_train"] == str(out / "teacher" / "sft_train.jsonl")
    assert got["sft_eval"] == str(out / "teacher" / "sft_eval.jsonl")
    assert (
        sft["data"]["chat_template"] is False and sft["data"]["max_len"] > sft["data"]["max_prompt_len"] > 160
    )
    train = [json.loads(x) for x in Path(got["sft_train"]).read_text().splitlines()]
    assert len(train) == 2 and all(
        "evaluate_math" in r["prompt"] and "formula" in r["response"][0]["text"] for r in train
    )
    assert json.loads((out / "teacher" / "DONE").read_text())["sft_eval"]["demonstrations"] == 2
    for sets in ([], [*agent, "teacher.enabled=false"]):
        plan = _plan("arith_tool", "smollm2", sets)
        assert agent_start(Stages(tmp_path / "other", 0, "test"), plan, files) == (plan["sft"], files)
    with pytest.raises(Exception, match="teacher.functon"):
        _plan("arith_tool", "smollm2", ["teacher.functon=x:y"])
    with pytest.raises(
        Exception, match="teacher.num_rows, teacher.eval_rows and teacher.concurrency must be >= 1"
    ):
        _plan("arith_tool", "smollm2", ["teacher.num_rows=0"])

"""The agent frameworks people run, each with its own client, unmodified and with its default settings, against
the policy gateway (what ``shifu serve --policy`` serves) on real uvicorn servers and a tiny real model: the
plain ``openai`` client streaming a tool round trip, litellm, LangChain, LangGraph, pydantic-ai, smolagents and
instructor (the last in an environment of its own, since it pins another ``openai``). These back the
compatibility table of docs/how-to/agents.md.

A random tiny model writes no tool call and no JSON, so each test teaches its policy a script first
(:func:`scripted`): the framework runs against the gateway, every prompt the gateway rendered for it is kept,
the tiny GPT-2 is trained to answer each with the script's reply (a call, its arguments after a forced opening,
a JSON object, a final text), and the framework runs again until every prompt it sends is one the policy has
learnt. The last run is the one asserted on: every request was accepted, and what the framework parsed (a
streamed text, a tool call, a structured output) is what the policy wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import venv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai", reason="pip install 'shifu-rlhf[agents]'")
pytest.importorskip("uvicorn", reason="pip install 'shifu-rlhf[serve]'")

from test_gateway import chat_tokenizer, tiny_policy  # noqa: E402
from test_gateway_dialects import assert_faithful  # noqa: E402

import shifu.gateway.app as gateway_app  # noqa: E402
from shifu.gateway import Gateway, Sampling  # noqa: E402
from shifu.gateway.protocol import bad  # noqa: E402

KEY = "harness-key"
CALL = '<tool_call>{"name": "double", "arguments": {"x": 21}}</tool_call>'
ANSWER = "it is 42"
TOOLS_OFFERED = "You can call these tools:"  # the system text the gateway offers tools with (ChatML has none)


class Script:
    """What the policy is taught to answer: ``reply(prompt_text) -> text`` for every prompt the gateway renders.

    :meth:`run` starts a gateway on the policy (greedy unless a request says otherwise) and runs
    ``harness(base_url)``. The first prompt the policy has not learnt is refused (a 400, so the framework stops
    there), taught, and the harness runs again, at most ``rounds`` times. Returns the last run's result and
    every prompt it sent."""

    def __init__(self, reply, positions: int = 2048):
        self.reply, self.tok = reply, chat_tokenizer()
        self.model = tiny_policy(self.tok, seed=1, positions=positions).eval()
        self.learnt: dict[tuple[int, ...], list[int]] = {}
        self.requests: list = []  # the last run's requests as the gateway parsed them (ChatRequest)

    def run(self, harness, rounds: int = 6):
        for _ in range(rounds):
            seen: list[list[int]] = []
            self.requests = []
            with (
                spying(seen, self.learnt, self.requests),
                Gateway(self.model, self.tok, token=KEY, sampling=GREEDY) as gw,
            ):
                try:
                    result = harness(gw.base_url)
                except Exception:  # refused where the policy has a prompt to learn
                    if not seen or tuple(seen[-1]) in self.learnt:
                        raise
            new = seen[-1] if seen else None
            if new is None or tuple(new) in self.learnt:
                return result, seen
            text = self.reply(self.tok.decode(new))
            self.learnt[tuple(new)] = self.tok(text, add_special_tokens=False)["input_ids"] + [
                self.tok.eos_token_id
            ]
            teach(self.model, self.learnt)
        raise AssertionError(f"the harness kept sending new prompts after {rounds} rounds")

    def recorded(self, harness):
        """The harness once more, on a recording gateway (what ``shifu ppo`` runs an agent on) with a recording key
        (``start_session``) as its API key: its result and what was recorded."""
        with Gateway(self.model, self.tok, recording=True, sampling=GREEDY) as gw:
            key = gw.start_session()
            result = harness(gw.base_url, key)
            return result, gw.end_session(key)


GREEDY = Sampling(temperature=0, max_tokens=96)


@contextlib.contextmanager
def spying(seen: list, learnt: dict, requests: list):
    """Keeps every prompt the gateway renders (its own renderer, called as always) and the request it rendered,
    and refuses the first prompt not in ``learnt`` with a 400 after keeping it."""
    real = gateway_app.prompt_ids

    def spy(*args):
        ids = real(*args)
        if seen and tuple(seen[-1]) not in learnt:
            raise bad("messages", "another prompt is being taught")
        seen.append(list(ids))
        requests.append(args[1])
        if tuple(ids) not in learnt:
            raise bad("messages", "the tiny policy has not learnt this prompt yet")
        return ids

    gateway_app.prompt_ids = spy
    try:
        yield
    finally:
        gateway_app.prompt_ids = real


def teach(model, pairs: dict[tuple[int, ...], list[int]]) -> None:
    """Trains ``model`` until greedy decoding answers every prompt with its reply (each loss < 0.01)."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(600):
        losses = []
        for prompt, answer in pairs.items():
            ids = torch.tensor([list(prompt) + answer])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
            losses.append(F.cross_entropy(logits, ids[0, len(prompt) :]))
        worst = max(x.item() for x in losses)
        if worst < 0.01:
            break
        opt.zero_grad()
        torch.stack(losses).sum().backward()
        opt.step()
    assert worst < 0.01, f"the tiny policy did not learn its script (loss {worst:.3f})"
    model.eval()


def last_turn(prompt: str) -> str:
    """The last message of a rendered ChatML prompt (before the generation prompt)."""
    return prompt.rsplit("<|im_start|>", 2)[-2]


def tool_then_answer(call: str = CALL, answer: str = ANSWER):
    """A script: after a tool's result, ``answer``; else with tools offered ``call``, without ``answer``."""

    def reply(prompt: str) -> str:
        if last_turn(prompt).startswith("tool\n") or TOOLS_OFFERED not in prompt:
            return answer
        return call

    return reply


def forced_rest(name: str, arguments: dict, plain: str = ANSWER):
    """A script: the call of ``name`` with ``arguments`` after a forced call's opening (a named function's,
    which ends at the arguments, or ``tool_choice: "required"``'s ``<tool_call>``); ``plain`` otherwise."""
    rest = " " + json.dumps(arguments) + "}</tool_call>"

    def reply(prompt: str) -> str:
        if prompt.endswith('"arguments":'):
            return rest
        if prompt.endswith("<tool_call>"):
            return '{"name": ' + json.dumps(name) + ', "arguments":' + rest
        return plain

    return reply


# ------------------------------------------------------------------------------------------ openai
def test_openai_streams_a_tool_round_trip():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "double",
                "description": "Double a number.",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            },
        }
    ]

    def harness(base_url):
        client = openai.OpenAI(base_url=base_url, api_key=KEY)
        messages = [{"role": "user", "content": "double 21"}]
        first = list(
            client.chat.completions.create(model="policy", messages=messages, tools=tools, stream=True)
        )
        calls = [c for ch in first for c in (ch.choices[0].delta.tool_calls or []) if ch.choices]
        finish = [ch.choices[0].finish_reason for ch in first if ch.choices and ch.choices[0].finish_reason]
        (call,) = calls
        messages.append({"role": "assistant", "tool_calls": [call.model_dump(exclude={"index"})]})
        x = json.loads(call.function.arguments)["x"]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(2 * x)})
        second = client.chat.completions.create(model="policy", messages=messages, tools=tools, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in second if ch.choices)
        return call, finish, text

    script = Script(tool_then_answer())
    (call, finish, text), prompts = script.run(harness)
    assert [r.stream for r in script.requests] == [True, True]
    assert call.function.name == "double" and json.loads(call.function.arguments) == {"x": 21}
    assert finish == ["tool_calls"] and text == ANSWER and len(prompts) == 2
    assert "<|im_start|>tool\n42<|endoftext|>" in Script(None).tok.decode(prompts[1])


# ----------------------------------------------------------------------------------------- litellm
def test_litellm_streams():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (it would fetch its price list)
    litellm = pytest.importorskip("litellm", reason="pip install 'shifu-rlhf[harnesses]'")

    def harness(base_url):
        chunks = litellm.completion(
            model="openai/policy",
            api_base=base_url,
            api_key=KEY,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        chunks = list(chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]

    script = Script(lambda _: ANSWER)
    (text, finish), _ = script.run(harness)
    assert [r.stream for r in script.requests] == [True]
    assert text == ANSWER and finish == ["stop"]


# --------------------------------------------------------------------------------------- LangChain
class Doubled(__import__("pydantic").BaseModel):
    """The structured answer of the structured-output tests."""

    value: int


def chat_openai(base_url, key=KEY):
    lc = pytest.importorskip("langchain_openai", reason="pip install 'shifu-rlhf[harnesses]'")
    return lc.ChatOpenAI(model="policy", base_url=base_url, api_key=key)


def double_tool():
    from langchain_core.tools import tool

    @tool
    def double(x: int) -> int:
        """Double a number."""
        return 2 * x

    return double


def test_langchain_invoke_stream_and_a_bound_tool_round_trip():
    pytest.importorskip("langchain_openai", reason="pip install 'shifu-rlhf[harnesses]'")
    from langchain_core.messages import HumanMessage, ToolMessage

    def harness(base_url):
        llm = chat_openai(base_url)
        plain = llm.invoke("hi").content
        streamed = "".join(c.content for c in llm.stream("hello"))
        tools = llm.bind_tools([double_tool()])
        messages = [HumanMessage("double 21")]
        called = tools.invoke(messages)
        (call,) = called.tool_calls
        messages += [called, ToolMessage(str(2 * call["args"]["x"]), tool_call_id=call["id"])]
        return plain, streamed, call, tools.invoke(messages).content

    script = Script(tool_then_answer())
    (plain, streamed, call, final), _ = script.run(harness)
    assert [r.stream for r in script.requests] == [False, True, False, False]
    assert plain == streamed == final == ANSWER
    assert call["name"] == "double" and call["args"] == {"x": 21}


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(method):
    """``with_structured_output``: its default (a ``json_schema`` response format, decoded under the grammar)
    and ``function_calling`` (a call forced by name)."""
    pytest.importorskip("langchain_openai", reason="pip install 'shifu-rlhf[harnesses]'")

    def harness(base_url):
        llm = chat_openai(base_url)
        kw = {} if method == "json_schema" else {"method": method}
        return llm.with_structured_output(Doubled, **kw).invoke("double 21")

    script = Script(forced_rest("Doubled", {"value": 42}, plain='{"value":42}'))
    out, prompts = script.run(harness)
    assert out == Doubled(value=42) and len(prompts) == 1
    (req,) = script.requests
    assert (req.json_schema is not None, req.forced_name) == (
        (True, None) if method == "json_schema" else (False, "Doubled")
    )
    forced = Script(None).tok.decode(prompts[0]).endswith('<tool_call>{"name": "Doubled", "arguments":')
    assert forced == (method == "function_calling")  # the call's opening was read, not sampled


# --------------------------------------------------------------------------------------- LangGraph
def test_langgraph_react_agent_calls_its_tool_and_answers():
    pytest.importorskip("langgraph", reason="pip install 'shifu-rlhf[harnesses]'")
    pytest.importorskip("langchain_openai", reason="pip install 'shifu-rlhf[harnesses]'")
    import warnings

    with warnings.catch_warnings():  # (langgraph 1.x points to langchain.agents, not installed here)
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

    def harness(base_url, key=KEY):
        agent = create_react_agent(chat_openai(base_url, key), [double_tool()])
        return agent.invoke({"messages": [("user", "double 21")]})["messages"]

    script = Script(tool_then_answer())
    messages, prompts = script.run(harness)
    assert [m.type for m in messages] == ["human", "ai", "tool", "ai"] and len(prompts) == 2
    assert messages[1].tool_calls[0]["args"] == {"x": 21} and messages[2].content == "42"
    assert messages[3].content == ANSWER
    # recorded for training: one trajectory, the tool's result read between the two sampled turns
    messages, rec = script.recorded(harness)
    assert messages[3].content == ANSWER and (rec.calls, rec.forks, len(rec.trajectories)) == (2, 0, 1)
    one, two = rec.trajectories[0].segments
    assert script.tok.decode(one.sampled_ids) == CALL + "<|endoftext|>" and "tool\n42" in script.tok.decode(
        two.read_ids
    )
    assert assert_faithful(script.model, rec, 1.0) == len(one.sampled_ids) + len(two.sampled_ids)


# ------------------------------------------------------------------------------------- pydantic-ai
def pydantic_model(base_url, key=KEY):
    pytest.importorskip("pydantic_ai", reason="pip install 'shifu-rlhf[harnesses]'")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("policy", provider=OpenAIProvider(base_url=base_url, api_key=key))


def test_pydantic_ai_text_streamed_text_and_a_tool_output():
    pai = pytest.importorskip("pydantic_ai", reason="pip install 'shifu-rlhf[harnesses]'")

    async def streamed(agent):
        async with agent.run_stream("hello") as run:
            return "".join([t async for t in run.stream_text(delta=True)])

    def harness(base_url, key=KEY):
        model = pydantic_model(base_url, key)
        text = pai.Agent(model).run_sync("hi").output
        return (
            text,
            asyncio.run(streamed(pai.Agent(model))),
            pai.Agent(model, output_type=int).run_sync("x").output,
        )

    # output_type=int: pydantic-ai's default tool output, its final_result tool forced with tool_choice required
    script = Script(forced_rest("final_result", {"response": 42}))
    (text, stream, number), prompts = script.run(harness)
    assert [(r.stream, r.tool_choice) for r in script.requests] == [
        (False, "auto"),
        (True, "auto"),
        (False, "required"),
    ]
    assert text == stream == ANSWER and number == 42
    assert Script(None).tok.decode(prompts[-1]).endswith("<tool_call>")  # tool_choice "required"
    # recorded for training: the forced opening read, the rest of the call sampled
    (text, stream, number), rec = script.recorded(harness)
    assert text == stream == ANSWER and number == 42 and rec.calls == 3
    (forced,) = rec.trajectories[-1].segments
    assert script.tok.decode(forced.read_ids).endswith("<tool_call>")
    assert script.tok.decode(forced.sampled_ids).startswith('{"name": "final_result"')
    assert_faithful(script.model, rec, 1.0)


@pytest.mark.parametrize("kind", ["NativeOutput", "PromptedOutput"])
def test_pydantic_ai_json_outputs(kind):
    """NativeOutput sends a ``json_schema`` response format (decoded under the grammar); PromptedOutput asks
    for the JSON in its instructions."""
    pai = pytest.importorskip("pydantic_ai", reason="pip install 'shifu-rlhf[harnesses]'")

    def harness(base_url):
        return (
            pai.Agent(pydantic_model(base_url), output_type=getattr(pai, kind)(Doubled)).run_sync("x").output
        )

    script = Script(lambda _: '{"value":42}')
    out, _ = script.run(harness)
    assert out == Doubled(value=42) and script.requests[0].json_schema is not None


# -------------------------------------------------------------------------------------- smolagents
@pytest.mark.slow
def test_smolagents_tool_calling_agent():
    """``ToolCallingAgent`` with its defaults (every step a call forced with tool_choice required, its long
    system prompt), plain and with ``stream_outputs=True``: the policy's call of final_answer ends the run. (A
    round trip through its own tool is not scripted here: smolagents writes the gateway's random call ids into
    its next prompt, so no two runs send the same one.)"""
    smol = pytest.importorskip("smolagents", reason="pip install 'shifu-rlhf[harnesses]'")

    @smol.tool
    def double(x: int) -> int:
        """Double a number.

        Args:
            x: the number to double
        """
        return 2 * x

    def harness(base_url):
        model = smol.OpenAIServerModel(model_id="policy", api_base=base_url, api_key=KEY)
        runs = []
        for stream in (False, True):
            agent = smol.ToolCallingAgent(
                tools=[double], model=model, stream_outputs=stream, verbosity_level=0
            )
            runs.append((agent.run("double 21"), [type(s).__name__ for s in agent.memory.steps]))
        return runs

    final = ' {"name": "final_answer", "arguments": {"answer": "42"}}</tool_call>'
    script = Script(lambda _: final, positions=4096)
    runs, prompts = script.run(harness)
    assert [(r.stream, r.tool_choice) for r in script.requests] == [(False, "required"), (True, "required")]
    assert runs == [("42", ["TaskStep", "ActionStep"])] * 2 and len(prompts) == 2 and prompts[0] == prompts[1]
    assert Script(None).tok.decode(prompts[0]).endswith("<tool_call>")  # tool_choice "required"


# -------------------------------------------------------------------------------------- instructor
INSTRUCTOR = """
import json, sys
import instructor, openai
from pydantic import BaseModel

class Doubled(BaseModel):
    value: int

def client(**kw):
    return instructor.from_openai(openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2]), **kw)

messages = [{"role": "user", "content": "double 21"}]
tools = client().chat.completions.create(model="policy", response_model=Doubled, messages=messages)
json_mode = client(mode=instructor.Mode.JSON).chat.completions.create(
    model="policy", response_model=Doubled, messages=messages
)
print(json.dumps({"tools": tools.model_dump(), "json": json_mode.model_dump(), "openai": openai.__version__}))
"""


def framework_env(name: str, requirement: str) -> Path:
    """The Python of a virtual environment with ``requirement`` alone installed from the package index, as a
    user would make it (its pins may disagree with this environment's), kept under ~/.cache/shifu between runs.
    Skips when the index cannot be reached."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shifu" / "harness-envs" / name
    python, ready = root / "bin" / "python", root / f"installed-{requirement}"
    if ready.exists():
        return python
    venv.create(root, clear=True, with_pip=True)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirement],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if pip.returncode != 0:
        pytest.skip(f"could not install {requirement} into {root}: {pip.stderr.strip()[-400:]}")
    ready.touch()
    return python


# -------------------------------------------------------------------------------------- verifiers
@pytest.mark.slow
def test_verifiers_plays_a_task_through_its_plain_chat_harness(tmp_path):
    """verifiers 0.4 pins an ``openai`` of its own, so it runs in an environment of its own
    (tests/test_verifiers.py makes it), as shifu runs it: a worker process playing a task of a taskset with its
    plain chat harness (a uv script, a local process) through verifiers' interception server to the gateway. Its
    calls stream with ``stream_options.include_usage``; the reward the task computes from the reply verifiers
    parsed is the policy's text (all `a`: 1.0), served and recorded, the recording faithful."""
    from test_verifiers import tasksets, verifiers_python

    from shifu.envs import verifiers as V

    python = verifiers_python()
    with tasksets(tmp_path):
        worker = V.Worker(str(python), "letters_taskset", "null", {"train": {"num_tasks": 1}})

    def harness(base_url, key=KEY):
        out = worker.submit("train", 0, base_url, key, "policy").result(timeout=600)
        if out["error"]:
            raise RuntimeError(out["error"])
        return out

    try:
        script = Script(lambda _: "aaaa")
        out, prompts = script.run(harness)
        assert (out["reward"], out["turns"], len(prompts)) == (1.0, 1, 1)
        assert [(r.stream, r.include_usage) for r in script.requests] == [(True, True)]
        out, rec = script.recorded(harness)
        assert out["reward"] == 1.0 and (rec.calls, len(rec.trajectories)) == (1, 1)
        assert script.tok.decode(rec.trajectories[0].segments[0].sampled_ids) == "aaaa<|endoftext|>"
        assert assert_faithful(script.model, rec, 1.0) == len(rec.trajectories[0].segments[0].sampled_ids)
    finally:
        worker.stop()


@pytest.mark.slow
def test_instructor_tools_mode_and_json_mode():
    """instructor pins an ``openai`` of its own, so it runs in an environment of its own: its default mode
    (a tool call forced by name) and its JSON mode (a ``json_object`` response format)."""
    python = framework_env("instructor", "instructor>=1.10")

    def harness(base_url):
        out = subprocess.run(
            [str(python), "-c", INSTRUCTOR, base_url, KEY], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    script = Script(forced_rest("Doubled", {"value": 42}, plain='{"value":42}'))
    out, prompts = script.run(harness)
    assert out["tools"] == out["json"] == {"value": 42} and len(prompts) == 2
    tools, json_mode = script.requests
    assert tools.forced_name == "Doubled" and json_mode.json_schema is not None and not json_mode.tools
    assert Script(None).tok.decode(prompts[0]).endswith('<tool_call>{"name": "Doubled", "arguments":')
